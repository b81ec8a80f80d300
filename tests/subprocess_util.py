"""Running Python code in a fresh one-device CPU process (imported by the test modules beside it): custom calls
are registered once per process, and the suite's own processes have 8 host devices."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The suite's own XLA flags (tests/conftest.py sets them, LLVM at -O0 and XLA:CPU's elemental emitter, and adds them
# to $XLA_FLAGS).
TEST_XLA_FLAGS_ENV = "REMIXER_T5_TEST_XLA_FLAGS"


def xla_flags(*flags: str) -> str:
  """$XLA_FLAGS for a child process: the suite's own ($REMIXER_T5_TEST_XLA_FLAGS, set by tests/conftest.py:
  LLVM at -O0, the elemental emitter) and `flags`, and nothing else of this process's."""
  return " ".join([os.environ.get(TEST_XLA_FLAGS_ENV, ""), *flags]).strip()


def run_py(code: str, env_extra: dict, timeout=600):
  """`code` in `python -c` from the repository root, JAX on CPU, $XLA_FLAGS only the suite's (xla_flags) and
  what env_extra gives."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
  env["XLA_FLAGS"] = xla_flags(env_extra.get("XLA_FLAGS", ""))
  return subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
  )
