"""HyperMixer's synthetic task on a CPU (Mai et al., "HyperMixer", ACL 2023, §4.7, Fig. 5, Fig. 6, App. B.4).

The task is Fleuret's toy attention problem (Deep Learning Course 13.2, 2019): a 1-D sequence holds two
triangles and two rectangles (boxes) of random positions, widths and heights; the target has the same shapes in
the same places, every triangle with the mean height of the two triangles and every box with the mean height of
the two boxes (App. B.4). Every model is

    conv(1->c) ReLU conv(c->c) ReLU [token mixer] conv(c->c) ReLU conv(c->1)

with 1-D convolutions of kernel 5 and zero padding 2 (App. B.4). The token mixer is the project's own
HyperMixing (`mixers/hypermixer.py`), MLP-Mixer token-mixing MLP (`mixers/mlp_mixer.py`) or dot-product
attention (`mixers/attention.py`), built from a small `T5Config`; "none" puts one more conv + ReLU in its
place. The metric is the test MSE against the number of training examples (Fig. 5b); the pseudo-attention maps
are input gradients d output_i / d input_j after training on 25,000 examples (Fig. 5c/d, Fig. 6, App. B.4).

The HyperMixer paper gives no sizes or training settings for this task; docs/reproductions.md ("Settings beside
the paper's") lists ours beside those of Fleuret's course code (which the paper cites as its set-up). Beyond that
table: input normalised by the training set's mean and std, MSE on the raw target scale; HyperMixing tied, with
LayerNorm and sinusoidal p_j (the project's defaults); attention with no position information (only the
convolutions see positions); no residual connection around the mixer (Fleuret's model has none).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.attention import Attention
from remixer_t5.model.mixers.hypermixer import HyperMixing
from remixer_t5.model.mixers.mlp_mixer import TokenMixingMlp
from remixer_t5.repro import emitter, ints, mean_range, pyplot

MODELS = ("none", "mlp_mixer", "hypermixer", "attention")
LABELS = {"none": "None", "mlp_mixer": "MLP-Mixer", "hypermixer": "HyperMixer", "attention": "Self-attention"}


# --- data -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """Fleuret's toy problem (DLC 13.2); the HyperMixer paper gives no sizes (App. B.4)."""

  length: int = 100
  height_min: float = 1.0
  height_max: float = 25.0
  width_min: float = 5.0
  width_max: float = 11.0
  noise: float = 0.3  # input noise U[-noise/2, noise/2]
  min_height_gap: float = 4.0  # the two heights of a pair differ by more than this

  def __post_init__(self):
    if self.length < 2 * self.width_max + 4:
      raise ValueError(f"TaskSpec.length must fit four shapes of width {self.width_max}; got {self.length}")
    if not 0 < self.height_min < self.height_max:
      raise ValueError(f"TaskSpec needs 0 < height_min < height_max; got {self.height_min}, {self.height_max}")
    if not 0 < self.width_min <= self.width_max:
      raise ValueError(f"TaskSpec needs 0 < width_min <= width_max; got {self.width_min}, {self.width_max}")
    if self.min_height_gap >= self.height_max - self.height_min:
      raise ValueError(
        f"TaskSpec.min_height_gap {self.min_height_gap} leaves no valid pair of heights in "
        f"[{self.height_min}, {self.height_max}]"
      )


def render(triangles: np.ndarray, boxes: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Shapes -> sequences. triangles, boxes: [n, 2, 3] rows (centre, height, width).

  A triangle at integer position t is max(0, h - max(0, |t - c| - 1/2) * 2h / w) (flat top of width 1); a box
  is h where |t - c| < w/2. Returns (sequence [n, length] = the largest shape value at each position,
  collision [n] = two shapes are non-zero at the same or at adjacent positions)."""
  t = np.arange(length, dtype=np.float64)[None, :, None]
  c, h, w = (a[:, None, :] for a in (triangles[..., 0], triangles[..., 1], triangles[..., 2]))
  tri = np.maximum(h - np.maximum(np.abs(t - c) - 0.5, 0.0) * 2.0 * h / w, 0.0)
  c, h, w = (a[:, None, :] for a in (boxes[..., 0], boxes[..., 1], boxes[..., 2]))
  box = np.where(np.abs(t - c) < w / 2.0, h, 0.0)
  x = np.concatenate([tri, box], axis=-1)  # [n, length, 4]
  on = x > 0
  near = on[:, 1:] | on[:, :-1]  # each shape's support widened by one position
  collision = (near.sum(-1) > 1).any(-1)
  return x.max(-1), collision


def pair_means(shapes: np.ndarray) -> np.ndarray:
  """The target rule (App. B.4): both shapes of a pair get the pair's mean height."""
  out = shapes.copy()
  out[:, :, 1] = shapes[:, :, 1].mean(axis=1, keepdims=True)
  return out


def generate(n: int, seed: int, spec: TaskSpec = TaskSpec()) -> dict[str, np.ndarray]:
  """n examples: inputs [n, L] (noisy), targets [n, L] (noise-free), triangles and boxes [n, 2, 3] (input's)."""
  if n <= 0:
    raise ValueError(f"generate: the number of examples must be positive, got {n}")
  rng = np.random.default_rng(seed)
  kept: list[tuple[np.ndarray, np.ndarray]] = []
  have = 0
  while have < n:
    m = min(20000, 10 * (n - have) + 16)  # about 12% of draws are valid; blocks keep the memory small

    def draw():
      s = np.empty((m, 2, 3))
      s[..., 0] = rng.uniform(spec.width_max / 2, spec.length - spec.width_max / 2, (m, 2))
      s[..., 1] = rng.uniform(spec.height_min, spec.height_max, (m, 2))
      s[..., 2] = rng.uniform(spec.width_min, spec.width_max, (m, 2))
      return s

    tri, box = draw(), draw()
    _, collision = render(tri, box, spec.length)
    gap = lambda s: np.abs(s[:, 0, 1] - s[:, 1, 1]) > spec.min_height_gap
    ok = ~collision & gap(tri) & gap(box)
    kept.append((tri[ok], box[ok]))
    have += int(ok.sum())
  tri = np.concatenate([k[0] for k in kept])[:n]
  box = np.concatenate([k[1] for k in kept])[:n]
  clean, _ = render(tri, box, spec.length)
  inputs = clean + rng.uniform(-spec.noise / 2, spec.noise / 2, clean.shape)
  targets, _ = render(pair_means(tri), pair_means(box), spec.length)
  return {"inputs": inputs.astype(np.float32), "targets": targets.astype(np.float32), "triangles": tri, "boxes": box}


# --- models -----------------------------------------------------------------------------------------------
def _build_model(mixer: str, channels: int, hidden: int, length: int):
  """The Flax module for one model."""
  if mixer not in MODELS:
    raise ValueError(f"unknown model {mixer!r}; expected one of {', '.join(MODELS)}")

  def torch_uniform(fan_in):  # PyTorch's Conv1d default: weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)

  class Conv1d(nn.Module):
    """1-D convolution, kernel 5, zero padding 2 (App. B.4), as 5 shifted copies times one matrix (so a vmap
    over seeds is a batched matmul, not a grouped convolution). Cross-correlation, like PyTorch's Conv1d."""

    features: int
    kernel_size: int = 5

    @nn.compact
    def __call__(self, x):  # [batch, length, channels]
      k, cin = self.kernel_size, x.shape[-1]
      init = torch_uniform(k * cin)
      kernel = layers.param_with_axes(
        "kernel", init, (k, cin, self.features), jnp.float32, axes=("length", "embed", "mlp")
      )
      bias = layers.param_with_axes("bias", init, (self.features,), jnp.float32, axes=("mlp",))
      pad = k // 2
      xp = jnp.pad(x, ((0, 0), (pad, pad), (0, 0)))
      n = x.shape[1]
      windows = jnp.concatenate([xp[:, o : o + n] for o in range(k)], axis=-1)  # [b, n, k*cin]
      return windows @ kernel.reshape(k * cin, self.features) + bias

  cfg = T5Config(
    vocab_size=1, emb_dim=channels, num_heads=1, head_dim=channels, mlp_dim=hidden, dropout_rate=0.0, dtype="float32"
  )

  class SyntheticNet(nn.Module):
    """conv ReLU conv ReLU [mixer] conv ReLU conv (App. B.4); 'none': conv ReLU in the mixer's place."""

    def setup(self):
      self.convs = [Conv1d(c, name=f"conv_{i}") for i, c in enumerate((channels, channels, channels, 1))]
      if mixer == "none":
        self.mixer = Conv1d(channels, name="token_mixer")
      elif mixer == "hypermixer":
        self.mixer = HyperMixing(cfg, hidden_dim=hidden, name="token_mixer")
      elif mixer == "mlp_mixer":
        self.mixer = TokenMixingMlp(cfg, max_length=length, hidden_dim=hidden, name="token_mixer")
      else:
        self.mixer = Attention(cfg, relative_positions=False, name="token_mixer")

    def mix_input(self, x):  # [batch, length] -> the mixer's input [batch, length, channels]
      h = jax.nn.relu(self.convs[0](x[..., None]))
      return jax.nn.relu(self.convs[1](h))

    def __call__(self, x):
      h = self.mix_input(x)
      if mixer == "none":
        h = jax.nn.relu(self.mixer(h))
      else:
        b, n = h.shape[:2]
        ones = jnp.ones((b, n), jnp.float32)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        ctx = base.MixerContext(q_mask=ones, kv_mask=ones, q_positions=pos, kv_positions=pos)
        h = self.mixer(h, h, ctx, deterministic=True)
      h = jax.nn.relu(self.convs[2](h))
      return self.convs[3](h)[..., 0]

  return SyntheticNet()


def attention_weights(params, x, channels: int, hidden: int, length: int):
  """The attention model's softmax weights [batch, L, L] on inputs x (Fig. 6a), recomputed from its query
  and key kernels (the Attention module returns only its output)."""
  model = _build_model("attention", channels, hidden, length)
  h = model.apply(params, x, method=lambda m, x_: m.mix_input(x_))
  p = params["params"]["token_mixer"]
  q = h @ p["query"]["kernel"]
  k = h @ p["key"]["kernel"]
  return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)


def pseudo_attention(apply_fn: Callable, params, x) -> np.ndarray:
  """Input-gradient pseudo-attention (Simonyan et al. 2014; HyperMixer App. B.4): |d out_i / d in_j| for one
  sequence x [L]; entry [i, j] is large when output i depends strongly on input j."""
  jac = jax.jacrev(lambda v: apply_fn(params, v[None])[0])(x)
  return np.abs(np.asarray(jac))


# --- training ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepSettings:
  models: tuple[str, ...] = MODELS
  train_sizes: tuple[int, ...] = (1000, 2500, 5000, 10000, 25000, 50000, 100000)
  seeds: tuple[int, ...] = (0, 1, 2)
  steps: int = 4000  # optimisation steps per run, for every training-set size
  batch_size: int = 100  # Fleuret's
  learning_rate: float = 1e-3  # Fleuret's (Adam)
  channels: int = 64  # Fleuret's nc
  hidden: int = 128  # d' of HyperMixing and MLP-Mixer's token MLP (2 x channels)
  test_examples: int = 1000  # Fleuret's
  chunk_steps: int = 250  # steps per jitted call (progress granularity)
  map_examples: int = 25000  # training-set size whose models give the pseudo-attention maps (App. B.4)
  spec: TaskSpec = TaskSpec()

  def __post_init__(self):
    bad = [m for m in self.models if m not in MODELS]
    if bad or not self.models:
      raise ValueError(f"unknown model(s) {bad or '(none given)'}; expected some of {', '.join(MODELS)}")
    for name in ("steps", "batch_size", "channels", "hidden", "test_examples", "chunk_steps"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SweepSettings.{name} must be positive, got {getattr(self, name)}")
    if not self.train_sizes or min(self.train_sizes) <= 0:
      raise ValueError(f"training-set sizes must be positive integers, got {self.train_sizes}")
    if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
      raise ValueError(f"seeds must be distinct non-negative integers, got {self.seeds}")
    if not self.learning_rate > 0:
      raise ValueError(f"learning rate must be positive, got {self.learning_rate}")


QUICK = dict(
  train_sizes=(2500, 25000), seeds=(0,), steps=1000, channels=32, hidden=64, test_examples=500, models=MODELS
)

TEST_SEED = 10**6  # the test set's generator seed, far from the training seeds


def _chunking(settings: SweepSettings) -> tuple[int, int]:
  """(jitted calls, steps per call): the fewest calls of at most `chunk_steps` steps covering `steps` (the
  run may take up to calls - 1 extra steps, so that every call has the same compiled shape)."""
  calls = -(-settings.steps // settings.chunk_steps)
  return calls, -(-settings.steps // calls)


def _train_fn(model, settings: SweepSettings):
  """jit(vmap over seeds of one call's Adam steps): (state, inputs, targets, n, key) -> (state, losses)."""
  opt = optax.adam(settings.learning_rate)
  batch = settings.batch_size

  def loss_fn(params, x, y):
    return jnp.mean(jnp.square(model.apply(params, x) - y))

  def chunk(state, inputs, targets, n, key):
    def step(st, k):
      params, opt_state = st
      idx = jax.random.randint(k, (batch,), 0, n)
      loss, grads = jax.value_and_grad(loss_fn)(params, inputs[idx], targets[idx])
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    state, losses = jax.lax.scan(step, state, jax.random.split(key, _chunking(settings)[1]))
    return state, jnp.mean(losses)

  return opt, jax.jit(jax.vmap(chunk, in_axes=(0, 0, 0, None, 0)), donate_argnums=(0,))


def run_sweep(
  settings: SweepSettings,
  *,
  emit: Callable[[dict], None] = lambda r: None,
  progress: Callable[[str], None] = lambda s: None,
  out_dir: Path | None = None,
) -> list[dict]:
  """Train every model on every training-set size with every seed; returns one record per run.

  Seed s draws its training pool (the first N examples serve size N, so sizes are nested), the parameters'
  initialisation and the batch order; the test set is shared by all runs. With out_dir, writes the error
  plot and the pseudo-attention maps (models trained on `map_examples`, or the largest size below it)."""
  spec = settings.spec
  sizes = tuple(sorted(set(settings.train_sizes)))
  seeds = settings.seeds
  pool_n = max(sizes)
  test = generate(settings.test_examples, TEST_SEED, spec)
  pools = [generate(pool_n, s, spec) for s in seeds]
  inputs = np.stack([p["inputs"] for p in pools])  # [seeds, pool_n, L]
  targets = np.stack([p["targets"] for p in pools])
  map_size = max([n for n in sizes if n <= settings.map_examples] or [min(sizes)])
  records: list[dict] = []
  maps: dict[str, tuple] = {}
  total = len(settings.models) * len(sizes)
  done = 0
  t_start = time.time()
  built: dict[str, tuple] = {}

  def write_outputs():
    if out_dir is None:
      return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hypermixer_synthetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out_dir / "hypermixer_synthetic_table.md").write_text(markdown_table(records))
    plot_errors(records, out_dir / "hypermixer_synthetic_mse.png")
    if maps:
      plot_maps(maps, test, settings, map_size, out_dir / "hypermixer_synthetic_maps.png")

  # Sizes outside, models inside: an interrupted sweep has every model at the sizes it finished, and the
  # outputs are rewritten after each size.
  for n in sizes:
    # Each seed normalises its input by its own training set's statistics (Fleuret).
    mu = inputs[:, :n].mean(axis=(1, 2))
    sd = inputs[:, :n].std(axis=(1, 2))
    x_train = jnp.asarray((inputs - mu[:, None, None]) / sd[:, None, None])
    y_train = jnp.asarray(targets)
    for name in settings.models:
      if name not in built:
        model = _build_model(name, settings.channels, settings.hidden, spec.length)
        built[name] = (model, *_train_fn(model, settings), jax.jit(model.apply))
      model, opt, train_chunk, apply_fn = built[name]
      keys = [jax.random.split(jax.random.PRNGKey(s * 1000 + 7)) for s in seeds]
      params = [model.init(k[0], x_train[0, :2]) for k in keys]
      params = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params)
      state = (params, jax.vmap(opt.init)(params))
      step_keys = jnp.stack([k[1] for k in keys])
      chunks, per_call = _chunking(settings)
      t0 = time.time()
      for c in range(chunks):
        step_keys, sub = jax.vmap(jax.random.split, out_axes=1)(step_keys)
        state, losses = train_chunk(state, x_train, y_train, n, sub)
        progress(
          f"[{done + 1}/{total}] {name} N={n}: step {(c + 1) * per_call}/{chunks * per_call} "
          f"train mse {float(jnp.mean(losses)):.3f} ({time.time() - t0:.0f}s, "
          f"total {time.time() - t_start:.0f}s)"
        )
      params = state[0]
      for i, s in enumerate(seeds):
        p = jax.tree_util.tree_map(lambda a: a[i], params)
        x_test = jnp.asarray((test["inputs"] - mu[i]) / sd[i])
        pred = np.asarray(apply_fn(p, x_test))
        mse = float(np.mean(np.square(pred - test["targets"])))
        rec = {
          "model": name,
          "train_examples": int(n),
          "seed": int(s),
          "test_mse": mse,
          "steps": chunks * per_call,
          "final_train_batch_mse": float(losses[i]),
          "seconds": round(time.time() - t0, 1),
        }
        records.append(rec)
        emit(rec)
        if n == map_size and i == 0:
          maps[name] = (p, x_test[0], pred[0])
      done += 1
    write_outputs()
  return records


# --- figures ----------------------------------------------------------------------------------------------
def _mse_by_model(records: Sequence[dict]) -> dict[str, dict[int, list[float]]]:
  """{model: {training-set size: test MSE of each seed}}, in MODELS' order."""
  by: dict[str, dict[int, list[float]]] = {m: {} for m in MODELS if any(r["model"] == m for r in records)}
  for r in records:
    by[r["model"]].setdefault(r["train_examples"], []).append(r["test_mse"])
  return by


def markdown_table(records: Sequence[dict]) -> str:
  """Mean test MSE per model (rows) and training-set size (columns), with the seeds' range."""
  sizes = sorted({r["train_examples"] for r in records})
  lines = ["| model | " + " | ".join(f"N = {n:,}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
  for m, mse in _mse_by_model(records).items():
    lines.append(f"| {LABELS[m]} | " + " | ".join(mean_range(mse.get(n), 3) for n in sizes) + " |")
  return "\n".join(lines) + "\n"


def plot_errors(records: Sequence[dict], path: Path) -> None:
  """Fig. 5b: test MSE against training-set size (log x), mean over seeds with min-max bars."""
  plt, save_png = pyplot()
  fig, ax = plt.subplots(figsize=(5.5, 4))
  by = _mse_by_model(records)
  for m in by:
    ns = sorted(by[m])
    mean = np.array([np.mean(by[m][n]) for n in ns])
    lo = mean - np.array([np.min(by[m][n]) for n in ns])
    hi = np.array([np.max(by[m][n]) for n in ns]) - mean
    ax.errorbar(ns, mean, yerr=[lo, hi], marker="o", capsize=3, label=LABELS[m])
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("training examples")
  ax.set_ylabel("test MSE")
  ax.set_title("HyperMixer synthetic task (Fig. 5b)")
  ax.legend()
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  save_png(fig, path, dpi=110)


def plot_maps(maps: dict, test: dict, settings: SweepSettings, map_size: int, path: Path) -> None:
  """Fig. 5a/c/d and Fig. 6: one test sequence, the attention model's weights and every model's
  pseudo-attention |d out_i / d in_j| (rows: output i, columns: input j)."""
  plt, save_png = pyplot()
  L = settings.spec.length
  panels, shown = [], [m for m in MODELS if m in maps]
  if "attention" in maps:
    p, x, _ = maps["attention"]
    w = np.asarray(attention_weights(p, x[None], settings.channels, settings.hidden, L)[0])
    panels.append(("Self-attention: weights", w))
  for m in shown:
    p, x, _ = maps[m]
    model = _build_model(m, settings.channels, settings.hidden, L)
    panels.append((f"{LABELS[m]}: pseudo-attention", pseudo_attention(model.apply, p, x)))
  cols = max(1, math.ceil((len(panels) + 1) / 2))
  rows = 1 if len(panels) + 1 <= cols else 2
  fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.3 * rows), squeeze=False)
  axes = axes.ravel()
  for a in axes[len(panels) + 1 :]:
    a.axis("off")
  ax = axes[0]
  ax.plot(test["inputs"][0], label="input")
  ax.plot(test["targets"][0], label="target")
  for m in shown:
    ax.plot(maps[m][2], lw=0.8, label=LABELS[m])
  ax.set_title("test sequence 0")
  ax.legend(fontsize=6)
  for a, (title, mat) in zip(axes[1:], panels):
    a.imshow(mat / max(mat.max(), 1e-12), cmap="binary", interpolation="nearest")
    a.set_title(title, fontsize=8)
    a.set_xlabel("input j")
    a.set_ylabel("output i")
    for shapes, marker, color in ((test["triangles"][0], "^", "tab:red"), (test["boxes"][0], "s", "tab:blue")):
      for s in shapes:
        a.plot([s[0]], [-2], marker=marker, color=color, clip_on=False)
        a.plot([-2], [s[0]], marker=marker, color=color, clip_on=False)
    a.set_xlim(-0.5, L - 0.5)
    a.set_ylim(L - 0.5, -0.5)
  fig.suptitle(f"after {map_size:,} training examples (seed {settings.seeds[0]})", fontsize=9)
  fig.tight_layout()
  save_png(fig, path, dpi=100)


# --- command line -----------------------------------------------------------------------------------------
def add_arguments(p) -> None:
  p.add_argument(
    "--quick",
    action="store_true",
    help="2 sizes (2.5k, 25k), 1 seed, 1,000 steps, 32 channels, 500 test examples: minutes on 2 cores",
  )
  p.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} (default: all)")
  p.add_argument("--sizes", help="training-set sizes, e.g. 1000,5000,25000 (default: 1k..100k, 7 sizes)")
  p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
  p.add_argument("--steps", type=int, help="Adam steps per run (default 4000)")
  p.add_argument("--batch_size", "--batch-size", type=int, help="default 100")
  p.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3)")
  p.add_argument("--channels", type=int, help="convolution channels c (default 64)")
  p.add_argument("--hidden", type=int, help="d' of HyperMixing and of MLP-Mixer's token MLP (default 128)")
  p.add_argument("--test_examples", "--test-examples", type=int, help="default 1000")
  p.add_argument("--json", action="store_true", help="one JSON line per model, training-set size and seed on stdout")
  p.add_argument("--out", help="directory for hypermixer_synthetic_{mse,maps}.png, .jsonl and _table.md")


def settings_from_args(args) -> SweepSettings:
  kw: dict = dict(QUICK) if args.quick else {}
  if args.models:
    kw["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
  if args.sizes:
    kw["train_sizes"] = ints(args.sizes, "sizes")
  if args.seeds:
    kw["seeds"] = ints(args.seeds, "seeds")
  for arg, field in (
    ("steps", "steps"),
    ("batch_size", "batch_size"),
    ("lr", "learning_rate"),
    ("channels", "channels"),
    ("hidden", "hidden"),
    ("test_examples", "test_examples"),
  ):
    if getattr(args, arg) is not None:
      kw[field] = getattr(args, arg)
  return SweepSettings(**kw)


def main(args) -> int:
  settings = settings_from_args(args)
  out = Path(args.out) if args.out else None
  progress = lambda s: print(s, file=sys.stderr, flush=True)
  progress(f"hypermixer-synthetic: {json.dumps(dataclasses.asdict(settings))}")
  records = run_sweep(settings, emit=emitter(args.json), progress=progress, out_dir=out)
  if not args.json:
    print(markdown_table(records), end="")
  if out is not None:
    progress(f"wrote {out}/hypermixer_synthetic_mse.png, hypermixer_synthetic_maps.png, hypermixer_synthetic.jsonl")
  return 0
