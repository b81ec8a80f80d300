"""scripts/bench_gemm_rates.py: the GEMM-rate table of docs/benchmarks.md (XLA:CPU against PyTorch and numpy)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_gemm_rates.py"


def run(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)


def test_one_row_per_library_and_shape_with_its_rate(monkeypatch):
  proc = run("--repeats", "1", "--xla_flags=", "--tag", "t1")
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  monkeypatch.syspath_prepend(str(REPO / "scripts"))
  import bench_gemm_rates
  libs = {r["lib"] for r in rows}
  assert {"xla", "numpy"} <= libs  # torch only with the .[hf] extra
  assert len(rows) == len(libs) * len(bench_gemm_rates.SHAPES)
  for r in rows:
    m, k, n = r["shape"]
    assert r["gflops"] == pytest.approx(2 * m * k * n / (r["ms"] / 1e3) / 1e9, rel=0.05)  # ms rounded
    assert r["cores_busy"] > 0 and r["cpu"] and r["tag"] == "t1"
    assert r["version"].startswith({"xla": "jaxlib ", "numpy": "numpy ", "torch": "torch "}[r["lib"]])
    assert r["commit"]  # a checkout: the row says which code it timed
    assert (r["xla_flags"] == "") == (r["lib"] == "xla")  # the flags the XLA lines ran under, recorded


def test_bad_repeats_is_refused():
  proc = run("--repeats", "0")
  assert proc.returncode == 2 and "--repeats 0: expected at least 1" in proc.stderr
