"""XLA:CPU compiler options for CPU-only runs: every dot through YNNPACK, no transposed copies for the backward.

By default XLA:CPU (jaxlib 0.10.2) sends a dot to YNNPACK only when it is part of a library fusion; a plain dot
goes to Eigen, and layout assignment then materialises a transposed copy of one operand for most
weight-gradient dots (`dW = X^T dY`). In a T5 train step those copies are fused into the elementwise backward
passes that feed them (the gated-GELU MLP's gradient, the loss gradient before the output layer's dW), which
then write their [d_ff, tokens] / [vocab, tokens] results column by column. Per-op profiles of config A in
docs/benchmarks.md (d 256, 4+4 layers, batch 16, 128/32, float32) show those fusions taking ~20% of the step.
`--xla_cpu_experimental_ynn_fusion_type=+individual_dot` also routes individual dots to YNNPACK, which takes
transposed operands as they are: config A's step ran ~20% faster (6.3-6.5 s -> 5.1 s under the same machine
load); T5.1.1-small at 512/114 (config B) showed no difference within the noise (9.9-10.1 s against 9.9-10.5 s).
On a 2-core Zen 3 EPYC (AVX2, no AVX-512) the flag changes nothing: the optimised HLO is the same, the
weight-gradient dots stay Eigen dots. `layers.Dense` now avoids the copies on any CPU by multiplying 2-D
`[tokens, features]` arrays (docs/benchmarks.md, 2026-11-25).

`configure()` is called by the CLI before JAX starts its backend (XLA reads $XLA_FLAGS once). It acts only when
JAX will run on CPU alone, the jaxlib is one where the flag is known to exist (an unknown flag in $XLA_FLAGS
aborts the process), and $XLA_FLAGS does not already set it; `$REMIXER_T5_XLA_CPU` = `auto` (default), `on`
or `off` overrides that. TPU/GPU runs never see the flag.
"""
from __future__ import annotations

import os
from typing import Callable, MutableMapping

ENV = "REMIXER_T5_XLA_CPU"
FLAG_NAME = "--xla_cpu_experimental_ynn_fusion_type"
FLAG = f"{FLAG_NAME}=+individual_dot"
KNOWN_JAXLIB_PREFIXES = ("0.10.",)  # jaxlib versions whose XLA:CPU has the flag (checked: 0.10.2)
applied = False  # set by configure(); benchmark rows record it


def _jaxlib_version() -> str:
  import importlib.metadata
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return ""


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


def configure(log: Callable[[str], None] | None = None, environ: MutableMapping[str, str] | None = None,
              cpu_only: bool | None = None, jaxlib_version: str | None = None) -> bool:
  """Adds FLAG to $XLA_FLAGS when wanted (module docstring); returns whether it did. The keyword arguments are
  for tests (default: os.environ, host_memory.jax_runs_on_cpu_only(), the installed jaxlib)."""
  global applied
  env = os.environ if environ is None else environ
  mode = env.get(ENV, "auto").strip().lower() or "auto"
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"${ENV}={env[ENV]!r}: expected 'auto', 'on' or 'off'")
  if mode == "off":
    return False
  flags = env.get("XLA_FLAGS", "")
  if FLAG_NAME in flags:  # the user's own setting wins
    return False
  version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
  if mode == "auto":
    if cpu_only is None:
      from remixer_t5 import host_memory
      cpu_only = host_memory.jax_runs_on_cpu_only()
    if not cpu_only or not version.startswith(KNOWN_JAXLIB_PREFIXES):
      return False
  env["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
  applied = True
  if log:
    log(f"XLA:CPU: {FLAG} (all dots through YNNPACK; see remixer_t5/xla_cpu.py); ${ENV}=off to leave XLA_FLAGS "
        "alone")
  return True
