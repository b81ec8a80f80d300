"""Remixer block (Tay et al., "Remixers: A Mixer-Transformer Architecture with Compositional Operators
for Natural Language Understanding", §2.1): the FEATURE mixer of a Remixer layer. Self-attention is kept as
the token mixer; this block replaces T5.1.1's gated MLP.

    X'  = gelu(X W1) ⊙ X W2                               (§2.1, GLU with GeLU)
    X_S = softmax(H) X'                                    (§2.1.1, H ∈ R^{L×L} learned per layer)
    X_C = α (X_S ⊙ X') + (1 − α)(X' − X_S)                 (§2.1.2, compositional remixing)
    Y   = X_C W3 + X'                                      (§2.1.2 "Output")

The block is wrapped by the stack's pre-norm and residual (ψ in §2.1.2's "Remixer Stack").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.mixers import base

Array = jax.Array


def masked_softmax(logits: Array, visible: Array) -> Array:
  """softmax(H) over each row's visible entries, in float32; the others exactly 0."""
  return jax.nn.softmax(jnp.where(visible, logits.astype(jnp.float32), layers.NEG_INF), axis=-1) * visible


def _row_exp(logits: Array, allowed: Array | None = None) -> Array:
  """P = exp(logits - rowmax) in float32, exactly 0 where not `allowed`; rowmax over the allowed entries.

  softmax over any subset S of a row is then P[i, j] / sum_{k in S} P[i, k]: the shift cancels. This holds
  while the subset's logits lie within ~87 of the row maximum (float32 exp underflows below e^-87; bfloat16
  shares float32's exponent range); a row whose every visible entry underflows mixes nothing (zero)."""
  logits = logits.astype(jnp.float32)
  if allowed is not None:
    logits = jnp.where(allowed, logits, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # the shift cancels: no gradient
  return jnp.exp(logits - top)


class RemixerBlock(nn.Module):
  """The Remixer block (§2.1), a feature mixer: `RemixerBlock(config=cfg)(x, ctx, deterministic=...)`.

  Fields:
    width: the block's inner width. The paper's equations type-check only with width d_model
      ('model': W1, W2, W3 ∈ R^{d×d}, Y = X_C W3 + X'), but its parameter budget follows T5.1.1's d_ff
      (footnote 2: W1, W2 shrunk by 1/3 as in T5.1.1). 'mlp' (the default) uses width = cfg.mlp_dim:
      W1, W2 ∈ R^{d×d_ff}, W3 ∈ R^{d_ff×d}, and since X' is then d_ff wide the residual is taken before
      W3: Y = (X_C + X') W3: T5.1.1's MLP plus H, the budget the footnote describes (docs/architectures.md
      compares both readings' counts with the paper's Table 1).
    alpha: α ∈ [0, 1] weighing multiplicative against subtractive composition (§2.1.2). A float is a fixed
      hyperparameter; 'learned_scalar' and 'learned_vector' (one per width channel) are sigmoid(param) with
      the param at 0 (α = 0.5, both compositions equally); 'gated' is α = σ(G(X)) with G a dense map of the
      block input, Table 5's ablation (2).
    compositional: False is Table 5's ablation (1), "w/o compositional remixing": X_C = X_S.
    remix_dropout: dropout on the mixing weights softmax(H), applied AFTER the softmax (masks entries of
      the normalised rows, rescaling the rest by 1/(1-p), like attention dropout) and drawn per example;
      §3.1.2 tries 0.0, 0.1, 0.2.
    max_length: L, the size of H; longer sequences are refused (base.check_length).
    remix_init_stddev: H starts as N(0, stddev²). Small logits make every row of softmax(H) start close to
      a uniform average over the visible positions (a running mean in the decoder), so the block starts
      without an arbitrary positional preference; unlike an all-zero start, the nonzero scale lets
      Adafactor's parameter-scaled updates (multiply_by_parameter_scale, floor 1e-3) move H at a useful rate.

  H is indexed by each token's position inside its own example (ctx.q_positions; `_remix`). In decoding the
  X' rows of past positions are cached and the current position reads row `cache_index` of H.

  Parameters: wi_0 (W1, gelu branch) and wi_1 (W2) [d, w] ('embed','mlp'); wo (W3) [w, d] ('mlp','embed');
  remix (H) [L, L] ('mix_length','mix_source'); alpha: () for 'learned_scalar', [w] ('mlp',) for
  'learned_vector', alpha_gate kernel [d, w] ('embed','mlp') for 'gated', nothing for a fixed float or when
  not compositional. Per layer: 3·d·w + L² + {1, w, d·w, 0}, with w = d_ff ('mlp') or d ('model')."""

  config: Any  # remixer_t5.model.config.T5Config
  width: str = "mlp"
  alpha: str | float = "learned_scalar"
  compositional: bool = True
  remix_dropout: float = 0.0
  max_length: int = 512
  remix_init_stddev: float = 0.1

  @nn.compact
  def __call__(self, x: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    cfg = self.config
    if self.width not in ("mlp", "model"):
      raise ValueError(f"RemixerBlock.width must be 'mlp' or 'model', got {self.width!r}")
    width = cfg.mlp_dim if self.width == "mlp" else x.shape[-1]
    dense = lambda features, axes, name: layers.Dense(features, axes, dtype=cfg.dtype, name=name)

    # GELU with the tanh approximation, as T5.1.1's gated MLP that this block replaces.
    xp = jax.nn.gelu(dense(width, ("embed", "mlp"), "wi_0")(x), approximate=True) * dense(
      width, ("embed", "mlp"), "wi_1"
    )(x)
    xp = layers.with_sharding_constraint(xp, ("batch", "length", "mlp"))
    h = layers.param_with_axes(
      "remix",
      nn.initializers.normal(self.remix_init_stddev),
      (self.max_length, self.max_length),
      jnp.float32,
      axes=("mix_length", "mix_source"),
    )

    if ctx.decode and self.has_variable("cache", "cached_glu"):
      weights, values = self._decode_step(h, xp)
      weights = layers.Dropout(self.remix_dropout, impl=cfg.dropout_impl)(weights, deterministic=deterministic)
      xs = jnp.einsum("bqk,bkw->bqw", weights.astype(cfg.dtype), values.astype(cfg.dtype))
    else:
      base.check_length(x.shape[1], self.max_length, "RemixerBlock")
      if ctx.decode:  # the first decode call only creates the cache
        self.variable("cache", "cached_glu", jnp.zeros, xp.shape, xp.dtype)
        base.cache_index(self)
      xs = self._remix(h, xp, ctx, deterministic)

    if self.compositional:
      a = self._alpha(x, width).astype(cfg.dtype)
      xc = a * (xs * xp) + (1 - a) * (xp - xs)
    else:
      xc = xs
    drop = lambda y: layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(
      y, deterministic=deterministic
    )
    if self.width == "model":
      return dense(x.shape[-1], ("mlp", "embed"), "wo")(drop(xc)) + xp
    return dense(x.shape[-1], ("mlp", "embed"), "wo")(drop(xc + xp))

  def _remix(self, h: Array, xp: Array, ctx: base.MixerContext, deterministic: bool) -> Array:
    """X_S = softmax(H) X' (§2.1.1) over a whole sequence, row i normalised over its visible sources.

    Visible: j real, in i's packed segment, and j <= i in the decoder; H is indexed by each example's own positions.
    Padding queries get X_S = 0. With P = exp(H - rowmax(H)) (`_row_exp`) and m the key mask, unpacked rows without
    remix dropout compute X_S = (P (m ⊙ X')) / (P m): one [L, L] matrix per layer, one matmul over the batch. Packed
    rows, per-example positions and remix dropout (drawn per example) use the per-example M = P[pos_i, pos_j] ⊙ mask
    (slice gathers of P), X_S = (M X') / rowsum(M), at [batch, L, L] cost (docs/architectures.md, "Remixer speed")."""
    cfg = self.config
    length = xp.shape[1]
    key_mask = ctx.q_mask > 0
    pos = ctx.q_positions
    causal = jnp.tril(jnp.ones((length, length), bool)) if ctx.causal else None
    dropping = self.remix_dropout > 0 and not deterministic
    if ctx.q_segment_ids is None and pos.shape[0] == 1 and not dropping:
      p = _row_exp(base.slice_gather(h, pos)[0], causal).astype(cfg.dtype)  # [L, L]
      m = key_mask.astype(cfg.dtype)
      numer = jnp.einsum("qk,bkw->bqw", p, xp.astype(cfg.dtype) * m[:, :, None])
      denom = jnp.einsum("qk,bk->bq", p.astype(jnp.float32), m.astype(jnp.float32))
      scale = jnp.where(key_mask & (denom > 0), 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
      return numer * scale[:, :, None].astype(cfg.dtype)
    mask = key_mask[:, :, None] & key_mask[:, None, :]
    if ctx.q_segment_ids is not None:
      mask &= ctx.q_segment_ids[:, :, None] == ctx.q_segment_ids[:, None, :]
    if causal is not None:
      mask &= causal
    # Gathered in float32, cast after: the gathers' transposes (scatter-adds of every example's [L, L]
    # cotangent into one for H) then sum in float32 under bfloat16 activations, not in bfloat16.
    p = jnp.where(mask, base.slice_gather(_row_exp(h), pos).astype(cfg.dtype), 0)  # [b, L, L]
    denom = jnp.sum(p.astype(jnp.float32), axis=-1)
    # Dropping entries before normalising equals dropping them after: the denominators stay undropped.
    p = layers.Dropout(self.remix_dropout, impl=cfg.dropout_impl)(p, deterministic=deterministic)
    numer = jnp.einsum("bqk,bkw->bqw", p, xp.astype(cfg.dtype))
    scale = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
    return numer * scale[:, :, None].astype(cfg.dtype)

  def _decode_step(self, h: Array, xp: Array) -> tuple[Array, Array]:
    """Writes X' of the new position into the cache; returns H's row for it and all cached X' rows."""
    if xp.shape[1] != 1:
      raise ValueError(f"RemixerBlock decode step expects one position at a time, got length {xp.shape[1]}")
    cached = self.variable("cache", "cached_glu", jnp.zeros, xp.shape, xp.dtype)
    index = base.cache_index(self)
    i = index.value
    zero = jnp.array(0, dtype=jnp.int32)
    cached.value = jax.lax.dynamic_update_slice(cached.value, xp.astype(cached.value.dtype), (zero, i, zero))
    index.value = i + 1
    length = cached.value.shape[1]
    row = jax.lax.dynamic_slice(h, (i, zero), (1, length))[None]  # [1, 1, cache_len]
    visible = (jnp.arange(length) <= i)[None, None, :]  # softmax in float32, masked entries exactly 0
    weights = masked_softmax(row, visible)
    return jnp.broadcast_to(weights, (xp.shape[0], 1, length)), cached.value

  def _alpha(self, x: Array, width: int) -> Array:
    mode = self.alpha
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
      if not 0.0 <= mode <= 1.0:
        raise ValueError(f"RemixerBlock.alpha as a fixed value must lie in [0, 1], got {mode}")
      return jnp.asarray(mode, jnp.float32)
    if mode == "learned_scalar":
      return jax.nn.sigmoid(layers.param_with_axes("alpha", nn.initializers.zeros, (), jnp.float32, axes=()))
    if mode == "learned_vector":
      return jax.nn.sigmoid(
        layers.param_with_axes("alpha", nn.initializers.zeros, (width,), jnp.float32, axes=("mlp",))
      )
    if mode == "gated":
      gate = layers.Dense(width, ("embed", "mlp"), dtype=self.config.dtype, name="alpha_gate")(x)
      return jax.nn.sigmoid(gate.astype(jnp.float32))
    raise ValueError(
      f"RemixerBlock.alpha must be a float in [0, 1] or one of 'learned_scalar', "
      f"'learned_vector', 'gated'; got {mode!r}"
    )
