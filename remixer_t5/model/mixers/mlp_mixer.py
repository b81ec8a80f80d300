"""MLP-Mixer token mixing for language: the "Mixer" baselines of the Remixer paper (§3.1.2).

The token-mixing MLP of MLP-Mixer (Tolstikhin et al. 2021, eq. 1; HyperMixer paper §2.2, eq. 1) is applied
to each feature channel independently, as an MLP over the positions of a fixed maximum length L:

    Y[:, c] = W2 gelu(W1 X[:, c] + b1) + b2,      W1 in R^{hidden x L},  W2 in R^{L x hidden}.

Mixer_Enc uses it in the encoder. For Mixer_EncDec the Remixer paper "simply adapt[s] the token mixing to a fixed window
size w" in the decoder; we read that as the same token-mixing MLP applied to the causal window of the last w tokens,
slid over the sequence (shared by all positions and channels) and read at the current token:

    out_i[c] = w2 . gelu(W1 (x_i[c], x_{i-1}[c], ..., x_{i-w+1}[c]) + b1),    W1 in R^{hidden x w}.

That keeps the MLP-over-positions form, is causal by construction, needs only the last w inputs to decode,
and (being position-relative) works for any length and for packed rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import base

Array = jax.Array

_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _gelu(x: Array) -> Array:
  return jax.nn.gelu(x, approximate=True)


class TokenMixingMlp(nn.Module):
  """MLP-Mixer token-mixing MLP (Tolstikhin et al. 2021, eq. 1); token slot, self-mixing only.

  `window=None`: the encoder form (Mixer_Enc), an MLP over up to `max_length` positions. A sequence of length
  n uses the first n rows of W1 and columns of W2, and padded inputs are zeroed first, so appended padding
  leaves real outputs unchanged. Packed rows are refused: the hidden units pool a whole segment through a
  nonlinearity, so every packed segment would need its own [hidden, emb] activations (there is no exact form
  that stays within the unpacked memory); train these models with pack=False.

  `window=w`: the decoder form of Mixer_EncDec (Remixer paper §3.1.2), an MLP over the causal window of the
  last w tokens; w1[o] weights the token o steps back. Tokens before the start, padding and other packed
  segments enter the window as zeros. Its activations are [batch, len, hidden, emb], so the hidden width is
  small by default. Decoding keeps the last w inputs in the cache.

  Both forms drop out hidden units with cfg.dropout_rate, as T5's MlpBlock does (MLP-Mixer itself has none)."""

  config: T5Config
  max_length: int = 512  # L (encoder form only; the windowed form works for any length)
  hidden_dim: int | None = None  # None: 512 in the encoder form, 2 * window in the windowed form
  window: int | None = None  # w: None for the encoder form, else the causal window of the decoder

  @property
  def packable(self) -> bool:
    """Whether packed rows can be mixed exactly (the trainer turns packing off otherwise)."""
    return self.window is not None

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    del inputs_kv  # a self-mixer: MLP-Mixer has no cross form
    if self.window is None:
      if ctx.causal or ctx.decode:
        raise ValueError(
          "TokenMixingMlp without `window` mixes all positions and has no causal form; set "
          "TokenMixingMlp.window for decoder self-mixing (Mixer_EncDec)"
        )
      return self._global(inputs_q, ctx, deterministic)
    if self.window < 1:
      raise ValueError(f"TokenMixingMlp.window must be positive, got {self.window}")
    if ctx.decode:
      return self._decode(inputs_q, deterministic)
    return self._windowed(inputs_q, ctx.q_mask, ctx.q_segment_ids, deterministic)

  def _global(self, x: Array, ctx: base.MixerContext, deterministic: bool) -> Array:
    cfg, n = self.config, x.shape[1]
    base.check_length(n, self.max_length, "TokenMixingMlp")
    if ctx.packed:
      raise ValueError(
        "TokenMixingMlp (MLP-Mixer encoder token mixing) cannot mix packed sequences exactly: "
        "its hidden units pool each segment through a nonlinearity; train with pack=False"
      )
    L, hid = self.max_length, self.hidden_dim or 512
    w1 = layers.param_with_axes("w1", _kernel_init, (L, hid), jnp.float32, axes=("mix_length", "mix_hidden"))
    b1 = layers.param_with_axes("b1", nn.initializers.zeros, (hid,), jnp.float32, axes=("mix_hidden",))
    w2 = layers.param_with_axes("w2", _kernel_init, (hid, L), jnp.float32, axes=("mix_hidden", "mix_length"))
    b2 = layers.param_with_axes("b2", nn.initializers.zeros, (L,), jnp.float32, axes=("mix_length",))
    dt = cfg.dtype
    # Zeroed padding meets the first n rows of W1 only, so it adds nothing to the hidden units.
    x = x.astype(dt) * ctx.q_mask[:, :, None].astype(dt)
    h = jnp.einsum("bnd,nk->bkd", x, w1[:n].astype(dt)) + b1.astype(dt)[:, None]
    h = layers.Dropout(cfg.dropout_rate, impl=cfg.dropout_impl)(_gelu(h), deterministic=deterministic)
    return jnp.einsum("bkd,kn->bnd", h, w2[:, :n].astype(dt)) + b2[:n].astype(dt)[:, None]

  def _window_mlp(self, windows: Array, deterministic: bool) -> Array:
    """windows [batch, emb, len, w] (offset o = o steps back) -> [batch, len, emb].

    The window offsets are the minor axis, so both products are plain matmuls over it ([b·d·n, w] x [w, k],
    then [b·d·n, k] x [k]); with the offsets and hidden units between length and emb, XLA:CPU copies the
    windows and the hidden activations to transpose them, forward and backward."""
    dt, hid = self.config.dtype, self.hidden_dim or 2 * self.window
    w1 = layers.param_with_axes("w1", _kernel_init, (self.window, hid), jnp.float32, axes=("mix_length", "mix_hidden"))
    b1 = layers.param_with_axes("b1", nn.initializers.zeros, (hid,), jnp.float32, axes=("mix_hidden",))
    # Only the current token's output row of W2 is ever read, so only that row exists. Its bias would be one
    # constant added to every channel, which the residual stream does not need.
    w2 = layers.param_with_axes("w2", nn.initializers.normal(hid**-0.5), (hid,), jnp.float32, axes=("mix_hidden",))
    h = jnp.einsum("bdno,ok->bdnk", windows.astype(dt), w1.astype(dt)) + b1.astype(dt)
    h = layers.Dropout(self.config.dropout_rate, impl=self.config.dropout_impl)(_gelu(h), deterministic=deterministic)
    return jnp.swapaxes(jnp.einsum("bdnk,k->bdn", h, w2.astype(dt)), 1, 2)

  def _windowed(self, x: Array, mask: Array, segment_ids: Array | None, deterministic: bool) -> Array:
    w, n = self.window, x.shape[1]
    x = x * mask[:, :, None].astype(x.dtype)
    # windows[:, :, i, o] = x[:, i - o]: offset o is a slice of a copy with w - 1 zeros in front (the positions
    # before 0). Slices rather than a gather: the gather's gradient is a scatter over a transposed copy on
    # XLA:CPU, a slice's is a pad that fuses into the sum.
    padded = jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (w - 1, 0)))
    shifted = [padded[:, :, w - 1 - o : w - 1 - o + n] for o in range(w)]
    if segment_ids is not None:
      seg = jnp.pad(segment_ids, ((0, 0), (w - 1, 0)), constant_values=-1)
      shifted = [
        s * (seg[:, w - 1 - o : w - 1 - o + n] == segment_ids)[:, None].astype(x.dtype) for o, s in enumerate(shifted)
      ]
    return self._window_mlp(jnp.stack(shifted, axis=-1), deterministic)

  def _decode(self, x: Array, deterministic: bool) -> Array:
    initialized = self.has_variable("cache", "window")
    cached = self.variable(
      "cache", "window", jnp.zeros, (x.shape[0], self.window, x.shape[2]), jnp.dtype(self.config.dtype)
    )
    if not initialized:  # the first call only creates the cache; its output is discarded
      return self._windowed(x, jnp.ones(x.shape[:2], x.dtype), None, deterministic)
    if x.shape[1] != 1:
      raise ValueError(f"decode step expects one position at a time, got length {x.shape[1]}")
    # Slot o holds the token o steps back; the zeros the cache starts with are the positions before 0.
    cached.value = jnp.concatenate([x.astype(cached.value.dtype), cached.value[:, :-1]], axis=1)
    return self._window_mlp(jnp.swapaxes(cached.value, 1, 2)[:, :, None], deterministic)
