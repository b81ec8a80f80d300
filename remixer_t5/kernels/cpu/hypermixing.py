"""CPU-only runs: HyperMixing's token mixing (mixers/hypermixer.py) as fused C++ loops, forward and gradient.

Why: two of the layer's three forms spend XLA:CPU's time on memory, not arithmetic: the causal form
(`HyperMixing._causal`) writes every position's d'×d state to memory and runs the GELU over it from there, and
the segmented form (`_segmented`, packed rows without a causal mask) handles `segment_block` segment ids per step
over every query and key. `csrc/hypermixing.cc` (its header has the equations) keeps one running state per
sequence in cache, and gives each (row, segment id) its own state read by its queries only. What it saves:
docs/benchmarks.md, "Kernels against plain JAX" (`remixer-t5 bench kernels`).

How: the handlers are compiled on first use (ffi.py: the system's C++ compiler, `-O3 -march=native`,
cached under `$REMIXER_T5_CACHE_DIR/cpu_hypermixing/`) and registered as four custom calls on CPU
(`remixer_hypermixing_{causal,segmented}` and their `_grad`s). `causal(...)` and `segmented(...)` are
`custom_vjp`s over them. Work (sequences; (row, id) groups) is shared out over XLA's intra-op threads.

When: `causal` and `segmented` are the `cpu` implementation of `HyperMixing.impl` (kernels/__init__.py: `auto`
takes them in programs lowered for CPUs). They are built the first time a program needs them, and run float32
in a process with one JAX device (a custom call cannot be partitioned over a mesh); otherwise, or where the C++
does not build, the layer's XLA forms run. Unpacked non-causal mixing (two einsums) and decoding (one position
added to a cached state) are XLA's forms everywhere.

Numerics: the same sums in another order, and the GELU's Φ from Abramowitz & Stegun 7.1.26 (|error| ≤ 1.5e-7
in erf) instead of XLA's erf: outputs and gradients within ~1e-6 of XLA's forms, relative to their largest
values (tests/test_cpu_hypermixing.py). The segmented kernel reads every segment id >= 1 present among a
row's queries; XLA's form looks only at ids up to min(query length, key length), which is every id when
seqio numbers a row's examples 1, 2, ... (an id above the key length would have no keys there).
"""

from __future__ import annotations

import platform
from typing import Callable, MutableMapping

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5 import kernels
from remixer_t5.kernels.cpu import ffi

SOURCE = ffi.CSRC / "hypermixing.cc"
FORWARD, BACKWARD = "remixer_hypermixing_causal", "remixer_hypermixing_causal_grad"
SEGMENTED, SEGMENTED_GRAD = "remixer_hypermixing_segmented", "remixer_hypermixing_segmented_grad"
# States saved for the backward pass every BLOCK positions; the backward recomputes a block's states from
# there (BLOCK × d' × d floats a thread).
BLOCK = 8

_state: dict = {}  # 'registered': True, or 'failed': the reason


def flags() -> tuple[str, ...]:
  """-O3 for this CPU; on x86-64, 512-bit vectors where it has them (GCC prefers 256 by default).

  `-fno-trapping-math` (no code here reads floating-point exception flags) lets GCC if-convert the GELU's
  selects (`a < 0 ? tail : 1 - tail`, the exp's clamp) into blends: without it GCC 12 vectorises the causal
  forward and segmented GELU loops only with AVX-512's masks, so on AVX2 CPUs they run scalar."""
  extra = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
  return ("-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math", *extra)


def build(environ: MutableMapping[str, str] | None = None, log: Callable[[str], None] | None = None, out_dir=None):
  return ffi.build(SOURCE, "cpu_hypermixing", flags(), environ, log, out_dir, what="HyperMixing")


UNUSABLE = "the C++ loops take float32 operands on one device, in a process that could build them"


def usable(dtype) -> bool:
  """Whether HyperMixing of `dtype` can run through the kernels in this process (building them if needed)."""
  targets = {
    FORWARD: "RemixerHyperMixingCausal",
    BACKWARD: "RemixerHyperMixingCausalGrad",
    SEGMENTED: "RemixerHyperMixingSegmented",
    SEGMENTED_GRAD: "RemixerHyperMixingSegmentedGrad",
  }
  return (
    jnp.dtype(dtype) == jnp.float32
    and jax.device_count() == 1
    and ffi.register_once(_state, build, targets, lambda why: None)
  )


def describe() -> str | None:
  """What the CPU form of HyperMixing ran, for benchmark rows: None before the kernels were registered."""
  if _state.get("registered"):
    return "fused C++ loops via FFI"
  return f"XLA's forms ({_state['failed']})" if "failed" in _state else None


def _call(names: tuple[str, str], args: tuple, shapes: tuple, **attrs):
  """The custom calls `names` (forward, gradient) on args (w1, x, w2, mask, then the int32 ids) as a custom_vjp.
  The forward returns `shapes`: the output, then what the gradient reads between the operands and the cotangent."""
  forward = jax.ffi.ffi_call(names[0], shapes, vmap_method="sequential")
  backward = jax.ffi.ffi_call(
    names[1], tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in args[:3]), vmap_method="sequential"
  )

  @jax.custom_vjp
  def kernel(*args):
    return forward(*args, **attrs)[0]

  def kernel_fwd(*args):
    out, *saved = forward(*args, **attrs)
    return out, (args, saved)

  def kernel_bwd(residuals, g):
    args, saved = residuals
    dw1, dx, dw2 = backward(*args, *saved, g, **attrs)
    return (dw1, dx, dw2, jnp.zeros_like(args[3])) + (None,) * (len(args) - 4)  # none for the mask and the ids

  kernel.defvjp(kernel_fwd, kernel_bwd)
  return kernel(*args)


def causal(w1, x, w2, mask, segment_ids, *, reference: Callable, length_normalize: bool, block: int = BLOCK):
  """out_i = W2[i] GELU(Σ_{j<=i, same segment, real} W1[j]^T x_j (/ their count)), w1, w2 [b, n, d'], x [b, n, d],
  mask [b, n] (1 for real keys), segment_ids [b, n] or None: float32, through the kernel where it can run (`usable`),
  else `reference(w1, x, w2, mask, segment_ids)` (the layer's scan)."""
  if not usable(w1.dtype):
    return kernels.hand_back(reference, UNUSABLE, w1, x, w2, mask, segment_ids)
  seg = jnp.zeros(mask.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  (b, n, h), d = w1.shape, x.shape[-1]
  shapes = (jax.ShapeDtypeStruct((b, n, d), jnp.float32), jax.ShapeDtypeStruct((b, -(-n // block), h, d), jnp.float32))
  args = tuple(a.astype(jnp.float32) for a in (w1, x, w2, mask)) + (seg,)
  return _call((FORWARD, BACKWARD), args, shapes, length_normalize=np.int64(length_normalize), block=np.int64(block))


def segmented(w1, x, w2, mask, q_segment_ids, kv_segment_ids, *, reference: Callable, length_normalize: bool):
  """Packed non-causal HyperMixing: out_i = W2[i] GELU(Σ_{j real, kv_seg_j = q_seg_i} W1[j]^T x_j (/ their
  count)) for queries of id >= 1 (0 for padding), w1 [b, nk, d'], x [b, nk, d], w2 [b, nq, d'], mask [b, nk]:
  float32, through the kernel where it can run (`usable`), else `reference(w1, x, w2, mask, q_segment_ids,
  kv_segment_ids)`."""
  if not usable(w1.dtype):
    return kernels.hand_back(reference, UNUSABLE, w1, x, w2, mask, q_segment_ids, kv_segment_ids)
  shapes = (jax.ShapeDtypeStruct((w2.shape[0], w2.shape[1], x.shape[-1]), jnp.float32),)
  args = tuple(a.astype(jnp.float32) for a in (w1, x, w2, mask)) + (
    jnp.asarray(q_segment_ids, jnp.int32),
    jnp.asarray(kv_segment_ids, jnp.int32),
  )
  return _call((SEGMENTED, SEGMENTED_GRAD), args, shapes, length_normalize=np.int64(length_normalize))
