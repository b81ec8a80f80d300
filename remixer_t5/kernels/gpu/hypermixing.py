"""HyperMixing's causal form as a Pallas (Triton) kernel on GPUs: one running d'×d state per sequence, in registers.

The function is `mixers/hypermixer.py`'s causal form, out_i = W2[i] GELU(Σ_{j<=i, same segment} W1[j]^T x_j (/ their
count)) (the module docstring there; HyperMixer, Mai et al. 2023, §2.3, applied to every prefix). XLA's form
(`HyperMixing._scan_causal`) writes every position's d'×d state to memory, so at base size its time is memory traffic.
Here each Triton program owns one (sequence, d'-block, d-block) tile of the state and walks the positions in order, so
the state never leaves the chip; what it writes is each position's partial output, summed over the d'-blocks after.

Forward, per program (row b, d'-block K, d-block D), for i = 0..n-1:
    S  = S·[seg_i = seg_{i-1}] + W1[i, K] ⊗ x_i[D]          (the running sum restarts with each packed segment)
    A  = GELU(S · r_i),  r_i = 1 / max(count_i, 1) with length normalisation, else 1
    partial[K][b, i, D] = Σ_{k∈K} W2[i, k] A[k, :]
Backward, in reverse (the adjoint R of the running sum accumulates dA·GELU'(S r_i)·r_i over i >= j):
    dW2[i, K] += Σ_{c∈D} g_i[c] A[:, c];  R = R·[i is not its segment's last] + (W2[i, K] ⊗ g_i[D]) ⊙ GELU'(S r_i) r_i
    dW1[i, K] += Σ_{c∈D} R[:, c] x_i[c];  dx_i[D] += Σ_{k∈K} R[k, :] W1[i, k]
The state at i is the state at i + 1 less W1[i+1] ⊗ x_{i+1}; at a segment's last position it is summed afresh from
the segment's start (a second pass over the positions in all, and the subtraction never crosses a segment).
Over one segment of 1024 positions the gradients stay within 2e-5 of a materialised reference
(tests/test_gpu_hypermixing.py).
GELU's Φ and φ come from one exp (Abramowitz & Stegun 7.1.26, |error in erf| <= 1.5e-7, as csrc/hypermixing.cc).

`causal` is the `pallas_gpu` implementation of `HyperMixing.impl` (kernels/__init__.py: `auto` takes it in
programs lowered for CUDA GPUs). The packed non-causal form keeps XLA's id-block loop on GPUs
(`HyperMixing._block_segmented`), faster there than a one-pass kernel.

Memory: each call writes one float32 partial output per d'-block, summed after (no atomics, so the sums are
deterministic): d'/16 x batch x length x d floats (`remixer-t5 compile --topology h100` counts them; grouping
d'-blocks per program would cut them, which needs a GPU to tune).
Under a mesh the kernel runs per batch shard (`sharding.per_batch_shard`): XLA does not partition a custom call.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from remixer_t5.kernels import pad_axis, sharding

BLOCK_H = 16  # d' rows of the causal state tile (a power of 2: Triton's tensors) and its d columns: 16 x 64 with
BLOCK_D = 64  # 2 warps, the fastest of the tiles tried on a GPU
WARPS = 2
f32 = jnp.float32


def gelu_and_grad(a):
  """GELU(a) = a Φ(a) and GELU'(a) = Φ(a) + a φ(a): Φ(-|a|) = erfc(|a|/√2) / 2 by Abramowitz & Stegun 7.1.26, and
  one exp, exp(-a²/2), for both it and φ."""
  z = jnp.abs(a) * 0.7071067811865476
  t = 1.0 / (1.0 + 0.3275911 * z)
  poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
  gauss = jnp.exp(-z * z)
  tail = 0.5 * poly * gauss
  cdf = jnp.where(a < 0, tail, 1.0 - tail)
  return a * cdf, cdf + a * gauss * 0.3989422804014327


def _outer(w1_ref, x_ref, j):
  return w1_ref[j, :].astype(f32)[:, None] * x_ref[j, :].astype(f32)[None, :]


def _run_ends(seg_ref, j, n: int):
  """1 where position j ends its run of equal segment ids (or the row), else 0 (int32)."""
  after = jnp.minimum(j + 1, n - 1)
  return jnp.maximum((j == n - 1).astype(jnp.int32), (seg_ref[after] != seg_ref[j]).astype(jnp.int32))


def _forward_kernel(w1_ref, x_ref, w2_ref, seg_ref, scale_ref, out_ref, *, n: int):
  def body(i, carry):
    state, prev = carry
    seg = seg_ref[i]
    state = state * (seg == prev).astype(f32) + _outer(w1_ref, x_ref, i)  # (scalar conditions as numbers)
    act, _ = gelu_and_grad(state * scale_ref[i])
    out_ref[i, :] = jnp.sum(w2_ref[i, :].astype(f32)[:, None] * act, axis=0)
    return state, seg

  zero = jnp.zeros((w1_ref.shape[-1], x_ref.shape[-1]), f32)
  jax.lax.fori_loop(0, n, body, (zero, seg_ref[0]))


def _backward_kernel(w1_ref, x_ref, w2_ref, seg_ref, scale_ref, start_ref, g_ref, dw1_ref, dx_ref, dw2_ref, *, n: int):
  zero = jnp.zeros((w1_ref.shape[-1], x_ref.shape[-1]), f32)

  def body(t, carry):
    state, adj = carry  # the state at i + 1; the adjoint of the running sum summed over positions > i
    i = n - 1 - t
    after = jnp.minimum(i + 1, n - 1)
    last = _run_ends(seg_ref, i, n)
    # At a segment's last position sum its outer products afresh (an empty loop elsewhere); else subtract.
    fresh = jax.lax.fori_loop(start_ref[i] * last, (i + 1) * last, lambda j, s: s + _outer(w1_ref, x_ref, j), zero)
    keep = (1 - last).astype(f32)
    state = fresh + keep * (state - _outer(w1_ref, x_ref, after))
    scale = scale_ref[i]
    act, slope = gelu_and_grad(state * scale)
    g = g_ref[i, :].astype(f32)
    dw2_ref[i, :] = jnp.sum(act * g[None, :], axis=1)
    adj = keep * adj + (w2_ref[i, :].astype(f32)[:, None] * g[None, :]) * slope * scale
    dw1_ref[i, :] = jnp.sum(adj * x_ref[i, :].astype(f32)[None, :], axis=1)
    dx_ref[i, :] = jnp.sum(adj * w1_ref[i, :].astype(f32)[:, None], axis=0)
    return state, adj

  jax.lax.fori_loop(0, n, body, (zero, zero))


def _segment_starts_and_scale(mask, seg, length_normalize: bool):
  """Each position's segment start (the run of equal ids it belongs to) and r_i (1 / visible real keys)."""
  n = seg.shape[1]
  pos = jnp.arange(n, dtype=jnp.int32)
  begins = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(begins, pos, 0), axis=1)
  if not length_normalize:
    return start, jnp.ones(mask.shape, f32)
  csum = jnp.cumsum(mask, axis=1)
  before = jnp.where(start > 0, jnp.take_along_axis(csum, jnp.maximum(start - 1, 0), axis=1), 0.0)
  return start, 1.0 / jnp.maximum(csum - before, 1.0)


def _calls(shape, block_h: int, block_d: int, num_warps: tuple[int, int], interpret: bool):
  """The forward and backward pallas_calls for padded shapes (b, n, h, d). Both take W1, X, W2, the ids and the
  scales r_i, the backward also the segment starts and the output's cotangent; they return float32 partial sums,
  over d'-blocks [h / block_h, b, n, d] and over d-blocks [d / block_d, b, n, h]."""
  b, n, h, d = shape
  grid = (b, h // block_h, d // block_d)
  over_h = pl.BlockSpec((None, n, block_h), lambda r, k, c: (r, 0, k))
  over_d = pl.BlockSpec((None, n, block_d), lambda r, k, c: (r, 0, c))
  per_key = pl.BlockSpec((None, n), lambda r, k, c: (r, 0))
  parts_h = pl.BlockSpec((None, None, n, block_d), lambda r, k, c: (k, r, 0, c))  # partial sums over d'-blocks
  parts_d = pl.BlockSpec((None, None, n, block_h), lambda r, k, c: (c, r, 0, k))  # and over d-blocks
  params = lambda warps: dict(compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1))
  forward = pl.pallas_call(
    functools.partial(_forward_kernel, n=n),
    grid=grid,
    in_specs=[over_h, over_d, over_h, per_key, per_key],
    out_specs=parts_h,
    out_shape=jax.ShapeDtypeStruct((h // block_h, b, n, d), f32),
    interpret=interpret,
    name="hypermixing_causal",
    **params(num_warps[0]),
  )
  backward = pl.pallas_call(
    functools.partial(_backward_kernel, n=n),
    grid=grid,
    in_specs=[over_h, over_d, over_h] + [per_key] * 3 + [over_d],
    out_specs=[parts_d, parts_h, parts_d],
    out_shape=[
      jax.ShapeDtypeStruct((d // block_d, b, n, h), f32),
      jax.ShapeDtypeStruct((h // block_h, b, n, d), f32),
      jax.ShapeDtypeStruct((d // block_d, b, n, h), f32),
    ],
    interpret=interpret,
    name="hypermixing_causal_grad",
    **params(num_warps[1]),
  )
  return forward, backward


def kernel(
  w1,
  x,
  w2,
  mask,
  segment_ids,
  length_normalize: bool,
  *,
  block_h: int = BLOCK_H,
  block_d: int = BLOCK_D,
  num_warps: tuple[int, int] = (WARPS, WARPS),
  interpret: bool = False,
):
  """The causal form through the kernels (with their gradient), for any platform Pallas lowers to: a GPU, or
  `interpret=True` anywhere (tests). w1, w2 [b, n, d'], x [b, n, d], mask [b, n] (real keys; w1 already
  masked), segment_ids [b, n]; returns float32 [b, n, d]. W1, X, W2 are padded to whole tiles, the partial sums
  summed and the padding cut off; the ids, scales and starts are arguments of the custom_vjp, not closed over (it
  may not capture tracers), and get no gradient."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  start, scale = _segment_starts_and_scale(mask.astype(f32), seg, length_normalize)
  (b, n, h), d = w1.shape, x.shape[-1]
  hp, dp = h + -h % block_h, d + -d % block_d  # whole tiles
  forward, backward = _calls((b, n, hp, dp), block_h, block_d, num_warps, interpret)
  pad = lambda w1, x, w2: (pad_axis(w1, 2, hp), pad_axis(x, 2, dp), pad_axis(w2, 2, hp))

  @jax.custom_vjp
  def run(w1, x, w2, seg, scale, start):
    return forward(*pad(w1, x, w2), seg, scale).sum(0)[:, :, :d]

  def run_fwd(*args):
    return run(*args), args

  def run_bwd(residuals, g):
    w1, x, w2, seg, scale, start = residuals
    dw1, dx, dw2 = backward(*pad(w1, x, w2), seg, scale, start, pad_axis(g.astype(f32), 2, dp))
    return (
      dw1.sum(0)[:, :, :h].astype(w1.dtype),
      dx.sum(0)[:, :, :d].astype(x.dtype),
      dw2.sum(0)[:, :, :h].astype(w2.dtype),
      None,
      jnp.zeros_like(scale),
      None,
    )

  run.defvjp(run_fwd, run_bwd)
  return run(w1, x, w2, seg, scale, start)


def causal(w1, x, w2, mask, segment_ids, *, reference: Callable, length_normalize: bool):
  """The causal form through the kernel, its rows split over the devices that shard the batch; float32 output.
  Only in programs lowered for CUDA GPUs (`HyperMixing.impl`: kernels/__init__.py); `reference` is not used."""
  del reference
  seg = jnp.zeros(mask.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  on_gpu = sharding.per_batch_shard(lambda w1, x, w2, mask, seg: kernel(w1, x, w2, mask, seg, length_normalize))
  return on_gpu(w1, x, w2, mask, seg)
