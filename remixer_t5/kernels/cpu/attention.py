"""The attention operation on CPUs: the model's own plain-JAX form, its biases added by `add_bias`.

`add_bias(x, bias)` is `x + bias` with the same value and gradients; only how the gradient's sum over the
bias's broadcast axes is written differs. XLA:CPU hands a plain sum over a leading axis to YNNPACK, which runs it
far slower than a memory-bound pass, and T5's relative position bias [1, heads, q, k] takes that sum over the
batch in every attention layer's backward. Here those sums are pairwise halvings: elementwise adds of slices
(XLA would rewrite a contraction with a vector of ones back into the slow reduce). GPUs and TPUs sum in one pass,
which the halvings' extra passes would only slow, so this is the `cpu` implementation of
`T5Config.attention_impl` (kernels/__init__.py), not the reference. docs/benchmarks.md has what it gains.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from remixer_t5.kernels.bias import RelativeBias


def seam(*args, reference: Callable, **static):
  """The model's attention operation (`reference`: `mixers.attention.dot_product_attention`) adding its
  biases with `add_bias` where a position bias is shared by the batch (T5's relative bias or a [1, h, q, k]
  array, args[3]: the sum it speeds up); elsewhere (cross-attention, the mixers without a position bias) the reference as it is, which
  timed faster there (`remixer-t5 bench kernels`, the MLP-Mixer enc-dec's COGS step)."""
  del static  # bound into `reference` already
  bias = args[3]
  if bias is None or (not isinstance(bias, RelativeBias) and bias.shape[0] != 1):
    return reference(*args)
  return reference(*args, add=add_bias)


def _sum_by_halving(x, axis: int):
  """Sum over `axis` (kept, size 1) by pairwise halving: elementwise adds of slices, never a reduce op."""
  while x.shape[axis] > 1:
    n = x.shape[axis]
    half = jax.lax.slice_in_dim(x, 0, n // 2, axis=axis) + jax.lax.slice_in_dim(x, n // 2, 2 * (n // 2), axis=axis)
    if n % 2:
      half = jnp.concatenate(
        [
          jax.lax.slice_in_dim(half, 0, 1, axis=axis) + jax.lax.slice_in_dim(x, n - 1, n, axis=axis),
          jax.lax.slice_in_dim(half, 1, n // 2, axis=axis),
        ],
        axis=axis,
      )
    x = half
  return x


@jax.custom_vjp
def add_bias(x, bias):
  """`x + bias` for arrays of the same rank whose size-1 axes broadcast (attention logits and their biases)."""
  return x + bias


def _add_bias_fwd(x, bias):
  return add_bias(x, bias), (x.shape, bias.shape)


def _add_bias_bwd(shapes, g):
  out = []
  for shape in shapes:
    if len(shape) != g.ndim:
      raise ValueError(f"add_bias: operands of shapes {shapes}; expected the same rank")
    d = g
    for axis in (axis for axis, size in enumerate(shape) if size == 1 and g.shape[axis] > 1):
      d = _sum_by_halving(d, axis)
    out.append(d)
  return tuple(out)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
