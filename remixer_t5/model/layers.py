"""Building blocks of T5.1.1 (Raffel et al. 2020; the v1.1 changes of the T5 release notes).

Parameter names and logical axis names follow t5x's `examples/t5/layers.py`, so parameter trees and t5x
checkpoints line up. Every parameter is created with `param_with_axes`, which records its logical axes in the
`params_axes` collection; `partitioning.py` maps them onto a mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

from remixer_t5 import kernels
from remixer_t5.kernels import bias as kernels_bias

param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

Array = jax.Array
Initializer = Callable[..., Array]

# T5's initializers (mesh TensorFlow defaults, as in t5x).
default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
embedding_init = nn.initializers.normal(stddev=1.0)
relpos_init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")

NEG_INF = -1e10  # additive bias for masked attention logits (finite, so fully masked rows stay finite)


class RMSNorm(nn.Module):
  """T5 layer norm: scale only, no bias, no mean subtraction; variance in float32."""

  epsilon: float = 1e-6
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x32 = jnp.asarray(x, jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + self.epsilon)
    scale = param_with_axes("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32, axes=("embed",))
    return (y * scale).astype(self.dtype)


class LayerNorm(nn.Module):
  """Ba et al. (2016) with scale and bias, statistics in float32 (HyperMixing's output, Algorithm 1; gMLP's
  spatial gating unit; pNLP-Mixer's bottleneck); `axis_name` is the logical axis of the scale and bias."""

  epsilon: float = 1e-6
  dtype: str = "float32"
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x32 = jnp.asarray(x, jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    shape, axes = (x.shape[-1],), (self.axis_name,)
    scale = param_with_axes("scale", nn.initializers.ones, shape, jnp.float32, axes=axes)
    bias = param_with_axes("bias", nn.initializers.zeros, shape, jnp.float32, axes=axes)
    return (y * scale + bias).astype(self.dtype)


def accumulating_einsum(spec: str, x: Array, y: Array) -> Array:
  """jnp.einsum(spec, x, y) with a float32 result, its operands in their own dtype (bfloat16 in mixed precision),
  whose gradient's products take that dtype too.

  With preferred_element_type=float32, JAX's own gradient multiplies the float32 cotangent by the other bfloat16
  operand: a mixed product that XLA computes in float32 (TF32 on GPUs, at about half bfloat16's rate, twice the
  bytes). Here the cotangent is rounded to the operands' dtype first, as a bfloat16 product's own cotangent is,
  so the gradient is the plain bfloat16 einsum's. Float32 operands (or two dtypes): jnp.einsum's own gradient."""
  if x.dtype != y.dtype or x.dtype == jnp.float32:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
  return _accumulating_einsum(spec, x, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _accumulating_einsum(spec: str, x: Array, y: Array) -> Array:
  return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


def _accumulating_einsum_fwd(spec, x, y):
  return _accumulating_einsum(spec, x, y), (x, y)


def _accumulating_einsum_bwd(spec, operands, g):
  _, pullback = jax.vjp(functools.partial(jnp.einsum, spec), *operands)
  return pullback(g.astype(operands[0].dtype))


_accumulating_einsum.defvjp(_accumulating_einsum_fwd, _accumulating_einsum_bwd)


class Dense(nn.Module):
  """Bias-free dense layer over the last axis with a 2-D float32 kernel and logical axes; `accumulate`: the
  product's output dtype where it differs from `dtype` (float32 from bfloat16 operands: `accumulating_einsum`)."""

  features: int
  kernel_axes: tuple[str, str]
  kernel_init: Initializer = default_kernel_init
  dtype: str = "float32"
  accumulate: str | None = None

  @nn.compact
  def __call__(self, x: Array | int) -> Array:
    """x [..., in] -> [..., features]. Given the input width (an int) instead: the kernel in `dtype`, made as a
    call makes it, for a product the caller fuses with other layers' kernels (`fused_dense`)."""
    kernel = param_with_axes(
      "kernel",
      self.kernel_init,
      (x if isinstance(x, int) else x.shape[-1], self.features),
      jnp.float32,
      axes=self.kernel_axes,
    ).astype(self.dtype)
    if isinstance(x, int):
      return kernel
    # One 2-D matmul over all leading axes (tokens x features), reshaped back: the same result, and the kernel
    # gradient is a plain tokens-contracting matmul (over two leading axes XLA:CPU copies the activation gradient
    # transposed). Only batch and length are merged, neither or only the batch axis sharded (partitioning.py).
    tokens = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    if self.accumulate is not None and jnp.dtype(self.accumulate) == jnp.float32:
      y = accumulating_einsum("td,df->tf", tokens, kernel)
    else:
      y = jnp.dot(tokens, kernel, preferred_element_type=self.accumulate)
    return y.reshape(*x.shape[:-1], self.features)


def fused_dense(x: Array, denses: Sequence[Dense]) -> list[Array]:
  """Each of `denses` (one width and dtype) applied to `x` as one product: their kernels stacked on a new axis
  ([in, n, features]; the axis is unsharded, so each device stacks its own shards), x read once where n products
  read it n times. The parameters are the layers' own (names, shapes, logical axes), so checkpoints are unchanged
  (`T5Config.fuse_projections`)."""
  kernels = jnp.stack([d(x.shape[-1]) for d in denses], axis=1)
  y = jnp.einsum("td,dnf->tnf", x.reshape(-1, x.shape[-1]).astype(kernels.dtype), kernels)
  return [y[:, i].reshape(*x.shape[:-1], y.shape[-1]) for i in range(len(denses))]


class Dropout(nn.Dropout):
  """flax's `nn.Dropout` (the same mask from the same key, the same output, the same `Dropout_N` names and random
  streams), its keep mask computed by the implementation `impl` names (`T5Config.dropout_impl`; kernels/)."""

  impl: str = "auto"

  def keep(self, shape: tuple[int, ...]) -> Array:
    """The keep mask this module's call would draw for inputs of `shape` (no broadcast dims), from the same
    random stream: for operations that apply dropout inside (the attention operation's kernels)."""
    return keep_mask(self.make_rng(self.rng_collection), 1.0 - self.rate, tuple(shape), impl=self.impl)

  @nn.compact
  def __call__(self, inputs, deterministic: bool | None = None, rng=None):
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:  # flax's edge case: no NaN gradients
      return jnp.zeros_like(inputs)
    keep_prob = 1.0 - self.rate
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    shape = list(inputs.shape)
    for dim in self.broadcast_dims:
      shape[dim] = 1
    mask = keep_mask(rng, keep_prob, tuple(shape), impl=self.impl)
    mask = jnp.broadcast_to(mask, inputs.shape)
    return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


def keep_mask(rng: Array, keep_prob: float, shape: tuple[int, ...], impl: str = "auto") -> Array:
  """Dropout's boolean keep mask, `jax.random.bernoulli(rng, keep_prob, shape)`; `impl` 'auto', 'xla' or 'cpu'
  (the same bits through an unrolled hash, kernels/cpu/threefry.py)."""
  reference = lambda key: jax.random.bernoulli(key, p=keep_prob, shape=shape)
  return kernels.DROPOUT_MASK.choose(impl, reference, keep_prob=keep_prob, shape=shape)(rng)


class Embed(nn.Module):
  """Token embedding table (vocab, embed), read by a gather, not a one-hot matmul: exact, and cheap on CPU/GPU."""

  num_embeddings: int
  features: int
  dtype: str = "float32"

  @nn.compact
  def __call__(self, ids: Array) -> Array:
    table = param_with_axes(
      "embedding", embedding_init, (self.num_embeddings, self.features), jnp.float32, axes=("vocab", "embed")
    )
    return jnp.take(table, ids, axis=0).astype(self.dtype)


def sinusoidal_features(positions: Array, dim: int) -> Array:
  """Vaswani et al. (2017) §3.5: p[2k] = sin(pos / 10000^{2k/d}), p[2k+1] = cos(...); float32 [..., dim].

  The one definition of the sinusoidal encoding: HyperMixing adds it to its hypernetworks' inputs, and
  `AbsolutePositionEmbedding('sinusoidal')` to a stack's token embeddings."""
  half = (dim + 1) // 2
  inv_freq = 10000.0 ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / dim)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq
  feats = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)
  return feats.reshape(angle.shape[:-1] + (2 * half,))[..., :dim]


POSITION_EMBEDDINGS = ("none", "sinusoidal", "learned")


class AbsolutePositionEmbedding(nn.Module):
  """Absolute position embeddings, added to a stack's token embeddings (`network.Encoder`/`Decoder`).

  kind (docs/architectures.md says which models use which):
    'sinusoidal': the fixed encoding of Vaswani et al. (2017) §3.5 (`sinusoidal_features`), no parameters
      and no maximum length.
    'learned': a trained table [max_length, d] with logical axes ('abspos_buckets', 'embed'), initialised
      like the token embedding (normal, stddev 1, so both terms start at T5's embedding scale), as BERT's.
  Called with positions [batch or 1, len] (int; restarting in each packed segment, or the decode step),
  returns [batch or 1, len, features] in `dtype`."""

  kind: str
  features: int
  max_length: int = 512
  dtype: str = "float32"

  @nn.compact
  def __call__(self, positions: Array) -> Array:
    if self.kind == "sinusoidal":
      return sinusoidal_features(positions, self.features).astype(self.dtype)
    if self.kind == "learned":
      if positions.shape[-1] > self.max_length:
        raise ValueError(
          f"learned position embeddings cover {self.max_length} positions but got a sequence of "
          f"length {positions.shape[-1]}; raise max_position_embeddings"
        )
      table = param_with_axes(
        "embedding", embedding_init, (self.max_length, self.features), jnp.float32, axes=("abspos_buckets", "embed")
      )
      return jnp.take(table, positions.astype(jnp.int32), axis=0).astype(self.dtype)
    raise ValueError(f"unknown position embedding kind {self.kind!r}; expected one of {POSITION_EMBEDDINGS}")


def activation(name: str) -> Callable[[Array], Array]:
  if name == "linear":
    return lambda x: x
  if name == "gelu":  # T5.1.1's gated GELU uses the tanh approximation ("gelu_new" in HF).
    return lambda x: jax.nn.gelu(x, approximate=True)
  if name == "relu":
    return jax.nn.relu
  raise ValueError(f"unknown MLP activation {name!r}; expected one of 'gelu', 'relu', 'linear'")


def relative_position_bucket(
  relative_position: Array, bidirectional: bool, num_buckets: int, max_distance: int
) -> Array:
  """T5's log-spaced buckets for `relative_position = key_pos - query_pos` (Raffel et al. §2.1).

  Half the buckets (or all, unidirectionally) are exact offsets, the rest grow logarithmically up to `max_distance`.
  Computed as HF's T5 does (float32 log, no epsilon), which agrees with mesh TF on every integer distance."""
  ret = jnp.zeros_like(relative_position)
  n = relative_position
  if bidirectional:
    num_buckets //= 2
    ret += (n > 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = -jnp.minimum(n, 0)  # future keys all fall into bucket 0 (they are masked anyway)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  large = max_exact + (
    jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
    / math.log(max_distance / max_exact)
    * (num_buckets - max_exact)
  ).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return ret + jnp.where(is_small, n, large)


class RelativePositionBiases(nn.Module):
  """One learned scalar per (head, bucket), shared by all layers of a stack (T5.1.1)."""

  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: str = "float32"

  @nn.compact
  def __call__(
    self, query_positions: Array | int, key_positions: Array | int, bidirectional: bool
  ) -> Array | kernels_bias.RelativeBias:
    """Positions are [batch or 1, len] arrays (decoding's one query row): returns a [batch or 1, heads, q_len,
    k_len] bias. Or two lengths (ints) for the row indices 0..len-1, which every non-decoding attention uses (a
    packed segment's positions are consecutive, so its key - query offsets are the rows'): returns the bias as
    one value per head and offset (`kernels.bias.RelativeBias`), which the attention operation takes."""
    table = param_with_axes(
      "rel_embedding", relpos_init, (self.num_heads, self.num_buckets), jnp.float32, axes=("heads", "relpos_buckets")
    )
    if isinstance(query_positions, int):
      return self._rows(table, query_positions, key_positions, bidirectional)
    rel = key_positions[:, None, :] - query_positions[:, :, None]
    buckets = relative_position_bucket(rel.astype(jnp.int32), bidirectional, self.num_buckets, self.max_distance)
    bias = jnp.take(table, buckets, axis=1)  # [heads, b, q, k]: decoding's one query row
    return jnp.transpose(bias, (1, 0, 2, 3)).astype(self.dtype)

  def _rows(self, table: Array, q_len: int, k_len: int, bidirectional: bool) -> kernels_bias.RelativeBias:
    """The bias of row indices as one value per head and offset k - q (q_len + k_len - 1 of them): the table
    read once per offset by a product with their buckets' one-hot. Exact; its gradient is one small product,
    where `take` over [q, k] buckets is a scatter-add of q x k x heads updates into heads x buckets addresses."""
    n = q_len + k_len - 1
    offsets = jnp.arange(n, dtype=jnp.int32) - (q_len - 1)
    buckets = relative_position_bucket(offsets, bidirectional, self.num_buckets, self.max_distance)
    one_hot = (buckets[:, None] == jnp.arange(self.num_buckets, dtype=jnp.int32)).astype(table.dtype)
    v = jnp.einsum("hm,nm->hn", table, one_hot, precision=jax.lax.Precision.HIGHEST)  # [heads, n]
    return kernels_bias.RelativeBias(v.astype(self.dtype), q_len)


def mask_to_bias(mask: Array, dtype) -> Array:
  return jnp.where(mask > 0, 0.0, NEG_INF).astype(dtype)
