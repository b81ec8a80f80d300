"""`remixer-t5 bench kernels`: each kernel against plain JAX on the work it exists for, variants in one process;
`remixer-t5 bench drift`: a kernel's training against the reference's, step by step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_cogs_step_variants_compile_run_and_agree(tmp_path):
  """T5.1.1's COGS step with every field `auto`, every field `xla` and each alone: one row per variant and round,
  a summary line, and last losses that agree (the kernels compute the same function, up to XLA's fusion order)."""
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "remixer_t5.cli",
      "bench",
      "kernels",
      "--workloads",
      "cogs:t5_1_1",
      "--rounds",
      "1",
      "--steps",
      "1",
      "--warmup",
      "0",
      "--json",
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=REPO,
    env={**os.environ, "REMIXER_T5_CACHE_DIR": str(tmp_path)},
  )
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
  by = {r["variant"]: r for r in rows}
  assert set(by) == {"default", "xla", "attention=xla", "dropout=xla"}
  assert all(r["workload"] == "cogs:t5_1_1" and r["s_per_step"] > 0 and r["git_commit"] for r in rows)
  losses = [r["last_loss_sum"] for r in rows]
  assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
  assert "# cogs:t5_1_1: default" in p.stderr


@pytest.mark.integration
def test_bench_drift_tells_rounding_from_a_fault():
  """`remixer-t5 bench drift` on HyperMixer's COGS step: a row per step, and one step of the C++ HyperMixing
  loops from the reference's state within float32 rounding of XLA's (a fault would show here, whatever the
  trajectories do)."""
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "remixer_t5.cli",
      "bench",
      "drift",
      "--workloads",
      "cogs:hypermixer",
      "--field",
      "hypermixing",
      "--steps",
      "3",
      "--json",
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=REPO,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
  assert [r["step"] for r in rows] == [1, 2, 3] and "env" in rows[0]
  assert all(0 < r["one_step_rel_diff"] < 1e-4 for r in rows)  # computed by different code, and agreeing
  assert rows[0]["trajectory_rel_diff"] == rows[0]["one_step_rel_diff"]  # the same state before step 1
  assert abs(rows[0]["loss_sum_default"] - rows[0]["loss_sum_xla"]) <= 1e-5 * rows[0]["loss_sum_xla"]


def test_bench_drift_refuses_a_bad_field_and_flags_of_other_kinds(capsys):
  from remixer_t5 import cli

  assert cli.main(["bench", "drift", "--field", "nope", "--steps", "1"]) == 2
  assert "expected one of ['attention', 'dropout', 'hypermixing']" in capsys.readouterr().err
  with pytest.raises(SystemExit) as usage:  # another kind's flag: argparse's usage error
    cli.main(["bench", "drift", "--rounds", "2"])
  assert usage.value.code == 2 and "unrecognized arguments: --rounds 2" in capsys.readouterr().err
