"""CPU-only runs: HyperMixing's token mixing (mixers/hypermixer.py) as fused C++ loops, forward and gradient.

Why: two of the layer's three forms spend XLA:CPU's time on memory, not arithmetic.
- Causal (`HyperMixing._causal`, the decoder's self-mixing): the hidden state is a d'×d matrix per position,
  and the chunked scan writes every position's state to memory and runs the GELU over it from there (at
  COGS's shapes, batch 4 × 320 positions × d' 288 × d 128, 47M floats per layer pass).
- Segmented (`_segmented`, packed rows without a causal mask: the encoder's self-mixing and the cross-mixing):
  XLA's form handles `segment_block` segment ids per step over every query and key, so its cost grows with
  the number of examples packed in a row (~7 in COGS).
Together they made HyperMixer's COGS train step 0.86 s on 2 cores against T5.1.1's ~0.13 s, and its
12,000-step runs ~2.8 h (docs/reproductions.md). `csrc/hypermixing.cc` keeps one running state per sequence
in cache and walks the positions (its gradient walks them in reverse from states saved every `BLOCK`
positions), and gives each (row, segment id) its own state built from that segment's keys and read by its
queries only; the file's header has the equations. At COGS's shapes a causal layer's forward + backward took
80 ms against the scan's 274, and the packed train step 0.26 s against 0.86 (docs/benchmarks.md, "HyperMixing
on CPU"; scripts/bench_hypermixing_cpu.py).

How: the handlers are compiled on first use (cpu_ffi.py: the system's C++ compiler, `-O3 -march=native`,
cached under `$REMIXER_T5_CACHE_DIR/cpu_hypermixing/`) and registered as four custom calls on CPU
(`remixer_hypermixing_{causal,segmented}` and their `_grad`s). `causal(...)` and `segmented(...)` are
`custom_vjp`s over them, behind `lax.platform_dependent`: a program lowered for TPU or GPU (`remixer-t5
compile`) keeps the layer's XLA forms. Work (sequences; (row, id) groups) is shared out over XLA's intra-op
threads.

When: `configure()` is called by the CLI for train, eval, bench and repro, and arms the route only when JAX will
run on CPU alone; `$REMIXER_T5_CPU_HYPERMIXING` = `auto` (default: the kernels when they build, else XLA's
forms, saying why in one line), `on` (the kernels, or an error saying why not) or `off`. They are built the
first time a HyperMixing layer needs them (a T5 run never builds them), and used only for float32 in a process
with one JAX device (a custom call cannot be partitioned over a mesh). Unpacked non-causal mixing (two
einsums) and decoding (one position added to a cached state) keep XLA's forms.

Numerics: the same sums in another order, and the GELU's Φ from Abramowitz & Stegun 7.1.26 (|error| ≤ 1.5e-7
in erf) instead of XLA's erf: outputs and gradients within ~1e-6 of XLA's forms, relative to their largest
values (tests/test_cpu_hypermixing.py). The segmented kernel reads every segment id >= 1 present among a
row's queries; XLA's form looks only at ids up to min(query length, key length), which is every id when
seqio numbers a row's examples 1, 2, ... (an id above the key length would have no keys there).
"""
from __future__ import annotations

import platform
from typing import Callable, MutableMapping

from remixer_t5 import cpu_ffi

ENV = "REMIXER_T5_CPU_HYPERMIXING"
MODES = ("auto", "on", "off")
DEFAULT_MODE = "auto"
SOURCE = cpu_ffi.CSRC / "hypermixing.cc"
FORWARD, BACKWARD = "remixer_hypermixing_causal", "remixer_hypermixing_causal_grad"
SEGMENTED, SEGMENTED_GRAD = "remixer_hypermixing_segmented", "remixer_hypermixing_segmented_grad"
# States saved for the backward pass every BLOCK positions; the backward recomputes a block's states from
# there (BLOCK × d' × d floats a thread, 1.2 MB at COGS's d' 288, d 128).
BLOCK = 8

armed = False  # configure() allows the kernels; they are built when first needed
mode = "off"
_log: Callable[[str], None] | None = None
_environ: MutableMapping[str, str] | None = None
_state: dict = {}  # 'registered': True, or 'failed': the reason


def flags() -> tuple[str, ...]:
  """-O3 for this CPU; on x86-64, 512-bit vectors where it has them (GCC prefers 256 by default).

  `-fno-trapping-math` (no code here reads floating-point exception flags) lets GCC if-convert the GELU's
  selects (`a < 0 ? tail : 1 - tail`, the exp's clamp) into blends: without it GCC 12 vectorised the causal
  forward and segmented GELU loops only with AVX-512's masks, so on AVX2 CPUs they ran scalar (the causal form
  5.6x slower on a Zen 3 EPYC: docs/benchmarks.md, "HyperMixing on CPU")."""
  extra = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
  return ("-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math", *extra)


def build(environ: MutableMapping[str, str] | None = None, log: Callable[[str], None] | None = None,
          out_dir=None):
  return cpu_ffi.build(SOURCE, "cpu_hypermixing", flags(), environ, log, out_dir, what="HyperMixing")


def configure(log: Callable[[str], None] | None = None, environ: MutableMapping[str, str] | None = None,
              cpu_only: bool | None = None) -> bool:
  """Arms the kernel when wanted (module docstring); returns whether it did. ValueError for a bad mode."""
  global armed, mode, _log, _environ
  chosen = cpu_ffi.wanted_mode(ENV, MODES, DEFAULT_MODE, environ, cpu_only)
  if chosen is None:
    return False
  armed, mode, _log, _environ = True, chosen, log, environ
  return True


def _register() -> bool:
  """Builds and registers the handlers once per process; False (after one line, in `auto`) if that fails."""
  if _state.get("registered"):
    return True

  def failed(why: str) -> None:
    if mode == "on":
      raise ValueError(f"${ENV}=on: {why}") from None
    if _log:
      _log(f"HyperMixing: XLA's forms ({why}); see remixer_t5/cpu_hypermixing.py")
  targets = {FORWARD: "RemixerHyperMixingCausal", BACKWARD: "RemixerHyperMixingCausalGrad",
             SEGMENTED: "RemixerHyperMixingSegmented", SEGMENTED_GRAD: "RemixerHyperMixingSegmentedGrad"}
  if not cpu_ffi.register_once(_state, lambda: build(_environ, _log), targets, failed):
    return False
  if _log:
    _log(f"HyperMixing: fused C++ loops on CPU (remixer_t5/cpu_hypermixing.py; ${ENV}=off for XLA's forms)")
  return True


def usable(dtype) -> bool:
  """Whether HyperMixing of `dtype` runs through the kernels in this process (building them if needed)."""
  import jax
  import jax.numpy as jnp
  return armed and jnp.dtype(dtype) == jnp.float32 and jax.device_count() == 1 and _register()


def describe() -> str | None:
  """What HyperMixing's causal and segmented forms run on, for benchmark rows: None for XLA's forms."""
  return "fused C++ loops via FFI" if armed and _state.get("registered") else None


def _calls(length_normalize: bool, block: int):
  import jax
  import jax.numpy as jnp
  import numpy as np
  attrs = dict(length_normalize=np.int64(length_normalize), block=np.int64(block))

  def forward(w1, x, w2, mask, seg):
    b, n, h = w1.shape
    shapes = (jax.ShapeDtypeStruct((b, n, x.shape[-1]), jnp.float32),
              jax.ShapeDtypeStruct((b, -(-n // block), h, x.shape[-1]), jnp.float32))
    return jax.ffi.ffi_call(FORWARD, shapes, vmap_method="sequential")(w1, x, w2, mask, seg, **attrs)

  def backward(w1, x, w2, mask, seg, ckpt, g):
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (w1, x, w2))
    return jax.ffi.ffi_call(BACKWARD, shapes, vmap_method="sequential")(w1, x, w2, mask, seg, ckpt, g, **attrs)

  return forward, backward


def causal(w1, x, w2, mask, segment_ids, length_normalize: bool, fallback: Callable, block: int = BLOCK):
  """out_i = W2[i] GELU(Σ_{j<=i, same segment, real} W1[j]^T x_j (/ their count)), w1, w2 [b, n, d'], x [b, n, d],
  mask [b, n] (1 for real keys), segment_ids [b, n]: through the kernel on CPU, `fallback(w1, x, w2, mask,
  segment_ids)` (the scan) on any other platform."""
  import jax
  import jax.numpy as jnp
  forward, backward = _calls(length_normalize, block)
  f32 = lambda a: a.astype(jnp.float32)

  @jax.custom_vjp
  def kernel(w1, x, w2, mask, seg):
    return forward(w1, x, w2, mask, seg)[0]

  def kernel_fwd(w1, x, w2, mask, seg):
    out, ckpt = forward(w1, x, w2, mask, seg)
    return out, (w1, x, w2, mask, seg, ckpt)

  def kernel_bwd(residuals, g):
    w1, x, w2, mask, seg, ckpt = residuals
    dw1, dx, dw2 = backward(w1, x, w2, mask, seg, ckpt, g)
    return dw1, dx, dw2, jnp.zeros_like(mask), None  # no gradient for the mask; the ids are integers

  kernel.defvjp(kernel_fwd, kernel_bwd)
  seg = jnp.asarray(segment_ids, jnp.int32)
  return jax.lax.platform_dependent(f32(w1), f32(x), f32(w2), f32(mask), seg, cpu=kernel, default=fallback)


def segmented(w1, x, w2, mask, q_segment_ids, kv_segment_ids, length_normalize: bool, fallback: Callable):
  """Packed non-causal HyperMixing: out_i = W2[i] GELU(Σ_{j real, kv_seg_j = q_seg_i} W1[j]^T x_j (/ their
  count)) for queries of id >= 1 (0 for padding), w1 [b, nk, d'], x [b, nk, d], w2 [b, nq, d'], mask [b, nk]:
  through the kernel on CPU, `fallback(w1, x, w2, mask, q_segment_ids, kv_segment_ids)` elsewhere."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  attrs = dict(length_normalize=np.int64(length_normalize))
  f32 = lambda a: a.astype(jnp.float32)

  def forward(w1, x, w2, mask, q_seg, kv_seg):
    shape = jax.ShapeDtypeStruct((w2.shape[0], w2.shape[1], x.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call(SEGMENTED, shape, vmap_method="sequential")(w1, x, w2, mask, q_seg, kv_seg, **attrs)

  @jax.custom_vjp
  def kernel(w1, x, w2, mask, q_seg, kv_seg):
    return forward(w1, x, w2, mask, q_seg, kv_seg)

  def kernel_fwd(w1, x, w2, mask, q_seg, kv_seg):
    return forward(w1, x, w2, mask, q_seg, kv_seg), (w1, x, w2, mask, q_seg, kv_seg)

  def kernel_bwd(residuals, g):
    w1, x, w2, mask, q_seg, kv_seg = residuals
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (w1, x, w2))
    dw1, dx, dw2 = jax.ffi.ffi_call(SEGMENTED_GRAD, shapes, vmap_method="sequential")(
        w1, x, w2, mask, q_seg, kv_seg, g, **attrs)
    return dw1, dx, dw2, jnp.zeros_like(mask), None, None

  kernel.defvjp(kernel_fwd, kernel_bwd)
  q_seg, kv_seg = jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)
  return jax.lax.platform_dependent(f32(w1), f32(x), f32(w2), f32(mask), q_seg, kv_seg, cpu=kernel,
                                    default=fallback)
