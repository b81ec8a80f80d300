"""FNet token mixing (Lee-Thorp et al. 2021, §3.2): Y = Re(FFT_seq(FFT_hidden(X))); a HyperMixer baseline.

A plain FFT over the padded length would make every output depend on how much padding follows. We take the
DFT over the real tokens of each sequence only: with n real tokens at ranks r = 0..n-1 (in order), the
sequence transform is the n-point DFT exp(-2 pi i r_k r_j / n), written as a per-example masked matrix.
Packed rows get one such DFT per segment (ranks and n counted inside the segment), so a packed row equals
its examples alone. With F = C - iS (cosine and sine parts),

    Re(F_seq X F_hidden) = C_seq X C_hidden - S_seq X S_hidden,

so everything stays real. DFT-by-matmul is also how FNet runs on TPUs for short sequences (paper §3.3).
"""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import base

Array = jax.Array


def _dft_parts(rank_product: Array, size: Array) -> tuple[Array, Array]:
  """cos and sin of 2 pi (r_k r_j mod n) / n; the integer modulus keeps the angle exact for long sequences."""
  angle = (2 * math.pi) * (rank_product % size).astype(jnp.float32) / size.astype(jnp.float32)
  return jnp.cos(angle), jnp.sin(angle)


class FourierMixing(nn.Module):
  """FNet's Fourier token mixing (Lee-Thorp et al. 2021, eq. in §3.2); token slot, encoder self-mixing only.

  No parameters. Computed in float32 (the unnormalised DFT sums n * emb terms) and returned in cfg.dtype.
  FNet has no causal form, so decoder self-mixing is refused with a ValueError."""

  config: T5Config

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    del inputs_kv, deterministic  # a self-mixer without dropout
    if ctx.causal or ctx.decode:
      raise ValueError(
        "FourierMixing (FNet) has no causal form: a DFT over the sequence mixes every "
        "position with every other; use it for encoder self-mixing only"
      )
    x = inputs_q.astype(jnp.float32)
    d = x.shape[-1]
    hid = jnp.arange(d)
    cos_h, sin_h = _dft_parts(hid[:, None] * hid[None, :], jnp.array(d))

    # group[b, k, j]: k and j are real tokens of the same sequence (segment).
    real = ctx.q_mask > 0
    group = real[:, :, None] & real[:, None, :]
    if ctx.q_segment_ids is not None:
      group &= ctx.q_segment_ids[:, :, None] == ctx.q_segment_ids[:, None, :]
    n = x.shape[1]
    size = jnp.maximum(group.sum(-1), 1)  # [b, len]: tokens in k's group
    before = group & (jnp.arange(n)[None, :] < jnp.arange(n)[:, None])[None]
    rank = before.sum(-1)  # [b, len]: k's index in it
    cos_s, sin_s = _dft_parts(rank[:, :, None] * rank[:, None, :], size[:, :, None])
    cos_s, sin_s = cos_s * group, sin_s * group

    y = jnp.einsum("bkj,bjd->bkd", cos_s, x @ cos_h) - jnp.einsum("bkj,bjd->bkd", sin_s, x @ sin_h)
    return y.astype(self.config.dtype)
