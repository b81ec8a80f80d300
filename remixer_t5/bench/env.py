"""The machine and software a benchmark row was measured with (`bench train`, `bench decode`).

A CPU figure means little without what decided it: the CPU model and its vector extensions (AVX-512, AMX:
which kernels XLA and PyTorch pick), the cores usable, the XLA flags in force, what HyperMixing's CPU kernels
ran (`cpu_hypermixing`: the fused C++ loops, or None when no program used them), what dropout's CPU mask ran
(`cpu_threefry`), the host allocator policy, the thread counts PyTorch and OpenMP/MKL use, the load average
around the measurement, the commit, and the versions. `environment()` gathers them into the row.

And whether each side flushes subnormal floats to zero. XLA:CPU runs its kernels with flush-to-zero and
denormals-are-zero set; PyTorch by default does not, and on Intel CPUs an operation on a subnormal float is
very slow. A T5 train step with Adafactor makes subnormals within a few steps, so the references run with
`torch.set_flush_denormal(True)` (`set_torch_flush_denormal`) unless asked not to, and the row records what
each side actually does (`denormals_flushed`, a computation, not a setting).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import jax
import numpy as np

from remixer_t5 import runtime
from remixer_t5.kernels.cpu import hypermixing as cpu_hypermixing, threefry as cpu_threefry

# Vector/matrix extensions that change which CPU kernels run (a subset of /proc/cpuinfo's flags).
CPU_FLAGS_OF_INTEREST = (
  "avx2",
  "fma",
  "avx512f",
  "avx512bw",
  "avx512_vnni",
  "avx512_bf16",
  "avx512_fp16",
  "amx_tile",
  "amx_bf16",
  "amx_int8",
)
THREAD_ENV = (
  "OMP_NUM_THREADS",
  "MKL_NUM_THREADS",
  "OPENBLAS_NUM_THREADS",
  "TF_NUM_INTEROP_THREADS",
  "TF_NUM_INTRAOP_THREADS",
)


def loadavg() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:  # pragma: no cover - platforms without it
    return None


def _cpuinfo() -> dict[str, str]:
  out: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if (
          key in ("model name", "flags", "cache size", "vendor_id", "cpu family", "model", "stepping")
          and key not in out
        ):
          out[key] = value.strip()
  except OSError:
    pass
  return out


def cpu_model() -> str:
  return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def git_commit() -> str | None:
  """HEAD of the checkout this package runs from, '+dirty' when tracked files differ; None outside git."""
  root = Path(__file__).resolve().parent.parent
  try:
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    if head.returncode:
      return None
    dirty = subprocess.run(
      ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
      capture_output=True,
      text=True,
      timeout=30,
    ).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return None


def set_torch_flush_denormal(flush: bool) -> None:
  """PyTorch's flush-to-zero/denormals-are-zero mode (XLA:CPU's is always on; module docstring). The mode is per
  thread and a new thread copies its creator's, so this must run before PyTorch's first parallel operation starts
  its intra-op threads: those started earlier keep their mode (`denormals_flushed` then says False). ValueError
  where this CPU or build has no such mode and `flush` is asked for."""
  import torch

  if not torch.set_flush_denormal(flush) and flush:
    raise ValueError(
      "torch.set_flush_denormal(True) is not supported by this CPU or PyTorch build; run the HF "
      "reference with --hf_denormals=keep"
    )


DENORMAL_PROBE = 1 << 22  # elements: enough that the sum runs on every thread of the pool, not the caller's only


def denormals_flushed(side: str) -> bool:
  """Whether `side` ('xla' or 'torch') computes 1e-39 + 1e-39 (a float32 subnormal) as 0 on every thread it
  uses in this process: the sum of DENORMAL_PROBE such values, all of which must come out 0."""
  tiny = np.full((DENORMAL_PROBE,), 1e-39, np.float32)
  if side == "xla":
    return bool((np.asarray(jax.jit(lambda a: a + a)(tiny)) == 0).all())
  if side == "torch":
    import torch

    t = torch.from_numpy(tiny)
    return bool(((t + t) == 0).all().item())
  raise ValueError(f"denormals_flushed: side {side!r}, expected 'xla' or 'torch'")


def transparent_hugepages() -> str | None:
  """The kernel's transparent huge page mode ('always', 'madvise' or 'never'), or None off Linux. With 'always' a
  freshly mapped buffer faults in 2 MiB pages (512x fewer faults), which changes what an unmapped-and-remapped
  scratch costs a step (runtime.py)."""
  try:
    text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
  except OSError:
    return None
  chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
  return chosen[0] if chosen else None


def environment(with_torch: bool = False) -> dict[str, Any]:
  """The row's record of the machine, flags, threads, commit and versions (module docstring)."""
  info = _cpuinfo()
  # cpu_id: cloud machines often name themselves only "Intel(R) Xeon(R) Processor" or "AMD EPYC"; the family and
  # model tell the generation (Intel family 6 model 143 Sapphire Rapids, 207 Emerald Rapids; AMD family 25 Zen 3/4,
  # 26 Zen 5).
  cpu_id = (
    f"{info.get('vendor_id', '?')} family {info['cpu family']} model {info['model']} stepping "
    f"{info.get('stepping', '?')}"
    if "cpu family" in info and "model" in info
    else None
  )
  env: dict[str, Any] = {
    "cpu_model": cpu_model(),
    "cpu_id": cpu_id,
    "cpu_flags": [f for f in CPU_FLAGS_OF_INTEREST if f in info.get("flags", "").split()],
    "cpu_cache": info.get("cache size"),
    "cpu_count": os.cpu_count(),
    "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "cpu_hypermixing": cpu_hypermixing.describe(),
    "cpu_threefry": cpu_threefry.describe(),
    "host_malloc_policy": runtime.applied,
    "transparent_hugepages": transparent_hugepages(),
    "thread_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    "git_commit": git_commit(),
    "jax_version": jax.__version__,
  }
  if jax.default_backend() == "cpu":
    env["xla_denormals_flushed"] = denormals_flushed("xla")
  try:
    env["jaxlib_version"] = md.version("jaxlib")
  except md.PackageNotFoundError:  # pragma: no cover
    env["jaxlib_version"] = None
  if with_torch:
    env.update(torch_environment())
  return env


def torch_environment() -> dict[str, Any]:
  """PyTorch's side of a row, measured in this process: thread counts, versions, subnormal mode."""
  import torch
  import transformers

  return {
    "torch_num_threads": torch.get_num_threads(),
    "torch_num_interop_threads": torch.get_num_interop_threads(),
    "torch_version": torch.__version__,
    "transformers_version": transformers.__version__,
    "torch_denormals_flushed": denormals_flushed("torch"),
  }
