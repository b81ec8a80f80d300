"""CPU-only runs: `layers.Dense`'s products through Intel MKL's sgemm instead of XLA:CPU's own kernels.

Why: on the 2-core Cascade Lake of docs/benchmarks.md, XLA:CPU's float32 products (YNNPACK or Eigen, jaxlib
0.10.2) ran at 98-156 GFLOP/s where PyTorch's MKL sgemm reached 113-231, and most of our train step is those
products (77% of config B's: T5.1.1-small, batch 8, 512/114). That gap kept our step behind Hugging Face's
PyTorch T5 (issue 19 §2). Calling MKL from inside the jitted step (scripts/bench_step_blas.py) made config B's
step ~10% faster in most rounds (0.89x XLA's over two rounds at 8e1e364; 0.88-0.90x in the session before), and
config A's (d 256) 7% faster once small products keep XLA's dot (MIN_FLOPS, below). oneDNN 3.2's dnnl_sgemm
(pip's onednn-cpu-gomp) was 1.29x slower than XLA's own dots on B, and MKL cut into single-threaded blocks on
XLA's pool no faster than XLA (0.99x), so neither is offered here (the script keeps them as variants).

How: `csrc/cpu_sgemm.cc`, an XLA FFI handler (jax.ffi; headers from jaxlib) for one 2-D float32 product with
either operand transposed, is compiled on first use with the system's C++ compiler ($CXX, else c++/g++) into
`$REMIXER_T5_CACHE_DIR/cpu_blas/` (default ~/.cache/remixer_t5; cpu_ffi.py: keyed by the source, the flags, the
jaxlib version and the compiler; written under a temporary name and renamed), loaded, given the address of MKL's `cblas_sgemm_64`,
and registered as the custom call `remixer_sgemm` on CPU. `matmul(x, w)` is a `custom_vjp` whose forward
product and both backward products (dX = dY W^T, dW = X^T dY: the sgemm takes the transposes as flags) are
that call, each behind `lax.platform_dependent`, so a program lowered for TPU or GPU (`remixer-t5 compile`)
keeps XLA's dot. MKL runs each product on its own threads (one per core this process may use) on its GNU
OpenMP layer: Intel's OpenMP threads spin after each product and slowed XLA's next operations.

MKL is an optional extra (`pip install -e '.[mkl]'`: the `mkl` wheel with intel-openmp and tbb, ~690 MB
installed, x86-64 only), found in this environment's lib/ folder (or the user's, for `pip install --user`).

When: `configure()` is called by the CLI for train, eval, bench and repro before JAX starts, and acts only when
JAX will run on CPU alone. `$REMIXER_T5_CPU_BLAS` = `auto` (default: MKL when it is installed, the handler
builds and the CPU is an Intel one (AUTO_VENDORS: on an AMD Zen 3 MKL made the step no faster), else XLA's
dots, saying why in one line when MKL is installed but not used), `mkl` (MKL, or an error
saying why not) or `off`. Even when configured, `matmul` uses the call only for float32 2-D products of at
least MIN_FLOPS (below) in a process with one JAX device: the custom call cannot be partitioned, so meshes of
several CPU devices (`--xla_force_host_platform_device_count`, multi-process gloo runs) keep XLA's dot.
Benchmark rows record `describe()`.

Numerics: the same products in another summation order (relative differences ~1e-6, as between XLA's own
routes); the calling thread flushes subnormals as XLA:CPU's threads do.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path
from typing import Callable, MutableMapping

from remixer_t5 import cpu_ffi, flop_count

ENV = "REMIXER_T5_CPU_BLAS"
MODES = ("auto", "mkl", "off")
DEFAULT_MODE = "auto"
BACKENDS = ("mkl",)  # `auto` tries them in this order
TARGET = "remixer_sgemm"
SOURCE = Path(__file__).with_name("csrc") / "cpu_sgemm.cc"
MKL_THREADING_GNU = 3  # MKL_Set_Threading_Layer's value for GNU OpenMP
MKL_LIB, MKL_PACKAGE = "libmkl_rt.so*", "-e '.[mkl]'"

# Forward products of fewer FLOPs (2 M K N) keep XLA's dot, where XLA fuses and overlaps them better than a
# call out (measured in one process, alternating rounds, on the Cascade Lake: COGS's T5.1.1, d 128, 1.08x
# slower with every product through MKL, 1.00x with this threshold; config A 0.99x with every product, 0.93x
# with this threshold, 0.97x with 2e9), though MKL ran each product alone 1.2-2.5x faster.
MIN_FLOPS = 300_000_000
# `auto` uses MKL on these CPU vendors only. On a 2-core AMD EPYC (Zen 3) MKL's products made the whole step no
# faster (config A 1.016x, B 1.046x and 1.12x XLA's dots, with ~158,000 page faults a B step against ~300, and
# 3.8 GB more peak memory; docs/benchmarks.md, 2026-11-27 sixth session); `mkl` still forces it anywhere.
AUTO_VENDORS = ("GenuineIntel",)
applied = False  # set by configure()
_loaded: dict = {}  # what load() registered: backend, description, threads


Unavailable = cpu_ffi.Unavailable  # a library or the handler cannot be used here; the message says why


class NotInstalled(Unavailable):
  """The library is not in this environment (`auto` then says nothing: XLA's dots are the plain default)."""


def cores() -> int:
  """The cores this process may use (its affinity mask: $REMIXER_T5_CPUS pins it)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _lib(pattern: str, package: str) -> str:
  """The library's file in this environment's lib/ folder, or in the user's (`pip install --user`)."""
  import site
  folders = list(dict.fromkeys(os.path.join(p, "lib") for p in (sys.prefix, site.getuserbase())))
  for folder in folders:
    found = sorted(glob.glob(os.path.join(folder, pattern)))
    if found:
      return found[0]
  raise NotInstalled(f"no {pattern} in {' or '.join(folders)} (pip install {package})")


def _address(fn) -> ctypes.c_void_p:
  return ctypes.c_void_p(ctypes.cast(fn, ctypes.c_void_p).value)


def find_sgemm(backend: str) -> tuple[ctypes.c_void_p, ctypes.c_void_p, str]:
  """(the CBLAS sgemm's address, the set-this-thread's-thread-count function's address, a description) for
  `backend` ('mkl'); Unavailable naming what is missing."""
  if backend != "mkl":
    raise ValueError(f"unknown CPU BLAS {backend!r}: expected one of {', '.join(BACKENDS)}")
  path = _lib(MKL_LIB, MKL_PACKAGE)
  try:
    ctypes.CDLL("libgomp.so.1")  # MKL's GNU threading layer needs it; without it MKL would fail inside a product
  except OSError:
    raise Unavailable("MKL's GNU OpenMP layer needs libgomp.so.1, which is not installed (e.g. apt install "
                      "libgomp1)") from None
  try:
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
  except OSError as e:
    raise Unavailable(f"loading {path} failed: {e}") from None
  if lib.MKL_Set_Threading_Layer(ctypes.c_int(MKL_THREADING_GNU)) != MKL_THREADING_GNU:
    raise Unavailable(f"{os.path.basename(path)} refused its GNU OpenMP threading layer")
  buf = ctypes.create_string_buffer(256)
  lib.MKL_Get_Version_String(buf, ctypes.c_int(len(buf)))
  version = buf.value.decode().split("-Product")[0].split(" Product")[0].strip()
  return _address(lib.cblas_sgemm_64), _address(lib.MKL_Set_Num_Threads_Local), f"{version} cblas_sgemm_64, GNU OpenMP"


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
  """The CPU's vendor_id ("GenuineIntel", "AuthenticAMD", ...), or None where /proc/cpuinfo does not say."""
  try:
    with open(cpuinfo) as f:
      for line in f:
        if line.startswith("vendor_id"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return None


def cache_dir(environ: MutableMapping[str, str] | None = None) -> Path:
  return cpu_ffi.cache_dir("cpu_blas", environ)


def build(environ: MutableMapping[str, str] | None = None, log: Callable[[str], None] | None = None,
          out_dir: Path | None = None) -> Path:
  """The handler's shared library, compiled into the cache (or out_dir) unless there already (cpu_ffi.build);
  Unavailable with the compiler's last lines when it fails."""
  return cpu_ffi.build(SOURCE, "cpu_blas", ("-O2",), environ, log, out_dir, what="CPU matmuls")


def load(backend: str, environ: MutableMapping[str, str] | None = None,
         log: Callable[[str], None] | None = None) -> dict:
  """Builds (if needed) the handler, points it at `backend`'s sgemm on its own threads (one per core) and
  registers it; once per process (a second backend is refused). Returns what describe() reports."""
  global _loaded
  if _loaded:
    if _loaded["backend"] != backend:
      raise Unavailable(f"this process already registered {_loaded['backend']}; one CPU BLAS per process")
    return _loaded
  import jax
  if backend not in BACKENDS:
    raise ValueError(f"unknown CPU BLAS {backend!r}: expected one of {', '.join(BACKENDS)}")
  _lib(MKL_LIB, MKL_PACKAGE)  # NotInstalled before anything is built or loaded
  handler = ctypes.CDLL(str(build(environ, log)))  # before MKL is loaded into the process
  sgemm, set_threads, what = find_sgemm(backend)
  threads = cores()
  handler.remixer_set_blas(sgemm, set_threads, ctypes.c_int(threads), ctypes.c_int(0))  # 0: CBLAS's signature
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler.RemixerSgemm), platform="cpu")
  _loaded = {"backend": backend, "description": what, "threads": threads}
  return _loaded


def configure(log: Callable[[str], None] | None = None, environ: MutableMapping[str, str] | None = None,
              cpu_only: bool | None = None) -> bool:
  """Turns the route on when wanted (module docstring); returns whether it did. ValueError for a bad
  $REMIXER_T5_CPU_BLAS, or when it names a library that cannot be used."""
  global applied
  env = os.environ if environ is None else environ
  mode = cpu_ffi.wanted_mode(ENV, MODES, DEFAULT_MODE, env, cpu_only)
  if mode is None:
    return False
  if mode == "auto" and (vendor := cpu_vendor()) is not None and vendor not in AUTO_VENDORS:
    try:
      _lib(MKL_LIB, MKL_PACKAGE)
    except NotInstalled:
      return False  # nothing installed: XLA's dots, silently (the plain default)
    if log:
      log(f"CPU matmuls: XLA's own (MKL is installed, but on {vendor} CPUs it made the step no faster; "
          f"${ENV}=mkl to use it; see remixer_t5/cpu_blas.py)")
    return False
  reasons = []
  for backend in (BACKENDS if mode == "auto" else (mode,)):
    try:
      info = load(backend, env, log)
      break
    except Unavailable as e:
      if mode != "auto":
        raise ValueError(f"${ENV}={mode}: {e}") from None
      if not isinstance(e, NotInstalled):  # installed but unusable: say why
        reasons.append(f"{backend}: {e}")
  else:
    if log and reasons:
      log(f"CPU matmuls: XLA's own ({'; '.join(reasons)}); see remixer_t5/cpu_blas.py")
    return False
  applied = True
  if log:
    log(f"CPU matmuls: {info['description']}, {info['threads']} threads (remixer_t5/cpu_blas.py; "
        f"${ENV}=off for XLA's)")
  return True


def describe() -> str | None:
  """What Dense's products run on, for benchmark rows: None for XLA's own."""
  if not applied:
    return None
  if not _loaded:  # a caller's own `route` (scripts/bench_step_blas.py's rows say which in `blas`)
    return "the caller's own sgemm route, via FFI"
  return f"{_loaded['description']}, {_loaded['threads']} threads, via FFI"


def _gemm(a, b, transpose_a: bool, transpose_b: bool, target: str):
  """op(a) @ op(b): the registered sgemm `target` on CPU, XLA's dot on any other platform."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  m = a.shape[1] if transpose_a else a.shape[0]
  n = b.shape[0] if transpose_b else b.shape[1]

  def blas(a, b):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential")
    return call(a, b, transpose_a=np.int64(transpose_a), transpose_b=np.int64(transpose_b))

  def xla(a, b):
    return jnp.dot(a.T if transpose_a else a, b.T if transpose_b else b)

  return jax.lax.platform_dependent(a, b, cpu=blas, default=xla)


def make_matmul(target: str = TARGET, on_trace: Callable[[], None] | None = None):
  """x [M, K] @ w [K, N] through the custom call `target`, its VJP through the same call; `on_trace` is called
  for each call traced into a program (scripts/bench_step_blas.py counts them)."""
  import jax

  def gemm(a, b, transpose_a, transpose_b):
    if on_trace is not None:
      on_trace()
    return _gemm(a, b, transpose_a, transpose_b, target)

  @jax.custom_vjp
  def blas_matmul(x, w):
    return gemm(x, w, False, False)

  def fwd(x, w):
    return gemm(x, w, False, False), (x, w)

  def bwd(residuals, g):
    x, w = residuals
    return gemm(g, w, False, True), gemm(x, g, True, False)  # dX = dY W^T, dW = X^T dY

  blas_matmul.defvjp(fwd, bwd)
  return blas_matmul


route = None  # the product `matmul` uses once applied: make_matmul() by default (the script sets its own)


def matmul(x, w):
  """x [M, K] @ w [K, N]: through the configured sgemm for float32 operands in a one-device process (module
  docstring), else `jnp.dot`; `jnp.dot` too inside `flop_count.counting_model_flops()`, whose FLOP count cannot
  see into a custom call."""
  global route
  import jax
  import jax.numpy as jnp
  if not (applied and not flop_count.counting() and x.ndim == 2 and w.ndim == 2 and x.dtype == jnp.float32
          and w.dtype == jnp.float32 and 2 * x.shape[0] * x.shape[1] * w.shape[1] >= MIN_FLOPS
          and jax.device_count() == 1):
    return jnp.dot(x, w)
  if route is None:
    route = make_matmul()
  return route(x, w)
