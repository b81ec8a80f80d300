"""Running Python code in a fresh one-device CPU process (imported by the test modules beside it): custom calls
are registered once per process, and the suite's own processes have 8 host devices."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_py(code: str, env_extra: dict, timeout=600):
  """`code` in `python -c` from the repository root, JAX on CPU, $XLA_FLAGS only as env_extra gives it."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
  env.pop("XLA_FLAGS", None)
  env.update({k: v for k, v in env_extra.items() if k == "XLA_FLAGS"})
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                        timeout=timeout, env=env, cwd=REPO)
