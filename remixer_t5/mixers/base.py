"""The contract every token mixer and feature mixer follows, and the masks they share.

A layer is "token mixing + feature mixing" (HyperMixer paper, Fig. 1). The stacks in `network.py` call

    token_mixer(inputs_q, inputs_kv, ctx, deterministic=...)  -> [batch, q_len, emb]
    feature_mixer(x, ctx, deterministic=...)                   -> [batch, len, emb]

where self-mixing passes `inputs_kv is inputs_q` and cross-mixing passes the encoder output. Every mixer is a
Flax module constructed as `factory(config=T5Config, name=...)`; its own hyperparameters are dataclass
fields with defaults (bound in gin). With `ctx.decode` a mixer sees one new position per call and keeps what
it needs in the 'cache' collection: the first call (cache absent) carries the full `max_decode_length` and
only creates the cache (its output is discarded), like t5x's attention.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class MixerContext:
  """What a mixer may know about the sequences besides their vectors.

  Masks are 1.0 at real tokens and 0.0 at padding. Positions restart at 0 in each packed segment; segment ids
  are None when nothing is packed (otherwise 0 marks padding).
  """
  q_mask: Array                      # [batch, q_len]
  kv_mask: Array                     # [batch, kv_len]
  q_positions: Array                 # [batch or 1, q_len] int32
  kv_positions: Array                # [batch or 1, kv_len] int32
  q_segment_ids: Array | None = None     # [batch, q_len] int32
  kv_segment_ids: Array | None = None    # [batch, kv_len] int32
  causal: bool = struct.field(pytree_node=False, default=False)   # query i sees keys j <= i only
  decode: bool = struct.field(pytree_node=False, default=False)   # one new position per call, with a cache
  max_decode_length: int | None = struct.field(pytree_node=False, default=None)
  # The stack's shared relative-position-bias module (T5); only attention uses it, so only then the table
  # exists. Called as relpos(q_positions, kv_positions, bidirectional=not causal) -> [b|1, heads, q, k].
  relpos: Callable[..., Array] | None = struct.field(pytree_node=False, default=None)

  @property
  def packed(self) -> bool:
    return self.q_segment_ids is not None


def pairwise_mask(ctx: MixerContext) -> Array:
  """[batch, 1, q_len, kv_len] float mask: real query and key, same segment, and j <= i when causal.

  Not for decode steps (there the cache decides which positions exist).
  """
  mask = ctx.q_mask[:, :, None] * ctx.kv_mask[:, None, :]
  if ctx.q_segment_ids is not None and ctx.kv_segment_ids is not None:
    mask = mask * (ctx.q_segment_ids[:, :, None] == ctx.kv_segment_ids[:, None, :])
  if ctx.causal:
    q, k = mask.shape[1], mask.shape[2]
    mask = mask * (jnp.arange(k)[None, :] <= jnp.arange(q)[:, None])[None]
  return mask[:, None].astype(jnp.float32)


def check_length(length: int, max_length: int, what: str) -> None:
  """Fixed-length mixers refuse longer sequences with an error that names both numbers."""
  if length > max_length:
    raise ValueError(f"{what} mixes at most {max_length} positions but got a sequence of length {length}; "
                     f"the model configs take max_length from TASK_FEATURE_LENGTHS (load the run's gin file after "
                     f"the model's, or pass --gin.TASK_FEATURE_LENGTHS), and an INIT_CHECKPOINT made at other "
                     f"lengths is fitted on load (remixer_t5/fixed_length.py)")


def cache_index(module, name: str = "cache_index") -> Any:
  """The module's decode position counter in the 'cache' collection (created at 0)."""
  return module.variable("cache", name, lambda: jnp.array(0, dtype=jnp.int32))
