"""CPU-only runs: JAX's Threefry-2x32 hash unrolled for large arrays, so XLA:CPU fuses dropout's random bits.

Why: JAX (0.10.2) lowers its counter-based PRNG's hash, `threefry2x32_p`, on CPU as a `fori_loop` of 5
iterations of 4 rounds (a "rolled" loop, to keep compile times short; TPU and GPU get it unrolled). On XLA:CPU
each iteration is a handful of separate loops over the whole array plus copies of the loop state: a T5.1.1
COGS train step (models/t5_1_1/cogs.gin, batch 4, 64/320, dropout 0.1) ran 49 such while loops, ~5,300 of its
~10,800 executed operations, and each attention-dropout mask (u32[4,4,320,320]) went through memory 5 times.

What: `threefry_2x32` below is Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror & Shaw 2011, "Parallel random
numbers: as easy as 1, 2, 3", §3; the Random123 library's threefry2x32_R(20, ...)), written as plain jnp
operations, unrolled or as a loop over its 5 groups of rounds. `configure()` registers `lowering` as
`threefry2x32_p`'s lowering for the CPU platform (`jax.interpreters.mlir.register_lowering`): arrays of at least
UNROLL_MIN elements (attention-dropout masks) get the unrolled hash, which XLA fuses with the mask's comparison
and the select that applies it; smaller ones (keys, T5's [batch, 1, d] masks broadcast over the positions) keep
a loop, because XLA would fuse an unrolled hash into every consumer and hash a broadcast mask's element once per
position it is read at. The hash is the same function, so every key, split, fold_in and dropout mask is bit for
bit what JAX computes: runs keep their random streams (tests/test_cpu_threefry.py checks Random123's known
answers and JAX's own bits). XLA fuses the rest of the program differently, which can move a loss in its last
float bits. Measured in docs/benchmarks.md ("Dropout's random bits on CPU"; scripts/bench_threefry_cpu.py).

Once per mask: a dropout mask is read twice in a train step, by the forward select and by the backward one, and
XLA fuses the unrolled hash into both (a T5.1.1 COGS step hashed each decoder attention mask, 1.6M elements,
in a 5 ms forward loop and again in a 11-13 ms backward one). `materialize(mask)`, which `layers.Dropout` applies
to masks of UNROLL_MIN+ elements, passes the mask through a custom call XLA cannot fuse through
(`csrc/materialize.cc`: an identity on an aliased buffer, built on first use by cpu_ffi.py), so the hash and
the comparison run once, in one loop that writes the boolean mask, and both selects read it. Only on CPU
(`lax.platform_dependent`), in a process with one JAX device (a custom call cannot be partitioned over a
mesh), and not inside `flop_count.counting_model_flops()`. The mask is the same, so the run is the same.

When: `configure()` is called by the CLI for train, eval, bench and repro, and acts only when JAX will run on
CPU alone; `$REMIXER_T5_CPU_THREEFRY` = `on` (default: the unrolled hash, large masks computed once where the
custom call builds, else fused as in `fused`, saying why in one line), `fused` (the unrolled hash fused into
every consumer: the behaviour before 2026-11-28) or `off` (JAX's rolled loop everywhere, masks as JAX leaves
them). Programs lowered for TPU or GPU (`remixer-t5 compile`) never use the CPU rule.
"""
from __future__ import annotations

import math
from typing import Callable, MutableMapping

from remixer_t5 import cpu_ffi, flop_count

ENV = "REMIXER_T5_CPU_THREEFRY"
MODES = ("on", "fused", "off")
DEFAULT_MODE = "on"
MATERIALIZE = "remixer_materialize"  # the custom call's target name
SOURCE = cpu_ffi.CSRC / "materialize.cc"
# Threefry-2x32's rotation constants, rounds 0-7 (then repeating), and the key-schedule parity constant.
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA
ROUNDS = 20  # a key injection after every 4
UNROLL_MIN = 1 << 16  # elements; `lowering`

applied = False  # set by configure(); benchmark rows record it
once = False  # set by configure() in `on`: large dropout masks go through `materialize`
_state: dict = {}  # "registered" once the custom call is, "failed": why it could not be
_log: Callable[[str], None] | None = None
_environ: MutableMapping[str, str] | None = None


def _round(x, rot):
  """One round: x0 += x1; x1 = rotl(x1, rot) ^ x0."""
  x0 = x[0] + x[1]
  return [x0, ((x[1] << rot) | (x[1] >> (32 - rot))) ^ x0]


def _inject(x, ks, s):
  """The key injection after the s-th group of 4 rounds (s = 1..5, an int or a traced one); `ks` stacks the
  three key words."""
  import jax.numpy as jnp
  return [x[0] + ks[s % 3], x[1] + ks[(s + 1) % 3] + jnp.asarray(s, jnp.uint32)]


def threefry_2x32(key1, key2, x1, x2, rolled: bool = False):
  """Threefry-2x32-20 of the counter words (x1, x2) under the key (key1, key2), all uint32 and broadcastable:
  the hash's two output words. 20 rounds of (add, rotate, xor), a key word pair and the group's index added
  after every 4: unrolled, or (`rolled`) as a loop over the 5 groups of 4 rounds."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in (key1, key2, x1, x2)))
  key1, key2, x1, x2 = (jnp.broadcast_to(jnp.asarray(a, jnp.uint32), shape) for a in (key1, key2, x1, x2))
  ks = jnp.stack([key1, key2, key1 ^ key2 ^ np.uint32(PARITY)])
  x = [x1 + ks[0], x2 + ks[1]]
  if not rolled:
    for r in range(ROUNDS):
      x = _round(x, np.uint32(ROTATIONS[r % 8]))
      if r % 4 == 3:
        x = _inject(x, ks, r // 4 + 1)
    return tuple(x)
  rotations = jnp.asarray(ROTATIONS, jnp.uint32)

  def group(g, x):  # g = 0..4: rounds 4g..4g+3, then injection g + 1
    for i in range(4):
      x = _round(x, rotations[(g % 2) * 4 + i])
    return _inject(x, ks, g + 1)
  return tuple(jax.lax.fori_loop(0, ROUNDS // 4, group, x))


def lowering(*args):
  """The CPU lowering's function: unrolled for arrays of at least UNROLL_MIN elements, where XLA fuses the
  whole hash into the loop that uses the bits; rolled below that. A small array's bits are read by many
  elements of a bigger one (T5's dropout masks [batch, 1, d] are broadcast over the positions), and XLA,
  fusing the unrolled hash into each consumer, would hash every mask element once per position; the loop's
  output is written once and read."""
  import jax.numpy as jnp
  size = math.prod(jnp.broadcast_shapes(*(jnp.shape(a) for a in args)))
  return threefry_2x32(*args, rolled=size < UNROLL_MIN)


def register() -> None:
  """Makes `lowering` the CPU lowering of JAX's `threefry2x32_p` for everything lowered from now on."""
  from jax.extend.random import threefry2x32_p
  from jax.interpreters import mlir
  mlir.register_lowering(threefry2x32_p, mlir.lower_fun(lowering, multiple_results=True), platform="cpu")


def configure(log: Callable[[str], None] | None = None, environ: MutableMapping[str, str] | None = None,
              cpu_only: bool | None = None) -> bool:
  """Registers `lowering` when wanted (module docstring), and in `on` arms `materialize`; returns whether it
  registered. ValueError for a bad value of $REMIXER_T5_CPU_THREEFRY."""
  global applied, once, _log, _environ
  chosen = cpu_ffi.wanted_mode(ENV, MODES, DEFAULT_MODE, environ, cpu_only)
  if chosen is None:
    return False
  register()
  applied, once, _log, _environ = True, chosen == "on", log, environ
  if log:
    log(f"random bits: Threefry unrolled on XLA:CPU for arrays of {UNROLL_MIN:,}+ elements, the same bits"
        + (", each such dropout mask hashed once" if once else "")
        + f" (remixer_t5/cpu_threefry.py; ${ENV}=off for JAX's rolled loop)")
  return True


def _register() -> bool:
  """Builds and registers the custom call once per process; False (after one line) if that fails."""
  def failed(why: str) -> None:
    if _log:
      _log(f"random bits: dropout masks hashed in each loop that reads them ({why}); see remixer_t5/cpu_threefry.py")
  return cpu_ffi.register_once(
      _state, lambda: cpu_ffi.build(SOURCE, "cpu_threefry", ("-O2",), _environ, _log, what="random bits"),
      {MATERIALIZE: "RemixerMaterialize"}, failed)


def describe() -> str | None:
  """What dropout's random bits run on, for benchmark rows: None for JAX's rolled loop."""
  if not applied:
    return None
  return "unrolled, large masks hashed once" if once and _state.get("registered") else "unrolled"


def materialize(mask):
  """`mask` itself, computed into one buffer on CPU-only runs in `on` mode when it has UNROLL_MIN+ elements, so
  XLA hashes it once instead of in every loop that reads it (module docstring); elsewhere untouched."""
  import jax
  if not (once and math.prod(mask.shape) >= UNROLL_MIN and not flop_count.counting()
          and jax.device_count() == 1 and _register()):
    return mask
  call = jax.ffi.ffi_call(MATERIALIZE, jax.ShapeDtypeStruct(mask.shape, mask.dtype),
                          input_output_aliases={0: 0}, vmap_method="broadcast_all")
  return jax.lax.platform_dependent(mask, cpu=call, default=lambda m: m)
