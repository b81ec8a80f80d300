"""gMLP and aMLP (Liu et al. 2021, "Pay Attention to MLPs", §2 and §4.3) as a TOKEN mixer.

One gMLP block (§2 Eq. 1 and §2.1; the stack adds the pre-norm and the residual):

    Z = gelu(X U)                         U ∈ R^{d×h}          (channel projections, Eq. 1)
    (Z1, Z2) = split(Z)                   along channels, h/2 each (§2.1)
    s(Z) = Z1 ⊙ (W norm(Z2) + b)          W ∈ R^{L×L}, b ∈ R^L (spatial gating unit, §2.1)
    Y = s(Z) V                            V ∈ R^{h/2×d}

W starts near zero and b at one, so the block starts as a plain FFN (§2.1). The block replaces BOTH
attention and the FFN of a Transformer layer, so a gMLP stack has this token mixer and NO feature mixer.

aMLP (§4.3, "tiny attention") adds a single-head attention computed from the block input X whose output
(h/2 wide) is added to the spatial projection before the gating product:
s(Z) = Z1 ⊙ (W norm(Z2) + b + TinyAttn(X)).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5 import layers
from remixer_t5.mixers import base

Array = jax.Array


class LayerNorm(nn.Module):
  """LayerNorm (Ba et al. 2016) with scale and bias; statistics in float32. The gMLP paper's norm."""
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
    scale = layers.param_with_axes("scale", nn.initializers.ones, shape, jnp.float32, axes=axes)
    bias = layers.param_with_axes("bias", nn.initializers.zeros, shape, jnp.float32, axes=axes)
    return (y * scale + bias).astype(self.dtype)


class GatedMlpBlock(nn.Module):
  """The gMLP block (§2), or aMLP with `tiny_attention_dim > 0` (§4.3); a self-mixing token mixer.

  Fields:
    max_length: L, the size of the spatial projection W; longer sequences are refused (base.check_length).
    hidden_dim: h = d_ffn, the width of Z (0: cfg.mlp_dim). The paper uses d_ffn = 6 d_model, and more
      layers than a Transformer of similar cost since each block replaces attention + FFN; here the default
      follows the config's FFN width so the block slots into a T5 stack without new knobs (set 6·emb_dim to
      follow the paper). Must be even (Z is split in halves).
    tiny_attention_dim: 0 for gMLP; > 0 (the paper uses 64) for aMLP's single-head attention of that size.
    spatial_init_scale: W starts uniform in ±spatial_init_scale / L, "near-zero" (§2.1), so W norm(Z2)
      starts negligible against b = 1 whatever L is.

  Rows of W are indexed by each token's position inside its own example (ctx.q_positions, restarting per
  packed segment): (W norm(Z2))[i] = Σ_j W[pos_i, pos_j] norm(Z2)[j] over j that are real, in i's segment
  and, in a decoder, j <= i (W masked to its lower triangle). Decoding caches norm(Z2) of past positions
  (and aMLP's keys and values) and reads row `cache_index` of W.

  Parameters (d = emb_dim, h = hidden_dim, a = tiny_attention_dim): proj_in (U) [d, h] ('embed','mlp');
  sgu_norm scale, bias [h/2] ('mlp',); spatial_kernel (W) [L, L] ('mix_length','mix_source');
  spatial_bias (b) [L] ('mix_length',); proj_out (V) [h/2, d] ('mlp','embed'); aMLP adds tiny_attn_qkv
  [d, 3a] ('embed','kv') and tiny_attn_out [a, h/2] ('kv','mlp').
  Per layer: 1.5·d·h + h + L² + L, plus 3·d·a + a·h/2 for aMLP. U and V are bias-free as in Eq. 1; the
  activation is the exact (erf) GELU; dropout (cfg.dropout_rate) acts on s(Z), like T5's MLP hidden dropout.
  """
  config: Any  # remixer_t5.config.T5Config
  max_length: int = 512
  hidden_dim: int = 0
  tiny_attention_dim: int = 0
  spatial_init_scale: float = 1e-3

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *,
               deterministic: bool = True) -> Array:
    cfg = self.config
    if inputs_kv is not inputs_q:
      raise ValueError("GatedMlpBlock (gMLP/aMLP) only mixes a sequence with itself; it cannot be a cross "
                       "mixer (use attention for the encoder-decoder slot)")
    hidden = self.hidden_dim or cfg.mlp_dim
    if hidden % 2:
      raise ValueError(f"GatedMlpBlock.hidden_dim must be even (Z is split in halves), got {hidden}")
    half = hidden // 2
    x = inputs_q
    base.check_length(x.shape[1], self.max_length, "GatedMlpBlock")
    z = nn.gelu(layers.Dense(hidden, ("embed", "mlp"), dtype=cfg.dtype, name="proj_in")(x),
                approximate=False)
    z = layers.with_sharding_constraint(z, ("batch", "length", "mlp"))
    z1, z2 = z[..., :half], z[..., half:]
    z2 = LayerNorm(cfg.layer_norm_epsilon, cfg.dtype, "mlp", name="sgu_norm")(z2)

    limit = self.spatial_init_scale / self.max_length
    near_zero = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -limit, limit)
    w = layers.param_with_axes("spatial_kernel", near_zero, (self.max_length, self.max_length), jnp.float32,
                               axes=("mix_length", "mix_source"))
    b = layers.param_with_axes("spatial_bias", nn.initializers.ones, (self.max_length,), jnp.float32,
                               axes=("mix_length",))
    attn = self.tiny_attention_dim > 0
    k = v = None
    if attn:
      qkv = layers.Dense(3 * self.tiny_attention_dim, ("embed", "kv"), dtype=cfg.dtype,
                         name="tiny_attn_qkv")(x)
      q, k, v = jnp.split(qkv, 3, axis=-1)

    if ctx.decode and self.has_variable("cache", "cached_norm_z2"):
      weights, bias, visible, z2, k, v = self._decode_step(w, b, z2, k, v)
    else:
      if ctx.decode:  # the first decode call only creates the cache
        for name, value in (("cached_norm_z2", z2), ("cached_key", k), ("cached_value", v)):
          if value is not None:
            self.variable("cache", name, jnp.zeros, value.shape, value.dtype)
        base.cache_index(self)
      pos = ctx.q_positions
      weights, bias = w[pos[:, :, None], pos[:, None, :]], b[pos]
      visible = base.pairwise_mask(ctx)[:, 0] > 0                           # [batch, q, k]
      z2 = z2 * ctx.q_mask[..., None].astype(z2.dtype)  # padded rows carry nothing into W

    weights = jnp.where(visible, weights, 0.0).astype(cfg.dtype)
    weights = jnp.broadcast_to(weights, (z2.shape[0],) + weights.shape[1:])
    gate = jnp.einsum("bqk,bkc->bqc", weights, z2.astype(cfg.dtype)) + bias[..., None].astype(cfg.dtype)
    if attn:
      gate = gate + self._tiny_attention(q, k, v, visible, half)
    y = z1 * gate
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    y = layers.with_sharding_constraint(y, ("batch", "length", "mlp"))
    return layers.Dense(x.shape[-1], ("mlp", "embed"), dtype=cfg.dtype, name="proj_out")(y)

  def _tiny_attention(self, q: Array, k: Array, v: Array, visible: Array, out_dim: int) -> Array:
    """§4.3's single-head attention, softmax(q kᵀ / sqrt(a)) v, projected to h/2; softmax in float32."""
    logits = jnp.einsum("bqa,bka->bqk", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(visible, logits / math.sqrt(self.tiny_attention_dim), layers.NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(self.config.dtype)
    out = jnp.einsum("bqk,bka->bqa", probs, v.astype(self.config.dtype))
    return layers.Dense(out_dim, ("kv", "mlp"), dtype=self.config.dtype, name="tiny_attn_out")(out)

  def _decode_step(self, w: Array, b: Array, z2: Array, k: Array | None, v: Array | None):
    """Writes the new position's norm(Z2) (and aMLP key/value) into the cache.

    Returns W's row and b's entry for the position, the visible cache slots (j <= i) and the cached rows.
    """
    if z2.shape[1] != 1:
      raise ValueError(f"GatedMlpBlock decode step expects one position at a time, got length {z2.shape[1]}")
    index = base.cache_index(self)
    i = index.value
    zero = jnp.array(0, dtype=jnp.int32)

    def write(name: str, new: Array | None) -> Array | None:
      if new is None:
        return None
      cached = self.variable("cache", name, jnp.zeros, new.shape, new.dtype)
      cached.value = jax.lax.dynamic_update_slice(cached.value, new.astype(cached.value.dtype),
                                                  (zero, i, zero))
      return cached.value

    z2, k, v = write("cached_norm_z2", z2), write("cached_key", k), write("cached_value", v)
    index.value = i + 1
    length = z2.shape[1]
    row = jax.lax.dynamic_slice(w, (i, zero), (1, length))[None]             # [1, 1, cache_len]
    bias = jax.lax.dynamic_slice(b, (i,), (1,))[None]                       # [1, 1]
    visible = (jnp.arange(length) <= i)[None, None, :]
    return row, bias, visible, z2, k, v
