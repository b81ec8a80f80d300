"""gMLP and aMLP (Liu et al. 2021, "Pay Attention to MLPs", §2 and §4.3) as a TOKEN mixer.

One gMLP block (§2 Eq. 1 and §2.1; the stack adds the pre-norm and the residual):

    Z = gelu(X U)                         U ∈ R^{d×h}          (channel projections, Eq. 1)
    (Z1, Z2) = split(Z)                   along channels, h/2 each (§2.1)
    s(Z) = Z1 ⊙ (W norm(Z2) + b)          W ∈ R^{L×L}, b ∈ R^L (spatial gating unit, §2.1)
    Y = s(Z) V                            V ∈ R^{h/2×d}

W starts near zero and b at one, so the block starts as a plain FFN (§2.1). The block replaces BOTH
attention and the FFN of a Transformer layer, so a gMLP stack has this token mixer and NO feature mixer.

aMLP (§4.3, "tiny attention") adds a single-head attention computed from the block input X whose output (h/2 wide) is
added to the spatial projection before the gating product: s(Z) = Z1 ⊙ (W norm(Z2) + b + TinyAttn(X)). Outside a decode
step, TinyAttn runs through the attention operation of kernels/ (`T5Config.attention_impl`, as every softmax attention
does: a fused kernel on GPUs and TPU v4 and later), with one head, no position bias and no dropout.

W is either a free L×L matrix (`spatial='full'`, Eq. 2) or, as in the paper's language models, a Toeplitz
matrix (`spatial='toeplitz'`; §4: "In the following MLM experiments, we restrict W to be a Toeplitz matrix to
avoid redundant model parameterization ... this constraint is empirically quality-neutral"): W[i, j] = w[i - j],
one weight per offset, 2L - 1 of them. The paper's experiments are all bidirectional (BERT's MLM); a causal
decoder only ever reads W's lower triangle, so there the Toeplitz form keeps only the L offsets i - j >= 0
(our reading; the paper has no decoder). `spatial_matrix` is the one place W is built from its parameters.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.mixers import attention, base

Array = jax.Array


def spatial_matrix(spatial: str, n: int, params: dict[str, Array], causal: bool = False) -> Array:
  """W of the spatial gating unit, [n, n] for n leading positions (gMLP paper §2.1 Eq. 2 and §4).

  'full': W = kernel[:n, :n] (Eq. 2, W ∈ R^{L×L}). 'toeplitz' (§4, the MLM experiments): W[i, j] = past[i - j]
  for i >= j and future[j - i - 1] for i < j, so `past` [L] holds offsets 0..L-1 and `future` [L-1] offsets
  1..L-1 ahead (2L - 1 weights). `params` holds 'kernel', or 'past' and 'future'. `causal` zeroes the upper
  triangle (a decoder never reads it; a causal Toeplitz block has no `future`)."""
  d = jnp.arange(n)[:, None] - jnp.arange(n)[None, :]  # i - j
  if spatial == "full":
    w = params["kernel"][:n, :n]
  elif spatial == "toeplitz":
    past, future = params["past"], params.get("future")
    if future is None and not causal:
      raise ValueError("a bidirectional Toeplitz W needs its `future` offsets")
    ahead = future[: n - 1] if future is not None else jnp.zeros((n - 1,), past.dtype)
    w = _toeplitz(past[:n], ahead)
  else:
    raise ValueError(f"GatedMlpBlock.spatial must be 'full' or 'toeplitz', got {spatial!r}")
  return jnp.where(d >= 0, w, 0.0) if causal else w


def _toeplitz(behind: Array, ahead: Array) -> Array:
  """[n, n] with W[i, j] = behind[i - j] for i >= j and ahead[j - i - 1] for i < j, built by tiling one vector
  and reshaping, without a gather: an element gather of n² entries (and the scatter-add of its gradient) is
  serialised on TPUs, with a large fixed memory traffic per step on every core.

  With v = [behind[0], ahead[0..n-2], behind[n-1..1]] (2n - 1 entries), v tiled n times and cut into rows of
  2n - 2 puts v[(j - i) mod (2n - 1)] at [i, j]: row i starts i(2n - 2) ≡ -i (mod 2n - 1) into the tiling."""
  n = behind.shape[0]
  if n == 1:
    return behind.reshape(1, 1)
  v = jnp.concatenate([behind[:1], ahead, behind[:0:-1]])
  return jnp.tile(v, n)[: n * (2 * n - 2)].reshape(n, 2 * n - 2)[:, :n]


class GatedMlpBlock(nn.Module):
  """The gMLP block (§2), or aMLP with `tiny_attention_dim > 0` (§4.3); a self-mixing token mixer.

  Fields:
    max_length: L, the size of the spatial projection W; longer sequences are refused (base.check_length).
      The model configs take it from the run's TASK_FEATURE_LENGTHS (model/fixed_length.py).
    hidden_dim: h = d_ffn, the width of Z (0: cfg.mlp_dim; the base configs bind it and the depth to match
      T5.1.1-base's parameters, docs/architectures.md). Must be even (Z is split in halves).
    tiny_attention_dim: 0 for gMLP; > 0 (the paper uses 64) for aMLP's single-head attention of that size.
    spatial: 'full' (Eq. 2, an L×L matrix) or 'toeplitz' (§4's language models: one weight per offset i - j,
      2L - 1 in an encoder, L in a causal decoder). See `spatial_matrix`.
    spatial_init_scale: W starts uniform in ±spatial_init_scale / L, "near-zero" (§2.1), so W norm(Z2)
      starts negligible against b = 1 whatever L is.

  Rows of W are indexed by each token's position inside its own example: (W norm(Z2))[i] = Σ_j W[pos_i, pos_j]
  norm(Z2)[j] over j that are real, in i's segment and, in a decoder, j <= i. Unpacked rows (no segment ids)
  hold one example at positions 0..n-1, so W[:n, :n] is built once per layer and applied as one matmul over the
  batch. Packed rows restart positions per segment, so they take a per-example [batch, n, n] form: W at
  (pos_i, pos_j) for 'full' (`base.slice_gather`), the shared Toeplitz W masked to each segment for 'toeplitz'
  (positions are contiguous in a segment, so pos_i - pos_j = i - j). Decoding caches norm(Z2) of past positions
  (and aMLP's keys and values) and reads row `cache_index` of W.

  Parameters (d = emb_dim, h = hidden_dim, a = tiny_attention_dim): proj_in (U) [d, h] ('embed','mlp'); sgu_norm scale,
  bias [h/2] ('mlp',); 'full': spatial_kernel (W) [L, L] ('mix_length','mix_source'); 'toeplitz': spatial_past [L] and
  (encoder only) spatial_future [L-1] ('mix_length',); spatial_bias (b) [L] ('mix_length',); proj_out (V) [h/2, d]
  ('mlp','embed'); aMLP adds tiny_attn_qkv [d, 3a] ('embed','kv') and tiny_attn_out [a, h/2] ('kv','mlp'). Per layer:
  1.5·d·h + h + L + (L² | 2L-1 | L), plus 3·d·a + a·h/2 for aMLP. U and V are bias-free as in Eq. 1; the activation is
  the exact (erf) GELU; dropout (cfg.dropout_rate) acts on s(Z), like T5's MLP hidden dropout."""

  config: Any  # remixer_t5.model.config.T5Config
  max_length: int = 512
  hidden_dim: int = 0
  tiny_attention_dim: int = 0
  spatial: str = "full"
  spatial_init_scale: float = 1e-3

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    cfg = self.config
    if inputs_kv is not inputs_q:
      raise ValueError(
        "GatedMlpBlock (gMLP/aMLP) only mixes a sequence with itself; it cannot be a cross "
        "mixer (use attention for the encoder-decoder slot)"
      )
    if self.spatial not in ("full", "toeplitz"):
      raise ValueError(f"GatedMlpBlock.spatial must be 'full' or 'toeplitz', got {self.spatial!r}")
    hidden = self.hidden_dim or cfg.mlp_dim
    if hidden % 2:
      raise ValueError(f"GatedMlpBlock.hidden_dim must be even (Z is split in halves), got {hidden}")
    half = hidden // 2
    x = inputs_q
    base.check_length(x.shape[1], self.max_length, "GatedMlpBlock")
    z = nn.gelu(layers.Dense(hidden, ("embed", "mlp"), dtype=cfg.dtype, name="proj_in")(x), approximate=False)
    z = layers.with_sharding_constraint(z, ("batch", "length", "mlp"))
    z1, z2 = z[..., :half], z[..., half:]
    z2 = layers.LayerNorm(cfg.layer_norm_epsilon, cfg.dtype, "mlp", name="sgu_norm")(z2)

    causal = ctx.causal or ctx.decode
    spatial = self._spatial_params(causal)
    b = layers.param_with_axes(
      "spatial_bias", nn.initializers.ones, (self.max_length,), jnp.float32, axes=("mix_length",)
    )
    attn = self.tiny_attention_dim > 0
    k = v = None
    if attn:
      qkv = layers.Dense(3 * self.tiny_attention_dim, ("embed", "kv"), dtype=cfg.dtype, name="tiny_attn_qkv")(x)
      q, k, v = jnp.split(qkv, 3, axis=-1)

    step_visible = None  # a decode step's visible cache slots
    if ctx.decode and self.has_variable("cache", "cached_norm_z2"):
      weights, bias, step_visible, z2, k, v = self._decode_step(spatial, b, z2, k, v)
      weights = jnp.where(step_visible, weights, 0.0).astype(cfg.dtype)
      weights = jnp.broadcast_to(weights, (z2.shape[0],) + weights.shape[1:])
      mixed = jnp.einsum("bqk,bkc->bqc", weights, z2.astype(cfg.dtype))
    else:
      if ctx.decode:  # the first decode call only creates the cache
        for name, value in (("cached_norm_z2", z2), ("cached_key", k), ("cached_value", v)):
          if value is not None:
            self.variable("cache", name, jnp.zeros, value.shape, value.dtype)
        base.cache_index(self)
      n = x.shape[1]
      z2 = (z2 * ctx.q_mask[..., None].astype(z2.dtype)).astype(cfg.dtype)  # padded rows carry nothing into W
      if ctx.packed:
        visible = base.pairwise_mask(ctx)[:, 0] > 0  # [batch, q, k]
        pos = ctx.q_positions
        bias = b[pos]
        if self.spatial == "full":
          weights = base.slice_gather(spatial["kernel"], pos)  # [batch, q, k]
        else:
          weights = spatial_matrix(self.spatial, n, spatial, causal)[None]
        weights = jnp.where(visible, weights, 0.0).astype(cfg.dtype)
        weights = jnp.broadcast_to(weights, (z2.shape[0],) + weights.shape[1:])
        mixed = jnp.einsum("bqk,bkc->bqc", weights, z2)
      else:
        # One [n, n] W for the whole batch. Padded keys are zero rows of z2, so they add nothing; padded
        # query rows get some output, which nothing reads (the next layer zeroes them again, attention masks
        # them, the loss weights them 0), so they are not masked here (a full pass over [batch, n, h/2]).
        # Written as a batched matmul with W broadcast over the batch: XLA:CPU fuses the broadcast into the dot,
        # while "qk,bkc->bqc" adds transposes of [batch, n, h/2].
        bias = b[:n][None]
        w = spatial_matrix(self.spatial, n, spatial, causal).astype(cfg.dtype)
        mixed = jnp.einsum("bqk,bkc->bqc", jnp.broadcast_to(w, (z2.shape[0], n, n)), z2)

    gate = mixed + bias[..., None].astype(cfg.dtype)
    if attn:
      gate = gate + self._tiny_attention(q, k, v, ctx, causal, step_visible, half)
    y = z1 * gate
    y = layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(y, deterministic=deterministic)
    y = layers.with_sharding_constraint(y, ("batch", "length", "mlp"))
    return layers.Dense(x.shape[-1], ("mlp", "embed"), dtype=cfg.dtype, name="proj_out")(y)

  def _spatial_params(self, causal: bool) -> dict[str, Array]:
    """W's parameters, near-zero uniform in ±spatial_init_scale / L (§2.1)."""
    L = self.max_length
    limit = self.spatial_init_scale / L
    near_zero = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -limit, limit)
    if self.spatial == "full":
      return {
        "kernel": layers.param_with_axes(
          "spatial_kernel", near_zero, (L, L), jnp.float32, axes=("mix_length", "mix_source")
        )
      }
    out = {"past": layers.param_with_axes("spatial_past", near_zero, (L,), jnp.float32, axes=("mix_length",))}
    if not causal:
      out["future"] = layers.param_with_axes("spatial_future", near_zero, (L - 1,), jnp.float32, axes=("mix_length",))
    return out

  def _tiny_attention(
    self, q: Array, k: Array, v: Array, ctx: base.MixerContext, causal: bool, decode_visible: Array | None, out_dim: int
  ) -> Array:
    """§4.3's single-head attention, softmax(q kᵀ / sqrt(a)) v, projected to h/2; logits and softmax in float32.

    A whole sequence (or packed segments): the attention operation of kernels/ in the implementation
    `T5Config.attention_impl` names, the 1/sqrt(a) applied to q. A decode step (`decode_visible`: the cache slots
    written so far): its one query row against the cache, here."""
    cfg = self.config
    if decode_visible is None:
      fn = attention.attention_operation(
        cfg.attention_impl, causal=causal, dropout_rate=0.0, dtype=cfg.dtype, float32_logits=True
      )
      scaled = (q.astype(jnp.float32) / math.sqrt(self.tiny_attention_dim)).astype(q.dtype)
      out = fn(scaled[:, :, None], k[:, :, None], v[:, :, None], None, *attention.segment_ids(ctx), None)[:, :, 0]
    else:
      logits = jnp.einsum("bqa,bka->bqk", q, k, preferred_element_type=jnp.float32)
      logits = jnp.where(decode_visible, logits / math.sqrt(self.tiny_attention_dim), layers.NEG_INF)
      probs = jax.nn.softmax(logits, axis=-1).astype(cfg.dtype)
      out = jnp.einsum("bqk,bka->bqa", probs, v.astype(cfg.dtype))
    return layers.Dense(out_dim, ("kv", "mlp"), dtype=cfg.dtype, name="tiny_attn_out")(out)

  def _decode_step(self, spatial: dict[str, Array], b: Array, z2: Array, k: Array | None, v: Array | None):
    """Writes the new position's norm(Z2) (and aMLP key/value) into the cache.

    Returns W's row and b's entry for the position, the visible cache slots (j <= i) and the cached rows."""
    if z2.shape[1] != 1:
      raise ValueError(f"GatedMlpBlock decode step expects one position at a time, got length {z2.shape[1]}")
    index = base.cache_index(self)
    i = index.value
    zero = jnp.array(0, dtype=jnp.int32)

    def write(name: str, new: Array | None) -> Array | None:
      if new is None:
        return None
      cached = self.variable("cache", name, jnp.zeros, new.shape, new.dtype)
      cached.value = jax.lax.dynamic_update_slice(cached.value, new.astype(cached.value.dtype), (zero, i, zero))
      return cached.value

    z2, k, v = write("cached_norm_z2", z2), write("cached_key", k), write("cached_value", v)
    index.value = i + 1
    length = z2.shape[1]
    if self.spatial == "full":
      row = jax.lax.dynamic_slice(spatial["kernel"], (i, zero), (1, length))[None]  # [1, 1, cache_len]
    else:  # W[i, j] = past[i - j]; slots j > i are masked below
      row = spatial["past"][jnp.clip(i - jnp.arange(length), 0, self.max_length - 1)][None, None]
    bias = jax.lax.dynamic_slice(b, (i,), (1,))[None]  # [1, 1]
    visible = (jnp.arange(length) <= i)[None, None, :]
    return row, bias, visible, z2, k, v
