"""Linear-transformer attention (Katharopoulos et al. 2020, §3.2-3.4); a HyperMixer-paper baseline.

With the feature map phi(x) = elu(x) + 1 (§3.2.1), each head computes

    out_i = phi(q_i)^T S / (phi(q_i)^T z),    S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j),

over all real keys j (non-causal, §3.2) or over j <= i (causal masking, §3.3; S and z are the state of
the RNN of §3.4). The causal form runs a lax.scan over chunks of `chunk_size` positions that carries (S, z):
inside a chunk the quadratic masked form, across chunks the state, so memory stays bounded by the chunk
size; decoding carries (S, z) in the cache one position at a time.

Packing: the non-causal form over packed rows (or packed cross-mixing) uses the quadratic form with the
same-segment mask, which is exact for any segment layout at the cost of ordinary attention. The causal scan
restarts the state where the segment id changes, which is exact for packed rows whose segments are contiguous
runs (as seqio's packing makes them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import base

Array = jax.Array
f32 = jnp.float32


def _feature_map(x: Array) -> Array:
  return jax.nn.elu(x.astype(f32)) + 1.0


class LinearAttention(nn.Module):
  """Multi-head linear attention (Katharopoulos et al. 2020, §3.2; causal §3.3); token or cross slot.

  Parameters as in T5 attention: query/key/value kernels (embed, joined_kv) and out (joined_kv, embed), no
  biases. The feature maps, sums and normaliser are float32; `eps` keeps rows without any real key finite."""

  config: T5Config
  # Positions per step of the causal scan. A chunk costs a [chunk, chunk] masked product per head, nothing for
  # these sizes, and 128 keeps T5's 114 decoder positions in one chunk: no loop in the step (XLA's cost model,
  # which counts a loop body once, then sees it whole; `remixer-t5 compile`).
  chunk_size: int = 128
  eps: float = 1e-6

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    del deterministic  # there are no attention weights to drop out
    cfg = self.config
    inner = cfg.num_heads * cfg.head_dim
    init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    proj = lambda name, x: layers.Dense(inner, ("embed", "joined_kv"), kernel_init=init, dtype=cfg.dtype, name=name)(x)
    split = lambda x: x.reshape(x.shape[:-1] + (cfg.num_heads, cfg.head_dim))
    q = _feature_map(split(proj("query", inputs_q)))
    k = _feature_map(split(proj("key", inputs_kv)))
    v = split(proj("value", inputs_kv)).astype(f32)

    if ctx.causal and ctx.decode:
      out = self._decode(q, k, v)
    else:
      k = k * ctx.kv_mask[:, :, None, None].astype(f32)  # padded keys add nothing to S and z
      if ctx.causal:
        out = self._causal(q, k, v, ctx.q_segment_ids)
      elif ctx.packed:  # the kernel matrix phi(Q) phi(K)^T made explicit, with the [b, 1, q, k] pairwise mask
        a = jnp.einsum("bihd,bjhd->bhij", q, k) * base.pairwise_mask(ctx)
        out = jnp.einsum("bhij,bjhe->bihe", a, v) / (jnp.transpose(a.sum(-1), (0, 2, 1))[..., None] + self.eps)
      else:
        s = jnp.einsum("bjhd,bjhe->bhde", k, v)
        num = jnp.einsum("bihd,bhde->bihe", q, s)
        den = jnp.einsum("bihd,bhd->bih", q, k.sum(1))
        out = num / (den[..., None] + self.eps)
    out = out.reshape(out.shape[:2] + (inner,)).astype(cfg.dtype)
    return layers.Dense(inputs_q.shape[-1], ("joined_kv", "embed"), kernel_init=init, dtype=cfg.dtype, name="out")(out)

  def _causal(self, q: Array, k: Array, v: Array, segment_ids: Array | None) -> Array:
    b, n, h, dk = q.shape
    c = max(1, min(self.chunk_size, n))
    m = -(-n // c)
    seg = jnp.zeros((b, n), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    pad = m * c - n  # the tail beyond n has zero keys (nothing to add) and its outputs are dropped

    def chunks(x):
      x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
      return jnp.moveaxis(x.reshape((b, m, c) + x.shape[2:]), 1, 0)

    tri = jnp.tril(jnp.ones((c, c), f32))

    def step(carry, chunk):
      s, z, run_seg = carry  # state over the running segment's keys so far, and that segment's id
      qc, kc, vc, sc = chunk
      a = jnp.einsum("bihd,bjhd->bhij", qc, kc) * (tri * (sc[:, :, None] == sc[:, None, :]))[:, None]
      # Only queries of the segment still running from the previous chunk read the carried state.
      q_old = qc * (sc == run_seg[:, None])[:, :, None, None]
      num = jnp.einsum("bhij,bjhe->bihe", a, vc) + jnp.einsum("bihd,bhde->bihe", q_old, s)
      den = jnp.transpose(a.sum(-1), (0, 2, 1)) + jnp.einsum("bihd,bhd->bih", q_old, z)
      # The next state covers the keys of this chunk's last segment, plus the old state if it continues it.
      last = sc[:, -1]
      keep_old = (last == run_seg).astype(f32)
      k_last = kc * (sc == last[:, None])[:, :, None, None]
      s = s * keep_old[:, None, None, None] + jnp.einsum("bjhd,bjhe->bhde", k_last, vc)
      z = z * keep_old[:, None, None] + k_last.sum(1)
      return (s, z, last), (num, den)

    init = (jnp.zeros((b, h, dk, v.shape[-1]), f32), jnp.zeros((b, h, dk), f32), seg[:, 0])
    _, (num, den) = base.scan(step, init, (chunks(q), chunks(k), chunks(v), chunks(seg)))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape((b, m * c) + x.shape[3:])[:, :n]
    return unchunk(num) / (unchunk(den)[..., None] + self.eps)

  def _decode(self, q: Array, k: Array, v: Array) -> Array:
    """The RNN form (§3.4): add phi(k) v^T and phi(k) of the new position to the cached (S, z)."""
    b, _, h, dk = q.shape
    initialized = self.has_variable("cache", "state")
    state = self.variable("cache", "state", jnp.zeros, (b, h, dk, v.shape[-1]), f32)
    normaliser = self.variable("cache", "normaliser", jnp.zeros, (b, h, dk), f32)
    if not initialized:  # the first call only creates the cache; its output is discarded
      return self._causal(q, k, v, None)
    if q.shape[1] != 1:
      raise ValueError(f"decode step expects one position at a time, got length {q.shape[1]}")
    state.value = state.value + jnp.einsum("bjhd,bjhe->bhde", k, v)
    normaliser.value = normaliser.value + k.sum(1)
    num = jnp.einsum("bihd,bhde->bihe", q, state.value)
    den = jnp.einsum("bihd,bhd->bih", q, normaliser.value)
    return num / (den[..., None] + self.eps)
