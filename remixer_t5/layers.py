"""Building blocks of T5.1.1 (Raffel et al. 2020; the v1.1 changes of the T5 release notes).

Parameter names and logical axis names follow t5x's `examples/t5/layers.py`, so parameter trees and t5x
checkpoints line up. Every parameter is created with `param_with_axes`, which records its logical axes in the
`params_axes` collection; `partitioning.py` maps them onto a mesh.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

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


class Dense(nn.Module):
  """Bias-free dense layer over the last axis with a 2-D float32 kernel and logical axes."""
  features: int
  kernel_axes: tuple[str, str]
  kernel_init: Initializer = default_kernel_init
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = param_with_axes("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32,
                             axes=self.kernel_axes)
    return jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))


class Embed(nn.Module):
  """Token embedding table (vocab, embed)."""
  num_embeddings: int
  features: int
  dtype: str = "float32"

  def setup(self):
    self.embedding = param_with_axes("embedding", embedding_init, (self.num_embeddings, self.features),
                                     jnp.float32, axes=("vocab", "embed"))

  def __call__(self, ids: Array) -> Array:
    # A gather, not a one-hot matmul: exact, and cheap on CPU/GPU.
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)


def sinusoidal_features(positions: Array, dim: int) -> Array:
  """Vaswani et al. (2017) §3.5: p[2k] = sin(pos / 10000^{2k/d}), p[2k+1] = cos(...); float32 [..., dim].

  The one definition of the sinusoidal encoding: HyperMixing adds it to its hypernetworks' inputs, and
  `AbsolutePositionEmbedding('sinusoidal')` to a stack's token embeddings.
  """
  half = (dim + 1) // 2
  inv_freq = 10000.0 ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / dim)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq
  feats = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)
  return feats.reshape(angle.shape[:-1] + (2 * half,))[..., :dim]


POSITION_EMBEDDINGS = ("none", "sinusoidal", "learned")


class AbsolutePositionEmbedding(nn.Module):
  """Absolute position embeddings, added to a stack's token embeddings (`network.Encoder`/`Decoder`).

  kind:
    'sinusoidal': the fixed encoding of Vaswani et al. (2017) §3.5 (`sinusoidal_features`), no parameters
      and no maximum length. The linear transformer's experiments (Katharopoulos et al. 2020, code released
      with the paper) use this encoding.
    'learned': a trained table [max_length, d] with logical axes ('abspos_buckets', 'embed'), initialised
      like the token embedding (normal, stddev 1, so both terms start at T5's embedding scale): the
      BERT-style absolute position embeddings FNet adds to its token embeddings (Lee-Thorp et al. 2021).
  Called with positions [batch or 1, len] (int; restarting in each packed segment, or the decode step),
  returns [batch or 1, len, features] in `dtype`.
  """
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
        raise ValueError(f"learned position embeddings cover {self.max_length} positions but got a sequence of "
                         f"length {positions.shape[-1]}; raise max_position_embeddings")
      table = param_with_axes("embedding", embedding_init, (self.max_length, self.features), jnp.float32,
                              axes=("abspos_buckets", "embed"))
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


def relative_position_bucket(relative_position: Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Array:
  """T5's log-spaced buckets for `relative_position = key_pos - query_pos` (Raffel et al. §2.1).

  Half the buckets (or all, unidirectionally) are exact offsets, the rest grow logarithmically up to
  `max_distance`. Computed as HF's T5 does (float32 log, no epsilon), which agrees with mesh TF on every
  integer distance.
  """
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
  large = max_exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
                       / math.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return ret + jnp.where(is_small, n, large)


class RelativePositionBiases(nn.Module):
  """One learned scalar per (head, bucket), shared by all layers of a stack (T5.1.1)."""
  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: str = "float32"

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array, bidirectional: bool) -> Array:
    """Positions are [batch or 1, len]; returns a [batch or 1, heads, q_len, k_len] bias."""
    rel = key_positions[:, None, :] - query_positions[:, :, None]
    buckets = relative_position_bucket(rel.astype(jnp.int32), bidirectional, self.num_buckets,
                                       self.max_distance)
    table = param_with_axes("rel_embedding", relpos_init, (self.num_heads, self.num_buckets), jnp.float32,
                            axes=("heads", "relpos_buckets"))
    bias = jnp.take(table, buckets, axis=1)  # [heads, b, q, k]
    return jnp.transpose(bias, (1, 0, 2, 3)).astype(self.dtype)


def mask_to_bias(mask: Array | None, dtype) -> Array | None:
  if mask is None:
    return None
  return jnp.where(mask > 0, 0.0, NEG_INF).astype(dtype)
