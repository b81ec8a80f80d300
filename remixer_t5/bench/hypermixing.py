"""HyperMixing's causal GPU kernel at HyperMixer-base's decoder shape against its arithmetic alone: a measured bound.

The causal form (mixers/hypermixer.py) gives every query position its own d' x d state, so a layer evaluates GELU
b n d' d times forward (23 G at batch 128, 114 positions, d' 2048, d 768) and GELU with its derivative as many
times backward; no tensor core takes those, each evaluation is ~20 float32 operations and two special-function
instructions (an exp and a reciprocal, kernels/gpu/hypermixing.py's `gelu_and_grad`).

Forms, each the median of `repeats` calls after `warmup` (compiled first):
- `kernel <block_h>x<block_d> w<warps>`: kernels/gpu/hypermixing.py's kernel at that tile (forward, and forward +
  backward of sum(out * g) with respect to W1, X and W2), the model's packed rows (segments restart the state);
- `arithmetic`: the same grid, tile and per-position arithmetic (the state's update, its GELU, the output's sum
  over the tile's d' rows; backward: GELU and its derivative, the adjoint's update and the three gradient sums)
  with nothing read or written per position: what the kernel costs if memory were free. Its forward + backward
  is the arithmetic forward plus the arithmetic backward, timed apart.
`gelu_per_s`: GELU evaluations a second in the forward (b n d' d over its time). `decoder_ms`: `layers` times the
forward + backward, the causal form's share of one training step. HyperMixer-base's step is at least the
`arithmetic` row's `decoder_ms` plus everything else the step does; when that alone exceeds 3x T5.1.1-base's step
measured in the same run, the design (one GELU per position per state entry) cannot reach it with any kernel.
On a CPU (`dry=True`) both run in Pallas's interpreter at a tiny shape: a check that every form runs.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5.bench.train import jit_seconds
from remixer_t5.kernels.gpu import hypermixing as hm

f32 = jnp.float32
# (batch, positions, d', d, segments a row, layers): HyperMixer-base's decoder under runs/pretrain.gin
SHAPE = (128, 114, 2048, 768, 4, 12)
DRY_SHAPE = (2, 8, 32, 32, 2, 12)
CANDIDATES = ((16, 64, 2), (32, 32, 4), (32, 64, 4))  # (block_h, block_d, warps): the fastest three on an H200
DRY_CANDIDATES = ((16, 16, 2),)


def _forward_arithmetic(w1_ref, x_ref, w2_ref, out_ref, *, n: int):
  """The forward kernel's loop with its per-position reads and writes taken out: one W1, X, W2 row read once."""
  u, v, w = w1_ref[0, :].astype(f32), x_ref[0, :].astype(f32), w2_ref[0, :].astype(f32)

  def body(i, carry):
    state, acc = carry
    state = state + u[:, None] * v[None, :]
    act, _ = hm.gelu_and_grad(state * (1.0 / (i + 1).astype(f32)))
    return state, acc + jnp.sum(w[:, None] * act, axis=0)

  _, acc = jax.lax.fori_loop(0, n, body, (jnp.zeros((u.shape[0], v.shape[0]), f32), jnp.zeros(v.shape, f32)))
  out_ref[...] = acc


def _backward_arithmetic(w1_ref, x_ref, w2_ref, g_ref, dw1_ref, dx_ref, dw2_ref, *, n: int):
  """The backward kernel's loop (state rebuilt by subtraction, GELU and its slope, the adjoint and the three
  gradient rows) with one row of each input read once and the gradient rows summed, written once."""
  u, v, w, g = (r[0, :].astype(f32) for r in (w1_ref, x_ref, w2_ref, g_ref))
  state0 = (n * u)[:, None] * v[None, :]

  def body(t, carry):
    state, adj, dw1, dx, dw2 = carry
    scale = 1.0 / (n - t).astype(f32)
    act, slope = hm.gelu_and_grad(state * scale)
    dw2 = dw2 + jnp.sum(act * g[None, :], axis=1)
    adj = adj + (w[:, None] * g[None, :]) * slope * scale
    dw1 = dw1 + jnp.sum(adj * v[None, :], axis=1)
    dx = dx + jnp.sum(adj * u[:, None], axis=0)
    return state - u[:, None] * v[None, :], adj, dw1, dx, dw2

  zero_hd, zero_h, zero_d = jnp.zeros(state0.shape, f32), jnp.zeros(u.shape, f32), jnp.zeros(v.shape, f32)
  _, _, dw1, dx, dw2 = jax.lax.fori_loop(0, n, body, (state0, zero_hd, zero_h, zero_d, zero_h))
  dw1_ref[...], dx_ref[...], dw2_ref[...] = dw1, dx, dw2


def arithmetic(shape, block_h: int, block_d: int, warps: int, interpret: bool):
  """(forward, backward): pallas_calls over the kernel's grid (b, d'/block_h, d/block_d) running its arithmetic.
  forward(w1, x, w2) -> [d'/block_h, b, d]; backward(w1, x, w2, g) -> ([d/block_d, b, d'], [d'/block_h, b, d],
  [d/block_d, b, d'])."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  b, n, h, d = shape
  grid = (b, h // block_h, d // block_d)
  over_h = pl.BlockSpec((None, n, block_h), lambda r, k, c: (r, 0, k))
  over_d = pl.BlockSpec((None, n, block_d), lambda r, k, c: (r, 0, c))
  rows_d = pl.BlockSpec((None, None, block_d), lambda r, k, c: (k, r, c))  # a row per (d'-block, sequence)
  rows_h = pl.BlockSpec((None, None, block_h), lambda r, k, c: (c, r, k))  # a row per (d-block, sequence)
  params = dict(compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret)
  forward = pl.pallas_call(
    functools.partial(_forward_arithmetic, n=n),
    grid=grid,
    in_specs=[over_h, over_d, over_h],
    out_specs=rows_d,
    out_shape=jax.ShapeDtypeStruct((h // block_h, b, d), f32),
    name="hypermixing_arithmetic",
    **params,
  )
  backward = pl.pallas_call(
    functools.partial(_backward_arithmetic, n=n),
    grid=grid,
    in_specs=[over_h, over_d, over_h, over_d],
    out_specs=[rows_h, rows_d, rows_h],
    out_shape=[
      jax.ShapeDtypeStruct((d // block_d, b, h), f32),
      jax.ShapeDtypeStruct((h // block_h, b, d), f32),
      jax.ShapeDtypeStruct((d // block_d, b, h), f32),
    ],
    name="hypermixing_arithmetic_grad",
    **params,
  )
  return forward, backward


def _inputs(shape, seed: int = 0):
  b, n, h, d, pieces, _ = shape
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-1]), jnp.bfloat16)
  seg = np.tile(np.repeat(np.arange(1, pieces + 1), np.diff(np.linspace(0, n, pieces + 1).astype(int))), (b, 1))
  return (
    normal(b, n, h),
    normal(b, n, d),
    normal(b, n, h),
    jnp.ones((b, n), f32),
    jnp.asarray(seg, jnp.int32),
    jnp.asarray(rng.normal(size=(b, n, d)), f32),
  )


def measure_kernel(shape, tile, dry: bool, repeats: int, warmup: int) -> dict:
  w1, x, w2, mask, seg, g = _inputs(shape)
  block_h, block_d, warps = tile
  fn = lambda w1, x, w2: hm.kernel(
    w1, x, w2, mask, seg, False, block_h=block_h, block_d=block_d, num_warps=(warps, warps), interpret=dry
  )
  grad = jax.grad(lambda w1, x, w2: jnp.sum(fn(w1, x, w2) * g), argnums=(0, 1, 2))
  return {
    "fwd_ms": 1e3 * jit_seconds(fn, (w1, x, w2), repeats, warmup),
    "fwd_bwd_ms": 1e3 * jit_seconds(grad, (w1, x, w2), repeats, warmup),
  }


def measure_arithmetic(shape, tile, dry: bool, repeats: int, warmup: int) -> dict:
  w1, x, w2, _, _, g = _inputs(shape)
  forward, backward = arithmetic(shape[:4], *tile, interpret=dry)
  fwd = jit_seconds(forward, (w1, x, w2), repeats, warmup)
  bwd = jit_seconds(backward, (w1, x, w2, g), repeats, warmup)
  return {"fwd_ms": 1e3 * fwd, "bwd_ms": 1e3 * bwd, "fwd_bwd_ms": 1e3 * (fwd + bwd)}


def run(*, dry: bool = False, repeats: int = 5, warmup: int = 1, log: Callable[[str], None] = print) -> list[dict]:
  """Rows per form at the shape: the kernel at each candidate tile, then `arithmetic` at the first."""
  shape, candidates = (DRY_SHAPE, DRY_CANDIDATES) if dry else (SHAPE, CANDIDATES)
  b, n, h, d, _, layers = shape
  kind = jax.devices()[0].device_kind
  forms = [(f"kernel {bh}x{bd} w{w}", measure_kernel, (bh, bd, w)) for bh, bd, w in candidates]
  forms.append(("arithmetic", measure_arithmetic, candidates[0]))
  rows = []
  for name, fn, tile in forms:
    row = {"form": name, "dims": list(shape), "tile": list(tile), "device_kind": kind, "dry": dry}
    try:
      row.update(fn(shape, tile, dry, repeats, warmup))
      row["gelu_per_s"] = b * n * h * d / (row["fwd_ms"] / 1e3)
      row["decoder_ms"] = layers * row["fwd_bwd_ms"]
    except Exception as e:  # noqa: BLE001 - a tile that does not compile costs its row only
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    log(
      f"hypermixing {name}: "
      + (
        row.get("error")
        or f"fwd {row['fwd_ms']:.2f} ms, fwd+bwd {row['fwd_bwd_ms']:.2f}"
        f" ms, {row['gelu_per_s'] / 1e9:.0f} G GELU/s, x{layers} layers "
        f"{row['decoder_ms']:.0f} ms"
      )
    )
  bound = next((r for r in rows if r["form"] == "arithmetic" and "error" not in r), None)
  if bound:
    for row in rows:
      if "error" not in row:
        row["of_arithmetic"] = row["fwd_bwd_ms"] / bound["fwd_bwd_ms"]
  return rows
