"""scripts/bench_step_blas.py: our step with layers.Dense's products through an external BLAS (an experiment whose
result docs/benchmarks.md records). Needs a C++ compiler; skips without one."""
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_step_blas.py"


def run(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env)


def _numpy_openblas() -> bool:
  import glob

  import numpy as np
  root = Path(np.__file__).resolve().parent
  return bool(glob.glob(str(root.parent / "numpy.libs" / "libscipy_openblas64_*"))
              + glob.glob(str(root / ".dylibs" / "libscipy_openblas64_*")))


@pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")),
                    reason="no C++ compiler to build remixer_t5/csrc/cpu_sgemm.cc")
@pytest.mark.integration
@pytest.mark.skipif(not _numpy_openblas(), reason="this numpy carries no scipy-openblas64 library")
def test_openblas_in_the_step_matches_xla_and_is_timed():
  proc = run("--config", "tiny", "--variants", "xla,openblas-pool", "--rounds", "1", "--steps", "2", "--warmup", "1",
             "--tag", "t")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["variant"]: r for r in map(json.loads, (x for x in proc.stdout.splitlines() if x.startswith("{")))}
  assert set(rows) == {"xla", "openblas-pool"}
  blas = rows["openblas-pool"]
  # The custom call's product and both gradients against XLA's jnp.dot: float32 rounding, not a wrong product.
  assert blas["check_rel_err"] < 1e-5
  assert "OpenBLAS" in blas["blas"] and blas["threads_per_call"] == "blocks on XLA's pool"
  # The timed step holds the custom calls: three per Dense (product, dX, dW) of the tiny T5's 9+ Dense layers.
  assert blas["custom_calls_in_step"] >= 27 and "custom_calls_in_step" not in rows["xla"]
  for r in rows.values():
    assert r["config"] == "tiny" and r["steps"] == 2 and len(r["times"]) == 2 and r["tag"] == "t"
    assert r["step_s"] == pytest.approx(statistics.median(r["times"]), abs=1e-3)
    assert r["git_commit"] and r["cpu_model"] and "ynn" in r["xla_flags"]  # what decides the result, recorded
    assert len(r["load_average_start"]) == 3 and len(r["load_average_end"]) == 3
  assert "# openblas-pool: median" in proc.stderr and "x xla" in proc.stderr


def test_bad_variant_and_counts_are_refused():
  proc = run("--variants", "xla,cublas")
  assert proc.returncode == 2 and "unknown ['cublas']" in proc.stderr
  proc = run("--variants", "xla,xla")
  assert proc.returncode == 2 and "or repeated" in proc.stderr
  proc = run("--rounds", "0")
  assert proc.returncode == 2 and "--rounds 0: expected at least 1" in proc.stderr
