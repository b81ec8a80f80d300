"""Dropout's keep mask on CPUs: JAX's own bits, with the Threefry hash unrolled so XLA:CPU fuses it.

JAX lowers its counter-based PRNG hash (`threefry2x32_p`) on CPU as a loop of 5 groups of 4 rounds, to keep
compile times short; TPUs and GPUs get it unrolled. On XLA:CPU each loop iteration is a handful of separate passes
over the whole array, so every attention-dropout mask ([batch, heads, q, k]) goes through memory several times a
step. `keep_mask` computes the same mask as `jax.random.bernoulli(key, keep_prob, shape)`, bit for bit, with
`threefry_2x32` below: Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers:
as easy as 1, 2, 3", §3; Random123's threefry2x32_R(20, ...)) written as plain jnp operations, unrolled, on JAX's
counters (`jax_threefry_partitionable`, JAX's default). XLA fuses the unrolled hash with the comparison that
makes the mask; `materialize` then passes the mask through an identity custom call (`csrc/materialize.cc`, its
operand aliased to its result) that XLA cannot fuse through, so the hash runs once a step, not once in the
forward select and again in the backward one.

Only masks of at least UNROLL_MIN elements take this form. Smaller ones (T5's [batch, 1, d] masks, broadcast over
the positions) keep JAX's loop: XLA would fuse an unrolled hash into every consumer and hash a broadcast mask's
element once per position that reads it. The custom call is used in a process with one JAX device (a custom call
cannot be partitioned over a mesh) and where the C++ builds; else the unrolled hash alone is used.
`tests/test_cpu_threefry.py` checks Random123's known answers and the masks against JAX's.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5 import kernels
from remixer_t5.kernels.cpu import ffi

MATERIALIZE = "remixer_materialize"  # the custom call's target name
SOURCE = ffi.CSRC / "materialize.cc"
# Threefry-2x32's rotation constants, rounds 0-7 (then repeating), and the key-schedule parity constant.
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA
ROUNDS = 20  # a key injection after every 4
UNROLL_MIN = 1 << 16  # elements
_state: dict = {}  # "registered" once the custom call is, "failed": why it could not be


def threefry_2x32(key1, key2, x1, x2):
  """Threefry-2x32-20 of the counter words (x1, x2) under the key (key1, key2), all uint32 and broadcastable: the hash's
  two output words. 20 rounds of (add, rotate, xor), a key word pair and the group's index added after every 4."""
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in (key1, key2, x1, x2)))
  key1, key2, x1, x2 = (jnp.broadcast_to(jnp.asarray(a, jnp.uint32), shape) for a in (key1, key2, x1, x2))
  ks = (key1, key2, key1 ^ key2 ^ np.uint32(PARITY))
  x = [x1 + ks[0], x2 + ks[1]]
  for r in range(ROUNDS):
    rot = np.uint32(ROTATIONS[r % 8])
    x0 = x[0] + x[1]
    x = [x0, ((x[1] << rot) | (x[1] >> (np.uint32(32) - rot))) ^ x0]
    if r % 4 == 3:  # key injection s = 1..5
      s = r // 4 + 1
      x = [x[0] + ks[s % 3], x[1] + ks[(s + 1) % 3] + np.uint32(s)]
  return tuple(x)


def keep_mask(key, keep_prob: float, shape: tuple[int, ...], *, reference: Callable):
  """`jax.random.bernoulli(key, keep_prob, shape)`, bit for bit: the unrolled hash on JAX's counters for
  UNROLL_MIN+ elements, computed once (`materialize`); `reference(key)` (JAX's) below that."""
  size = math.prod(shape)
  if size < UNROLL_MIN:  # small masks: JAX's own draw is as fast
    return reference(key)
  if size >= 1 << 32 or not jax.config.jax_threefry_partitionable:
    return kernels.hand_back(
      reference,
      "the unrolled hash takes masks under 2^32 elements with jax's "
      "partitionable threefry (jax_threefry_partitionable)",
      key,
    )
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  # JAX's counters: each element's row-major index as a 64-bit number, in two uint32 words (high ones 0 here).
  counts = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
  for axis in range(1, len(shape)):
    counts = counts * np.uint32(shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
  bits1, bits2 = threefry_2x32(data[0], data[1], jnp.zeros(shape, jnp.uint32), counts)
  bits = bits1 ^ bits2
  # jax.random.uniform's float32 in [0, 1): 23 mantissa bits under the exponent of 1.0, less 1.0.
  floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.float32(1.0).view(np.uint32), jnp.float32)
  uniform = jax.lax.max(jnp.float32(0.0), floats - jnp.float32(1.0))
  return materialize(uniform < keep_prob)


def materialize(mask):
  """`mask` itself, computed into one buffer so that XLA hashes it once instead of in every loop that reads it
  (module docstring); untouched in a process with several JAX devices or where the custom call cannot build."""
  if jax.device_count() != 1 or not _register():
    return mask
  call = jax.ffi.ffi_call(
    MATERIALIZE, jax.ShapeDtypeStruct(mask.shape, mask.dtype), input_output_aliases={0: 0}, vmap_method="broadcast_all"
  )
  return call(mask)


def _register() -> bool:
  """Builds and registers the custom call once per process; False if that fails (the mask is then fused)."""
  return ffi.register_once(
    _state,
    lambda: ffi.build(SOURCE, "cpu_threefry", ("-O2",), what="random bits"),
    {MATERIALIZE: "RemixerMaterialize"},
    lambda why: None,
  )


def describe() -> str:
  """What the CPU form of dropout's mask runs, for benchmark rows."""
  return "unrolled hash, large masks computed once" if _state.get("registered") else "unrolled hash"
