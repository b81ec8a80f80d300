"""PNG plots of what people look at: the training and validation curves of a run, and what a model mixes."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from remixer_t5 import storage
from remixer_t5.model import layers
from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.remixer import masked_softmax
from remixer_t5.storage import Path
from remixer_t5.training.metrics_log import current_rows, read_rows


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def save_png(fig, path, dpi: int = 100) -> Path:
  """Writes `fig` to `path` (local or a bucket) whole or not at all, creating its folder; closes it."""
  plt = pyplot()
  path = storage.run_path(path)
  buffer = io.BytesIO()
  fig.savefig(buffer, dpi=dpi, format="png")
  plt.close(fig)
  storage.write_bytes(path, buffer.getvalue())
  return path


def plot_metrics(model_dir: str, out: str | None = None) -> Path:
  """Loss and accuracy against step for the train and validation rows of MODEL_DIR/metrics.jsonl."""
  plt = pyplot()
  model_dir = storage.run_path(model_dir)
  rows = current_rows(read_rows(model_dir / "metrics.jsonl"))
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for split, style in (("train", "-"), ("validation", "o-")):
    pts = sorted((r["step"], r["loss"], r["accuracy"]) for r in rows if r.get("split") == split)
    if pts:
      steps, loss, acc = zip(*pts)
      axes[0].plot(steps, loss, style, label=split)
      axes[1].plot(steps, acc, style, label=split)
  for ax, name in zip(axes, ("loss (cross-entropy + z-loss per target token)", "token accuracy")):
    ax.set_xlabel("step")
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(str(model_dir.name))
  fig.tight_layout()
  return save_png(fig, out if out else model_dir / "metrics.png")


# --- what a model mixes: Remixer paper Fig. 2, HyperMixer paper Fig. 5c/d ----------------------------------
# Matrices are [query/output position i, key/source position j]; rows are what position i reads.


def _slots(params, stack: str, has: str) -> list[tuple[str, str]]:
  """(layer, slot) of the `stack` layers, in order, whose slot holds a parameter (or submodule) named `has`."""
  tree = params.get(stack, {})
  numbered = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k.split("_")[-1]))
  return [
    (layer, slot) for layer in numbered for slot, sub in tree[layer].items() if hasattr(sub, "keys") and has in sub
  ]


def remix_matrices(params) -> list[tuple[str, "np.ndarray"]]:
  """softmax(H) of every Remixer block, encoder layers then decoder layers: [(name, [L, L] float32)].

  As the block applies H to a full-length sequence (mixers/remixer.py): each row i is a softmax over the source
  positions j, over all L in the encoder and over j <= i in the (causal) decoder, so every row sums to 1.
  Blocks are found by their `remix` parameter, whatever their slot is called."""

  out = []
  for stack in ("encoder", "decoder"):
    for layer, slot in _slots(params, stack, "remix"):
      h = jnp.asarray(params[stack][layer][slot]["remix"], jnp.float32)
      visible = jnp.ones(h.shape, bool)
      if stack == "decoder":
        visible = jnp.tril(visible)
      out.append((f"{stack}_{layer}", np.asarray(masked_softmax(h, visible))))
  return out


def _record(module, params, tokens, wanted) -> dict:
  """Encode `tokens` and keep {module path: [(args, kwargs, output, module), ...]} for the `__call__`s whose
  path `wanted(path)` accepts (flax method interception: no mixer code is changed)."""
  calls: dict = {}

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    path = tuple(context.module.path)
    if context.method_name == "__call__" and wanted(path):
      calls.setdefault(path, []).append((args, kwargs, out, context.module))
    return out

  with nn.intercept_methods(interceptor):
    module.apply({"params": params}, tokens, method=module.encode, enable_dropout=False)
  return calls


def attention_maps(module, params, tokens) -> list[tuple[str, "np.ndarray"]]:
  """Self-attention weights of every encoder attention layer for `tokens` [1, n], mean over heads: [(name, [n, n])].

  Recomputed from what the layer computes on the way (its query and key projections and the stack's relative
  position bias, captured by method interception) exactly as mixers/attention.py combines them:
  softmax(q·k + mask bias + relative position bias). Rows sum to 1 over the real keys."""
  slots = [
    (layer, slot) for layer, slot in _slots(params, "encoder", "query") if "key" in params["encoder"][layer][slot]
  ]
  if not slots:
    return []
  paths = {("encoder", layer, slot) for layer, slot in slots}
  calls = _record(module, params, tokens, lambda p: p in paths or p[:-1] in paths or p == ("encoder", "relpos_bias"))
  cfg = module.config
  out = []
  for layer, slot in slots:
    path = ("encoder", layer, slot)
    args, _, _, mixer = calls[path][0]
    ctx = args[2]
    heads = getattr(mixer, "num_heads", 0) or cfg.num_heads
    depth = getattr(mixer, "head_dim", 0) or cfg.head_dim
    split = lambda a: a.reshape(a.shape[:-1] + (heads, depth))
    q, k = split(calls[path + ("query",)][0][2]), split(calls[path + ("key",)][0][2])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    bias = layers.mask_to_bias(base.pairwise_mask(ctx), jnp.float32)
    if getattr(mixer, "relative_positions", False) and ctx.relpos is not None:
      bias = bias + calls[("encoder", "relpos_bias")][0][2].dense().astype(jnp.float32)  # a RelativeBias
    weights = jax.nn.softmax(logits + bias, axis=-1)
    out.append((f"encoder_{layer}", np.asarray(weights[0].mean(0))))
  return out


def pseudo_attention(
  module, params, tokens, path: tuple[str, ...], samples: int = 0, seed: int = 0, max_floats: int = 1 << 24
) -> "np.ndarray":
  """Input-gradient pseudo-attention of the token mixer at `path` (e.g. ('encoder', 'layers_0', 'token_mixer')).

  HyperMixer paper §4.7 and App. B.5 (Fig. 5c/d, 6): the gradient of each output token with respect to each
  input token (Simonyan et al. 2014's input gradients). With vector tokens, entry [i, j] is the Frobenius norm
  ||d out_i / d x_j|| of the d×d Jacobian block, where x is the mixer's input in the model (after the layer's
  pre-norm, for `tokens` [1, n]) and out its output. `samples=0` computes it exactly (n·d vector-Jacobian
  products); `samples=S` estimates the squared norm from S Gaussian probes per output token (Hutchinson,
  unbiased for ||·||², n·S products)."""
  path = tuple(path)
  calls = _record(module, params, tokens, lambda p: p == path)
  if path not in calls:
    raise ValueError(f"no module at {'/'.join(path)} is called when encoding")
  x0 = jnp.asarray(calls[path][0][0][0])
  n, d = x0.shape[1], x0.shape[2]

  def mixer_output(p, x):
    box = {}

    def interceptor(next_fun, args, kwargs, context):
      if context.method_name == "__call__" and tuple(context.module.path) == path:
        box["y"] = next_fun(x, x, *args[2:], **kwargs)  # the mixer's self-mixing input, replaced by x
        return box["y"]
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
      module.apply({"params": p}, tokens, method=module.encode, enable_dropout=False)
    return box["y"].astype(jnp.float32)

  probes = d if samples <= 0 else samples
  chunk = int(max(1, min(n, max_floats // max(1, probes * n * d))))

  @jax.jit
  def block(p, x, rows, key):
    _, vjp = jax.vjp(lambda x_: mixer_output(p, x_), x)
    if samples <= 0:
      dirs = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (rows.shape[0], d, d))
    else:
      dirs = jax.random.normal(key, (rows.shape[0], probes, d), jnp.float32)
    onehot = jax.nn.one_hot(rows, n, dtype=jnp.float32)  # [c, n]
    cts = onehot[:, None, :, None] * dirs[:, :, None, :]  # [c, probes, n, d]
    flat = cts.reshape((-1, 1, n, d))
    grads = jax.vmap(lambda c: vjp(c)[0])(flat).reshape(rows.shape[0], probes, n, d)
    sq = jnp.sum(jnp.square(grads), axis=-1)  # [c, probes, n]
    return jnp.sum(sq, 1) if samples <= 0 else jnp.mean(sq, 1)

  key = jax.random.PRNGKey(seed)
  rows_out = []
  for start in range(0, n, chunk):
    rows = np.arange(start, start + chunk)
    key, sub = jax.random.split(key)
    res = np.asarray(block(params, x0, jnp.asarray(np.minimum(rows, n - 1)), sub))
    rows_out.append(res[rows < n])
  return np.sqrt(np.concatenate(rows_out, 0))


def pseudo_attention_maps(module, params, tokens, samples: int = 0) -> list[tuple[str, "np.ndarray"]]:
  """pseudo_attention of every encoder HyperMixing layer (found by its `hypernetwork_in`): [(name, [n, n])]."""
  return [
    (f"encoder_{layer}", pseudo_attention(module, params, tokens, ("encoder", layer, slot), samples))
    for layer, slot in _slots(params, "encoder", "hypernetwork_in")
  ]


def draw_matrix(
  matrix,
  path,
  title: str,
  labels=None,
  xlabel: str = "source / key position j",
  ylabel: str = "output / query position i",
  colorbar: str = "",
) -> Path:
  """One heatmap PNG of a [rows, cols] matrix; `labels` (tokens) label both axes when there are few."""
  plt = pyplot()
  m = np.asarray(matrix, dtype=np.float32)
  fig, ax = plt.subplots(figsize=(6.4, 5.6))
  im = ax.imshow(m, cmap="viridis", interpolation="nearest", aspect="equal")
  cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
  if colorbar:
    cb.set_label(colorbar)
  if labels is not None and len(labels) == m.shape[0] == m.shape[1] and len(labels) <= 48:
    ticks = range(len(labels))
    ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
    ax.set_yticks(ticks, labels, fontsize=7)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  return save_png(fig, path)


def plot_mixing(module, params, tokens, out_dir, labels=None, pseudo_samples: int = 0, log=print) -> list[Path]:
  """PNG files in out_dir for a model's checkpoint and one input `tokens` [1, n]:

    remix_<stack>_layers_<i>.png             softmax(H) of each Remixer block (Remixer paper Fig. 2, bottom)
    attention_encoder_layers_<i>.png         mean-over-heads self-attention of each encoder layer (Fig. 2, top)
    pseudo_attention_encoder_layers_<i>.png  HyperMixing input-gradient maps (HyperMixer paper Fig. 5c/d)

  Kinds the model does not have are skipped with a message through `log`."""
  tokens = jnp.asarray(tokens, jnp.int32).reshape(1, -1)
  how = "exact" if pseudo_samples <= 0 else f"{pseudo_samples}-probe estimate"
  kinds = [  # (file prefix, the maps, said when there are none, title, draw_matrix's keywords)
    (
      "remix",
      lambda: remix_matrices(params),
      "no Remixer blocks (no `remix` parameter H): skipping softmax(H) maps",
      "softmax(H)",
      dict(colorbar="mixing weight"),
    ),
    (
      "attention",
      lambda: attention_maps(module, params, tokens),
      "no encoder self-attention layers: skipping attention maps",
      "self-attention (mean over heads)",
      dict(labels=labels, colorbar="attention weight"),
    ),
    (
      "pseudo_attention",
      lambda: pseudo_attention_maps(module, params, tokens, pseudo_samples),
      "no encoder HyperMixing layers: skipping pseudo-attention maps",
      f"HyperMixing pseudo-attention ||d out_i / d x_j|| ({how})",
      dict(labels=labels, xlabel="input token j", ylabel="output token i", colorbar="gradient norm"),
    ),
  ]
  written = []
  for prefix, maps, none, title, keywords in kinds:
    found = maps()
    if not found:
      log(none)
    out = storage.run_path(out_dir)
    written += [
      draw_matrix(m, out / f"{prefix}_{name}.png", f"{title}, {name.replace('_', ' ', 1)}", **keywords)
      for name, m in found
    ]
  return written
