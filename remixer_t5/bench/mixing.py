"""Cost of ONE token-mixing layer against sequence length (HyperMixer paper §4.4, Fig. 2).

For each mixer and length: the forward+backward pass of the mixer alone (no norm, residual or feature MLP)
on `batch` sequences of `length` random vectors of width d_model, jitted; the time is the median wall-clock
of `repeats` calls after one warm-up call (compilation excluded, `block_until_ready` on the results); the
FLOPs are XLA's cost analysis of the compiled fwd+bwd function (matmuls 2·m·n·k; elementwise ops one each).

Sizes default to the HyperMixer paper's (App. B.2: d = 256, d' = 512; Fig. 2: one example): d_model 256,
hidden width 512 (HyperMixing's d', the Remixer block's, gMLP's and the MLP-Mixer token MLP's width), and
attention / linear attention with 4 heads of 64. Mixers with a fixed length (MLP-Mixer, gMLP/aMLP, the
Remixer block's H) are built with max_length = the length being measured; FNet's DFT is a length×length
matrix product here (see mixers/fnet.py), so it is quadratic. `attention` is this codebase's T5 attention
including the stack's relative position bias, as the encoder runs it; `attention_norelpos` leaves the bias
out (the vanilla attention of the HyperMixer paper's Fig. 2). The Remixer block is a FEATURE mixer (attention
stays the token mixer of a Remixer layer); it is measured alone, as "remixer".

A row (`bench_mixing(lengths, mixers)` gives one per pair): mixer, length, batch, d_model, ms (median), ms_min,
flops, params, temp_mb (XLA's scratch of the compiled fwd+bwd: activations and gradients), compile_s and
host_malloc (whether runtime's allocator policy was applied, as the CLI does; without it scratch above 32 MiB is
page-faulted in on every call). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from remixer_t5 import runtime
from remixer_t5.bench.train import time_calls
from remixer_t5.commands import common
from remixer_t5.model import layers
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import attention, base, fnet, gmlp, hypermixer, linear_attention, mlp_mixer, remixer
from remixer_t5.training import mfu, plots

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096)


def _registry() -> dict[str, tuple[str, Callable[[int], Callable[..., nn.Module]]]]:
  """name -> (role, length -> factory(config=, name=)); role 'token' or 'feature'."""
  p = functools.partial
  return {
    "attention": ("token", lambda n: attention.Attention),
    "attention_norelpos": ("token", lambda n: p(attention.Attention, relative_positions=False)),
    "hypermixer": ("token", lambda n: hypermixer.HyperMixing),
    "linear_attention": ("token", lambda n: linear_attention.LinearAttention),
    "fnet": ("token", lambda n: fnet.FourierMixing),
    "mlp_mixer": ("token", lambda n: p(mlp_mixer.TokenMixingMlp, max_length=n)),
    "gmlp": ("token", lambda n: p(gmlp.GatedMlpBlock, max_length=n)),
    "amlp": ("token", lambda n: p(gmlp.GatedMlpBlock, max_length=n, tiny_attention_dim=64)),
    "remixer": ("feature", lambda n: p(remixer.RemixerBlock, max_length=n)),
  }


MIXERS = tuple(_registry())
DEFAULT_MIXERS = ("attention", "hypermixer", "linear_attention", "fnet", "mlp_mixer", "gmlp", "remixer")


def default_config(d_model: int = 256, hidden: int = 512, num_heads: int = 4, head_dim: int = 64):
  return T5Config(
    vocab_size=128,
    emb_dim=d_model,
    num_heads=num_heads,
    head_dim=head_dim,
    mlp_dim=hidden,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    dtype="float32",
  )


class MixingLayer(nn.Module):
  """One mixer on an unpadded, unpacked, non-causal batch, with the context an encoder would give it."""

  config: object
  factory: Callable[..., nn.Module]
  role: str = "token"

  @nn.compact
  def __call__(self, x):
    cfg = self.config.for_target()
    b, n = x.shape[:2]
    relpos = layers.RelativePositionBiases(
      cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads, cfg.dtype, name="relpos_bias"
    )
    mask = jnp.ones((b, n), jnp.float32)
    pos = jnp.arange(n, dtype=jnp.int32)[None, :]
    ctx = base.MixerContext(q_mask=mask, kv_mask=mask, q_positions=pos, kv_positions=pos, relpos=relpos)
    mixer = self.factory(config=cfg, name="mixer")
    if self.role == "feature":
      return mixer(x, ctx, deterministic=True)
    return mixer(x, x, ctx, deterministic=True)


def _temp_mb(compiled) -> float | None:
  """XLA's scratch allocation for the compiled function (activations and gradients), in MiB."""
  try:
    return round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2)
  except Exception:  # noqa: BLE001 - not every backend reports it
    return None


def measure(
  mixer: str, length: int, *, config=None, batch: int = 1, repeats: int = 5, warmup: int = 1, seed: int = 0
) -> dict:
  """One row: fwd+bwd ms (median of `repeats`) and XLA FLOPs of one mixer layer."""
  registry = _registry()
  if mixer not in registry:
    raise ValueError(f"unknown mixer {mixer!r}; choose from {', '.join(registry)}")
  cfg = config or default_config()
  role, make = registry[mixer]
  layer = MixingLayer(cfg, make(length), role)
  kx, kc, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (batch, length, cfg.emb_dim), jnp.float32)
  cot = jax.random.normal(kc, x.shape, jnp.float32)  # a fixed output cotangent: nothing folds away
  params = jax.jit(layer.init)(kp, x).get("params", {})

  def loss(p, xs, ct):
    return jnp.vdot(layer.apply({"params": p}, xs).astype(jnp.float32), ct)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  t0 = time.perf_counter()
  compiled = step.lower(params, x, cot).compile()
  compile_s = time.perf_counter() - t0
  times, _ = time_calls(lambda: jax.block_until_ready(compiled(params, x, cot)), max(repeats, 1), max(warmup, 0))
  times = [t * 1e3 for t in times]
  return {
    "mixer": mixer,
    "length": int(length),
    "batch": int(batch),
    "d_model": int(cfg.emb_dim),
    "ms": round(statistics.median(times), 4),
    "flops": mfu.compiled_flops(compiled) or float("nan"),
    "params": int(sum(np.size(a) for a in jax.tree_util.tree_leaves(params))),
    "temp_mb": _temp_mb(compiled),
    "compile_s": round(compile_s, 3),
    "host_malloc": runtime.applied,
    "ms_min": round(min(times), 4),
  }


def bench_mixing(
  lengths: Iterable[int],
  mixers: Sequence[str] = DEFAULT_MIXERS,
  *,
  config=None,
  batch: int = 1,
  repeats: int = 5,
  log=None,
) -> list[dict]:
  """Rows for every (mixer, length), mixers in the given order; `log(str)` gets one progress line each."""
  rows = []
  for mixer in mixers:
    for n in lengths:
      row = measure(mixer, n, config=config, batch=batch, repeats=repeats)
      rows.append(row)
      if log:
        log(
          f"bench {mixer:>18s} length {n:>5d}: {row['ms']:.2f} ms, {row['flops'] / 1e9:.4g} GFLOP fwd+bwd "
          f"(compile {row['compile_s']:.1f}s)"
        )
  return rows


def growth(rows: Sequence[dict], mixer: str, key: str = "ms") -> list[tuple[int, int, float]]:
  """(length, next length, ratio of `key`) between consecutive measured lengths of one mixer."""
  pts = sorted((r["length"], r[key]) for r in rows if r["mixer"] == mixer and r.get(key) is not None)
  return [(a, b, vb / va) for (a, va), (b, vb) in zip(pts, pts[1:]) if va]


def parse_lengths(spec: str) -> list[int]:
  """'128,256,512' or with an ellipsis '128,256,...,4096' (continues the ratio, or the step, of the first two)."""
  parts = [p.strip() for p in spec.split(",") if p.strip()]
  if "..." not in parts:
    out = [int(p) for p in parts]
  else:
    if parts.index("...") != 2 or len(parts) != 4:
      raise ValueError(f"--lengths {spec!r}: write the ellipsis as A,B,...,Z (two values before it, one after)")
    a, b, last = int(parts[0]), int(parts[1]), int(parts[3])
    if not 0 < a < b:
      raise ValueError(f"--lengths {spec!r}: the first two values must be positive and increase")
    # Doubling-style (ratio) if it lands on the last value, else evenly spaced (step).
    for step in ([lambda n: n * (b // a)] if b % a == 0 else []) + [lambda n: n + (b - a)]:
      out = [a]
      while out[-1] < last:
        out.append(step(out[-1]))
      if out[-1] == last:
        break
    else:
      raise ValueError(f"--lengths {spec!r}: {last} is not reached from {a},{b} by their ratio or their step")
  if not out or any(n <= 0 for n in out):
    raise ValueError(f"--lengths {spec!r}: give positive lengths")
  return out


def format_table(rows: Sequence[dict]) -> str:
  """Markdown: one row per length, ms and GFLOP per mixer, plus each mixer's time ratio per length step."""
  mixers = list(dict.fromkeys(r["mixer"] for r in rows))
  lengths = sorted({r["length"] for r in rows})
  get = {(r["mixer"], r["length"]): r for r in rows}
  lines = [
    "| length | " + " | ".join(f"{m} ms (×) | {m} GFLOP" for m in mixers) + " |",
    "|---:|" + "---:|---:|" * len(mixers),
  ]
  for i, n in enumerate(lengths):
    cells = []
    for m in mixers:
      r = get.get((m, n))
      prev = get.get((m, lengths[i - 1])) if i else None
      if r is None:
        cells += ["", ""]
        continue
      ms = f"{r['ms']:.2f}"
      if prev is not None and prev["ms"]:
        ms += f" ({r['ms'] / prev['ms']:.2f}×)"
      cells += [ms, f"{r['flops'] / 1e9:.3f}"]
    lines.append(f"| {n} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot_bench(rows: Sequence[dict], path) -> str:
  """Log-log time and FLOPs against length, one line per mixer; written atomically as PNG."""
  plt = plots.pyplot()
  path = Path(path)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  for mixer in dict.fromkeys(r["mixer"] for r in rows):
    pts = sorted((r["length"], r["ms"], r["flops"]) for r in rows if r["mixer"] == mixer)
    for ax, i in ((axes[0], 1), (axes[1], 2)):
      ax.plot([p[0] for p in pts], [p[i] for p in pts], "o-", label=mixer)
  r0 = rows[0] if rows else {}
  for ax, title in zip(axes, ("fwd+bwd time (ms, median)", "fwd+bwd FLOPs (XLA cost analysis)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  fig.suptitle(f"one token-mixing layer, batch {r0.get('batch')}, d_model {r0.get('d_model')}, {jax.default_backend()}")
  fig.tight_layout()
  return str(plots.save_png(fig, path))


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--lengths", default="128,256,...,4096", help="e.g. 128,256,...,4096 (default) or 256,1024")
  p.add_argument("--mixers", default=",".join(DEFAULT_MIXERS), help=f"comma-separated, from: {', '.join(MIXERS)}")
  p.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")
  p.add_argument("--out", default=".", help="directory for mixing_bench.png (default: current)")
  p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median reported)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--d_model", "--d-model", type=int, default=256)
  p.add_argument("--hidden", type=int, default=512, help="d' (HyperMixing) and the MLP widths")
  p.add_argument("--num_heads", "--num-heads", type=int, default=4)
  p.add_argument("--head_dim", "--head-dim", type=int, default=64)


def main(args: argparse.Namespace) -> int:
  mixers = [m for m in args.mixers.split(",") if m]
  unknown = [m for m in mixers if m not in MIXERS]
  if unknown:
    raise ValueError(f"unknown mixer(s) {', '.join(unknown)}; choose from {', '.join(MIXERS)}")
  config = default_config(args.d_model, args.hidden, args.num_heads, args.head_dim)
  rows = bench_mixing(
    parse_lengths(args.lengths),
    mixers,
    config=config,
    batch=args.batch,
    repeats=args.repeats,
    log=common.stderr,
  )
  print("\n".join(json.dumps(row) for row in rows) if args.json else format_table(rows), flush=True)
  path = plot_bench(rows, Path(args.out) / "mixing_bench.png")
  print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
  return 0
