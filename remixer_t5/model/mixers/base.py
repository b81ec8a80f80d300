"""The contract every token mixer and feature mixer follows, and the masks they share.

A layer is "token mixing + feature mixing" (HyperMixer paper, Fig. 1). The stacks in `network.py` call

    token_mixer(inputs_q, inputs_kv, ctx, deterministic=...)  -> [batch, q_len, emb]
    feature_mixer(x, ctx, deterministic=...)                   -> [batch, len, emb]

where self-mixing passes `inputs_kv is inputs_q` and cross-mixing passes the encoder output. Every mixer is a Flax
module constructed as `factory(config=T5Config, name=...)`; its own hyperparameters are dataclass fields with defaults
(bound in gin). With `ctx.decode` a mixer sees one new position per call and keeps what it needs in the 'cache'
collection: the first call (cache absent) carries the full `max_decode_length` and only creates the cache (its output is
discarded), like t5x's attention. What depends on the encoder output only is computed once (`static_cache`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from remixer_t5 import flop_count

Array = jax.Array


@struct.dataclass
class MixerContext:
  """What a mixer may know about the sequences besides their vectors.

  Masks are 1.0 at real tokens and 0.0 at padding. Positions restart at 0 in each packed segment; segment ids
  are None when nothing is packed (otherwise 0 marks padding)."""

  q_mask: Array  # [batch, q_len]
  kv_mask: Array  # [batch, kv_len]
  q_positions: Array  # [batch or 1, q_len] int32
  kv_positions: Array  # [batch or 1, kv_len] int32
  q_segment_ids: Array | None = None  # [batch, q_len] int32
  kv_segment_ids: Array | None = None  # [batch, kv_len] int32
  causal: bool = struct.field(pytree_node=False, default=False)  # query i sees keys j <= i only
  decode: bool = struct.field(pytree_node=False, default=False)  # one new position per call, with a cache
  max_decode_length: int | None = struct.field(pytree_node=False, default=None)
  # Cross-mixing while decoding: inputs_kv (the encoder output) is the same at every step, so a mixer may
  # compute what depends on it once, with `static_cache`. `decode` stays False for cross-mixing.
  static_kv: bool = struct.field(pytree_node=False, default=False)
  # The stack's shared relative-position-bias module (T5); only attention uses it, so only then the table
  # exists. Called as relpos(q_positions, kv_positions, bidirectional=not causal) -> [b|1, heads, q, k], or
  # with two ints (q_len, kv_len) for the row indices 0..len-1 -> kernels.bias.RelativeBias.
  relpos: Callable[..., Array] | None = struct.field(pytree_node=False, default=None)

  @property
  def packed(self) -> bool:
    return self.q_segment_ids is not None


def pairwise_mask(ctx: MixerContext) -> Array:
  """[batch, 1, q_len, kv_len] float mask: real query and key, same segment, and j <= i when causal.

  Not for decode steps (there the cache decides which positions exist)."""
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
    raise ValueError(
      f"{what} mixes at most {max_length} positions but got a sequence of length {length}; "
      f"the model configs take max_length from TASK_FEATURE_LENGTHS (load the run's gin file after "
      f"the model's, or pass --gin.TASK_FEATURE_LENGTHS), and an INIT_CHECKPOINT made at other "
      f"lengths is fitted on load (remixer_t5/model/fixed_length.py)"
    )


def slice_gather(table: Array, pos: Array) -> Array:
  """table[pos[b, i], pos[b, j]] -> [batch, len, len] for a square per-position table (Remixer's H, gMLP's W)
  read at each example's own positions: a row gather, then a column gather per example.

  Two gathers of whole rows / columns (and their scatter-add transposes) instead of one gather of single
  elements, which TPUs serialise."""
  rows = jnp.take(table, pos, axis=0, mode="clip")  # [b, len, L]
  columns = lambda r, p: jnp.take(r, p, axis=1, mode="clip")
  return jax.vmap(columns)(rows, jnp.broadcast_to(pos, rows.shape[:2]))


STATIC_CACHE = "static_cache"  # collection of decode values computed once from the encoder output


def static_cache(module, name: str, compute: Callable[[], Array]) -> Array:
  """`compute()`, kept in the STATIC_CACHE collection when the caller asked for it.

  For what a decode step derives from the encoder output only (cross-attention's keys and values).
  `models.EncoderDecoderModel.predict_batch` makes the collection mutable in the cache-creating first call, so
  the value is computed there once, and hands it to every step as a constant: it is not decode-loop state, so
  beam search never reorders it. Callers that do not (t5x's decoding, which creates the cache from dummy
  inputs and makes only 'cache' mutable) get `compute()` every step, relying on XLA to hoist it, which XLA:CPU
  does for the projection but not for the transpose to the layout the attention products read."""
  if module.has_variable(STATIC_CACHE, name) or module.is_mutable_collection(STATIC_CACHE):
    return module.variable(STATIC_CACHE, name, compute).value
  return compute()


def cache_index(module, name: str = "cache_index") -> Any:
  """The module's decode position counter in the 'cache' collection (created at 0)."""
  return module.variable("cache", name, lambda: jnp.array(0, dtype=jnp.int32))


def scan(step: Callable, init: Any, xs: Any, *, remat: bool = False) -> tuple[Any, Any]:
  """`jax.lax.scan` for a mixer's chunk loop, its body rematerialised for the gradient when `remat`; fully
  unrolled and without the checkpoint inside `counting_model_flops()`."""
  if flop_count.counting():  # a Python loop: lax.scan(unroll=True) still emits a while loop for one chunk
    carry, ys = init, []
    for i in range(jax.tree_util.tree_leaves(xs)[0].shape[0]):
      carry, y = step(carry, jax.tree_util.tree_map(lambda a: a[i], xs))
      ys.append(y)
    return carry, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)
  return jax.lax.scan(jax.checkpoint(step) if remat else step, init, xs)
