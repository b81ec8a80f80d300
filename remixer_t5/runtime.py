"""The process's runtime before JAX starts: which platform JAX will use (decided without starting a backend), the
cores it runs on (`pin_from_env`), and the host allocator policy for CPU runs (`configure`): keep XLA's large
scratch buffers on the heap between steps.

XLA:CPU allocates a compiled function's scratch (activations and gradients) with malloc on every call. glibc
serves a request above its mmap threshold (adaptive, at most 32 MiB) with a fresh mmap and unmaps it on free,
so every step page-faults the whole buffer in again, zeroing it a 4 KiB page at a time in system time. The
policy turns glibc's mmap chunks off (every request comes from the heap, whatever its size: mallopt's mmap
threshold is an int, so a threshold cannot cover a scratch above 2 GiB), never trims the heap, and uses one
arena so buffers beyond a thread arena's 64 MiB heap limit live there too; databases with the same pattern
(ClickHouse) keep large buffers on the heap the same way. The cost is resident memory: the heap keeps its peak
(XLA frees a step's buffers asynchronously, so a few steps' scratch) until the process ends.

`configure()` is called by the CLI before JAX starts its thread pools (an arena limit only binds threads that
have not allocated yet). It acts only when JAX will run on CPU alone and the C library is glibc;
`$REMIXER_T5_HOST_MALLOC` = `auto` (default), `on` or `off` overrides that. Python users who time CPU code
outside the CLI can call it first themselves.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import importlib.util
import os
from typing import Callable, MutableMapping

ENV = "REMIXER_T5_HOST_MALLOC"
# mallopt parameters from glibc's <malloc.h>, and the policy's values: no mmap chunks, no trimming, one arena.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_ARENA_MAX, 1))
_ACCELERATOR_MODULES = ("libtpu",)  # TPU support is a plain module; GPU and others are jax_plugins
# TPU chips as a TPU VM exposes them (v2-v4: /dev/accel<N>; v5e and later: VFIO groups). libtpu installed on a
# machine without them (`pip install -e '.[tpu]'` for `remixer-t5 compile`) leaves JAX on the CPU.
_TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
applied = False  # set by configure(); benchmark rows record it


def jax_runs_on_cpu_only() -> bool:
  """Whether JAX will pick the CPU backend, decided without starting any backend.

  JAX_PLATFORMS (or jax.config's jax_platforms) decides when set; otherwise JAX uses an accelerator when one's
  support is installed (libtpu on a machine with TPU chips, or a `jax_plugins` package such as
  jax_cuda12_plugin), so none installed means CPU. libtpu without TPU chips (installed only to compile for a
  TPU topology, `remixer-t5 compile`) still means CPU."""
  import jax

  platforms = (jax.config.jax_platforms or "").strip()
  if platforms:
    return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
  if _libtpu_installed() and tpu_chips_present():
    return False
  if importlib.metadata.entry_points(group="jax_plugins"):
    return False
  try:
    import jax_plugins  # a namespace package holding the accelerator plugins, when any are installed

    return not list(getattr(jax_plugins, "__path__", []))
  except ImportError:
    return True


def _libtpu_installed() -> bool:
  return any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_MODULES)


def tpu_chips_present() -> bool:
  """Whether the host exposes TPU chips (device files only; no backend is started)."""
  return any(glob.glob(pattern) for pattern in _TPU_DEVICE_GLOBS)


def pin_cpu_without_tpu_chips() -> bool:
  """On a machine with libtpu installed but no TPU chips and no other accelerator plugin (libtpu only to compile
  for TPU topologies: `pip install -e '.[tpu]'`), set jax_platforms to 'cpu' so JAX does not try to start a TPU
  runtime first (libtpu prints start-up errors, then JAX falls back to the CPU). Compiling for a TPU topology
  works with the CPU platform. Does nothing when JAX_PLATFORMS is set; returns whether it pinned."""
  import jax

  # No libtpu: JAX never tries a TPU runtime. TPU chips, or a GPU (or other) plugin: JAX's choice stands.
  if (jax.config.jax_platforms or "").strip() or not _libtpu_installed() or not jax_runs_on_cpu_only():
    return False
  jax.config.update("jax_platforms", "cpu")
  return True


CPUS_ENV = "REMIXER_T5_CPUS"


def pin_from_env(environ: MutableMapping[str, str] | None = None) -> list[int] | None:
  """Pins this process to the cores listed in $REMIXER_T5_CPUS (e.g. '0,1'; `repro cogs --jobs` sets it for
  each run) and returns them; None when it is unset or empty. Call it before anything starts a thread pool:
  XLA's, TensorFlow's and OpenBLAS's size themselves to the cores the process may use, and threads made
  before the call would keep every core. ValueError naming the variable for a bad list, or where cores cannot
  be pinned (no sched_setaffinity, e.g. macOS)."""
  env = os.environ if environ is None else environ
  text = env.get(CPUS_ENV, "").strip()
  if not text:
    return None
  try:
    cpus = sorted({int(c) for c in text.split(",") if c.strip()})
  except ValueError:
    raise ValueError(f"${CPUS_ENV}={text!r}: expected comma-separated core numbers, e.g. '0,1'") from None
  if not hasattr(os, "sched_setaffinity"):
    raise ValueError(f"${CPUS_ENV}={text!r}: this platform cannot pin a process to cores; unset it")
  allowed = os.sched_getaffinity(0)
  if not cpus or not set(cpus) <= allowed:
    raise ValueError(f"${CPUS_ENV}={text!r}: this process may use cores {sorted(allowed)}")
  os.sched_setaffinity(0, cpus)
  return cpus


def _glibc() -> ctypes.CDLL | None:
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl and macOS's libc have no mallopt knobs)
    libc.mallopt  # noqa: B018
    return libc
  except (OSError, AttributeError):
    return None


def configure(log: Callable[[str], None] | None = None, verbose: bool = False) -> bool:
  """Applies the policy when it is wanted (see the module docstring); returns whether it was applied."""
  global applied
  mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"${ENV}={os.environ[ENV]!r}: expected 'auto', 'on' or 'off'")
  if mode == "off" or (mode == "auto" and not jax_runs_on_cpu_only()):
    return False
  libc = _glibc()
  if libc is None:
    if mode == "on" and log:  # asked for and not applied: always said
      log(f"${ENV}=on: not applied, the C library is not glibc")
    return False
  libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  ok = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
  applied = applied or ok
  if log and (verbose or not ok):  # a refused setting is always said
    log(
      "host allocator: XLA scratch kept on the heap between steps (glibc: no mmap chunks, no trimming, "
      f"one arena){'' if ok else ' -- glibc refused a setting'}; ${ENV}=off to leave malloc alone"
    )
  return ok
