"""Multi-head dot-product attention as a token mixer (Vaswani et al. 2017, with T5's conventions).

T5: no biases, no 1/sqrt(d) on the logits (it lives in the query initializer, as in mesh TF and t5x, so HF
checkpoints, which never scale, compute the same thing), relative position biases shared per stack in
self-attention only, softmax in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5 import kernels
from remixer_t5.kernels import bias as kernels_bias
from remixer_t5.model import layers
from remixer_t5.model.mixers import base

Array = jax.Array


class Attention(nn.Module):
  """Self- or cross-attention; `relative_positions` adds the stack's T5 position bias (self-attention)."""

  KIND = "attention"  # slot naming in network.py (t5x parameter names)
  config: object
  relative_positions: bool = True
  num_heads: int = 0  # 0: config.num_heads
  head_dim: int = 0  # 0: config.head_dim

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    cfg = self.config
    heads, depth = self.num_heads or cfg.num_heads, self.head_dim or cfg.head_dim
    inner = heads * depth
    kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    query_init = lambda *a: kernel_init(*a) / math.sqrt(depth)
    dense = {
      name: layers.Dense(
        inner,
        ("embed", "joined_kv"),
        kernel_init=query_init if name == "query" else kernel_init,
        dtype=cfg.dtype,
        name=name,
      )
      for name in ("query", "key", "value")
    }
    split = lambda x: x.reshape(x.shape[:-1] + (heads, depth))
    constrain = lambda t: layers.with_sharding_constraint(t, ("batch", "length", "heads", "kv"))
    fused = {}
    if cfg.fuse_projections and not ctx.static_kv:  # one product per input (self-attention: one for all three)
      names = ("query", "key", "value") if inputs_q is inputs_kv else ("key", "value")
      fused = dict(zip(names, layers.fused_dense(inputs_kv, [dense[n] for n in names])))
    project = lambda name, x=inputs_kv: constrain(split(fused[name] if name in fused else dense[name](x)))
    query = project("query", inputs_q)

    use_relpos = self.relative_positions and ctx.relpos is not None
    kv_spec = "bkhd"  # keys/values [batch, length, heads, head_dim]
    if ctx.static_kv:
      # Keys and values of the encoder output: projected once per decode, in the cache's layout.
      to_cache = lambda x: jnp.transpose(x, (0, 2, 3, 1))  # [b, l, h, d] -> [b, h, d, l]
      key = base.static_cache(self, "projected_key", lambda: to_cache(project("key")))
      value = base.static_cache(self, "projected_value", lambda: to_cache(project("value")))
      kv_spec = "bhdk"
    else:
      key, value = project("key"), project("value")
    if not ctx.decode and not ctx.static_kv:
      # One sequence (or packed segments) against itself or the encoder output: the attention operation of
      # kernels/, in the implementation T5Config.attention_impl names. The relative position bias comes from row
      # indices (as t5x/flaxformer compute it from the lengths): a packed segment's positions are consecutive, so
      # key_pos - query_pos = key_idx - query_idx on every pair the mask keeps, and no per-example
      # [batch, heads, q, k] bias (nor a scatter of its gradient into the small table) is built.
      relpos = ctx.relpos(inputs_q.shape[1], inputs_kv.shape[1], bidirectional=not ctx.causal) if use_relpos else None
      keep = None
      if not deterministic and cfg.dropout_rate > 0:
        keep = layers.Dropout(cfg.dropout_rate, impl=cfg.dropout_impl).keep(
          (query.shape[0], heads, query.shape[1], key.shape[1])
        )
      fn = attention_operation(
        cfg.attention_impl,
        causal=ctx.causal,
        dropout_rate=cfg.dropout_rate,
        dtype=cfg.dtype,
        float32_logits=cfg.float32_attention_logits,
      )
      out = fn(query, key, value, relpos, *segment_ids(ctx), keep)
    else:
      if ctx.decode:
        key, value, bias, kv_spec = self._decode_step(key, value, ctx, use_relpos)
      else:
        bias = layers.mask_to_bias(base.pairwise_mask(ctx), jnp.float32)
      # Decoding: the cache's keys and values, or the encoder's in the cache's layout. Beam search: queries are
      # [batch * beams] rows, a static key/value cache [batch] rows (the beams of a row share its encoder output).
      # Each row's beams then attend as extra query positions, reading it once.
      beams = query.shape[0] // key.shape[0]
      if beams > 1:
        query = _beams_to_queries(query, beams)
        bias = _beams_to_queries(jnp.swapaxes(bias, 1, 2), beams).swapaxes(1, 2)  # [b*k, h|1, q, kv]
      spec = f"bqhd,{kv_spec}->bhqk"
      logits = (
        layers.accumulating_einsum(spec, query, key) if cfg.float32_attention_logits else jnp.einsum(spec, query, key)
      )
      logits = logits + bias.astype(logits.dtype)
      weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(cfg.dtype)
      out = jnp.swapaxes(jnp.einsum(f"bhqk,{kv_spec}->bhqd", weights, value), 1, 2)
      if beams > 1:
        out = out.reshape((-1, out.shape[1] // beams) + out.shape[2:])  # back to [b * k, q, h, d]
    out = out.reshape(inputs_q.shape[:-1] + (inner,))
    return layers.Dense(
      inputs_q.shape[-1], ("joined_kv", "embed"), kernel_init=kernel_init, dtype=cfg.dtype, name="out"
    )(out)

  def _decode_step(self, key: Array, value: Array, ctx: base.MixerContext, use_relpos: bool):
    """Autoregressive cache of keys/values, stored [batch, heads, max_len, head_dim] (HF's layout).

    Both attention products batch over (batch, heads) without transposing the cache, and a step's write is batch*heads
    contiguous runs of head_dim values. On XLA:CPU, [batch, length, heads, head_dim] makes XLA transpose all of the
    cache every step, and t5x's [batch, heads, head_dim, max_len] reads well but writes one value per cache line.
    Cross-attention's static keys/values (never written) keep [batch, heads, head_dim, length], which reads faster.

    The first call (cache absent) has all max_decode_length positions: it creates the cache and computes an
    ordinary causal pass (discarded). Later calls write one position and attend to all written ones.
    Returns (keys, values, bias, the einsum spec of keys/values)."""
    initialized = self.has_variable("cache", "cached_key")
    to_cache = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # [b, l, h, d] -> [b, h, l, d]
    cached_key = self.variable("cache", "cached_key", jnp.zeros, to_cache(key).shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, to_cache(value).shape, value.dtype)
    index = base.cache_index(self)
    length = cached_key.value.shape[2]
    if not initialized:
      bias = layers.mask_to_bias(base.pairwise_mask(ctx), jnp.float32)
      return key, value, bias, "bkhd"
    if key.shape[1] != 1:
      raise ValueError(f"decode step expects one position at a time, got length {key.shape[1]}")
    i = index.value
    zero = jnp.array(0, dtype=jnp.int32)
    write = lambda cache, x: jax.lax.dynamic_update_slice(cache, to_cache(x).astype(cache.dtype), (zero, zero, i, zero))
    cached_key.value = write(cached_key.value, key)
    cached_value.value = write(cached_value.value, value)
    index.value = i + 1
    # Only positions written so far are visible.
    bias = layers.mask_to_bias((jnp.arange(length) <= i)[None, None, None, :], jnp.float32)
    if use_relpos:
      positions = jnp.arange(length, dtype=jnp.int32)[None, :]
      bias = bias + ctx.relpos(jnp.reshape(i, (1, 1)), positions, bidirectional=False)
    return cached_key.value, cached_value.value, bias, "bhkd"


def attention_operation(impl: str, **static) -> Callable:
  """The attention operation (`dot_product_attention`'s positional arguments) in the implementation `impl` names
  (`T5Config.attention_impl`: kernels.ATTENTION); `static`: its keyword arguments."""
  return kernels.ATTENTION.choose(impl, functools.partial(dot_product_attention, **static), **static)


def segment_ids(ctx: base.MixerContext) -> tuple[Array, Array]:
  """The attention operation's query and key segment ids: packed rows' own, else the masks (1 real, 0 padding)."""
  segment = lambda ids, mask: (ids if ids is not None else mask).astype(jnp.int32)
  return segment(ctx.q_segment_ids, ctx.q_mask), segment(ctx.kv_segment_ids, ctx.kv_mask)


def _beams_to_queries(x: Array, beams: int) -> Array:
  """[batch * beams, q, ...] -> [batch, beams * q, ...] (beam-major query positions)."""
  return x.reshape((x.shape[0] // beams, beams * x.shape[1]) + x.shape[2:])


def dot_product_attention(
  query: Array,
  key: Array,
  value: Array,
  bias: Array | None,
  q_segment_ids: Array,
  kv_segment_ids: Array,
  keep: Array | None,
  *,
  causal: bool,
  dropout_rate: float,
  dtype,
  float32_logits: bool = True,
  add: Callable[[Array, Array], Array] = jnp.add,
) -> Array:
  """softmax(q k^T + bias + mask) v with T5's conventions, in plain JAX: the reference (`xla`) implementation of
  the attention operation, which every kernel of it is tested against (kernels/__init__.py).

  query [b, q, h, d], key and value [b, k, h, d]; bias None, T5's relative position bias as one value per head
  and offset (`kernels.bias.RelativeBias`, expanded here) or a [1|b, h, q, k] array; segment ids [b, q] and [b, k], int32, 0 for padding (unpacked rows: 1 for real tokens): a query sees the
  real keys of its own segment, and with `causal` keys j <= i only; `keep` None or dropout's boolean keep mask
  [b, h, q, k] (rate `dropout_rate`). No 1/sqrt(d) (T5 keeps it in the query initializer); logits and softmax in
  float32 (`float32_logits`). `add` adds the biases (the `cpu` implementation passes one with a CPU-shaped
  gradient: kernels/cpu/attention.py). Returns [b, q, h, d] in `dtype`."""
  mask = (
    (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    & (q_segment_ids[:, :, None] > 0)
    & (kv_segment_ids[:, None, :] > 0)
  )
  if causal:
    mask &= jnp.arange(key.shape[1])[None, None, :] <= jnp.arange(query.shape[1])[None, :, None]
  bias_all = layers.mask_to_bias(mask[:, None].astype(jnp.float32), jnp.float32)
  if isinstance(bias, kernels_bias.RelativeBias):
    bias = bias.dense()
  if bias is not None:  # [b, 1, q, k] + [1, h, q, k]: the position bias's gradient sums over the batch
    bias_all = add(bias_all, bias.astype(bias_all.dtype))
  logits = (
    layers.accumulating_einsum("bqhd,bkhd->bhqk", query, key)
    if float32_logits
    else jnp.einsum("bqhd,bkhd->bhqk", query, key)
  )
  logits = add(logits, bias_all.astype(logits.dtype))
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
  if keep is not None:
    weights = jax.lax.select(keep, weights / (1.0 - dropout_rate), jnp.zeros_like(weights))
  # [b, h, q, d] (dot_general's own output order), then [b, q, h, d]: asked for `bqhd` directly, jnp.einsum puts
  # the values first and transposes a [b, h, d, q] product back, which is slower on XLA:CPU.
  return jnp.swapaxes(jnp.einsum("bhqk,bkhd->bhqd", weights, value), 1, 2)
