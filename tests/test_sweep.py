"""`remixer-t5 sweep`: a grid of gin settings at each seed, a train MODEL_DIR per point, resumable through its
manifest, summarised over seeds; HyperMixer's two-stage protocol as docs/reproducing.md runs it (this file runs
that command); the per-point commands for launch/; submitit's local executor running the same path."""

import csv
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from remixer_t5 import cli, sweep
from remixer_t5.training import metrics_log

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reproducing.md"


def _docs_command(out: Path) -> list[str]:
  """The study's command in docs/reproducing.md, with its --out moved to `out`."""
  text = DOCS.read_text().split("## A study: HyperMixer's protocol", 1)[1]
  block = re.search(r"```\n(remixer-t5 sweep .*?)```", text, re.S).group(1)
  argv = shlex.split(block.replace("\\\n", " "))[1:]
  return [f"--out={out}" if a == "/tmp/study" else a for a in argv if a != "--out"] if "--out" in argv else argv


def _best_validation_loss(folder: Path) -> float:
  rows = metrics_log.current_rows(metrics_log.read_rows(folder / "metrics.jsonl"))
  return min(r["loss"] for r in rows if r["split"] == "validation")


def test_the_documented_study_runs_hypermixers_protocol_and_a_rerun_trains_nothing(
  tmp_path, embedded_cache, monkeypatch, capsys
):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  out = tmp_path / "study"
  argv = _docs_command(out)
  assert cli.main(argv) == 0
  said = capsys.readouterr().out
  lr = "optim.rsqrt_schedule.base_learning_rate"
  # Stage 1: both rates at seed 0; the better by validation loss (read here from each run's own rows).
  stage1 = {v: _best_validation_loss(out / f"base_learning_rate={v},seed=0") for v in ("0.3", "1.0")}
  chosen = min(stage1, key=stage1.get)
  assert f"best {lr} for the model: {chosen} by validation/loss:min" in said
  other = "1.0" if chosen == "0.3" else "0.3"
  assert not (out / f"base_learning_rate={other},seed=1").exists()  # stage 2 runs the chosen rate only
  # The table: n, mean and sample std over the three seeds of the chosen rate equal the runs' logged losses.
  losses = [_best_validation_loss(out / f"base_learning_rate={chosen},seed={s}") for s in (0, 1, 2)]
  with open(out / "sweep.csv") as f:
    rows = {r[lr]: r for r in csv.DictReader(f)}
  assert set(rows) == {chosen} and int(rows[chosen]["n"]) == 3
  assert float(rows[chosen]["validation/loss_mean"]) == pytest.approx(np.mean(losses), rel=1e-12)
  assert float(rows[chosen]["validation/loss_std"]) == pytest.approx(np.std(losses, ddof=1), rel=1e-9)
  assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  manifest = json.loads((out / sweep.MANIFEST).read_text())
  assert len(manifest["points"]) == 4 and {p["state"] for p in manifest["points"].values()} == {"done"}
  # The same command again: nothing trains.
  before = {p: p.read_bytes() for p in out.glob("*/metrics.jsonl")}
  assert cli.main(argv) == 0
  again = capsys.readouterr().out
  assert "started" not in again and "already done: skipped" in again
  assert {p: p.read_bytes() for p in out.glob("*/metrics.jsonl")} == before


def test_another_sweep_into_the_same_folder_is_refused(tmp_path):
  sweep.Manifest(tmp_path, {"grid": [["A", ["1"]]], "seeds": [0]}).set(sweep.Point((("A", "1"),), 0), state="done")
  with pytest.raises(ValueError, match=r"holds another sweep \(its seeds differ"):
    sweep.Manifest(tmp_path, {"grid": [["A", ["1"]]], "seeds": [0, 1]})


def test_print_commands_gives_each_points_train_command(tmp_path, capsys):
  argv = [
    "sweep",
    "--gin_file=models/t5_1_1/tiny.gin",
    "--gin_file=runs/demo.gin",
    "--grid",
    "optim.rsqrt_schedule.base_learning_rate=0.5,1.0",
    "--grid",
    "BATCH_SIZE=2,4",
    "--seeds",
    "3,4",
    f"--out={tmp_path}",
    "--print_commands",
  ]
  assert cli.main(argv) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 8 and all(
    line.startswith("remixer-t5 train --gin_file=models/t5_1_1/tiny.gin") for line in lines
  )
  assert any(
    "--gin.optim.rsqrt_schedule.base_learning_rate=1.0 --gin.BATCH_SIZE=4 --gin.RANDOM_SEED=3" in line
    and f"base_learning_rate=1.0,BATCH_SIZE=4,seed=3" in line
    for line in lines
  )
  assert not list(tmp_path.iterdir())  # nothing run, nothing written


@pytest.mark.parametrize(
  "items, word",
  [
    (["lr"], "expected NAME=V1,V2"),
    (["lr="], "expected NAME=V1,V2"),
    (["A=1", "A=2"], "given twice"),
    (["RANDOM_SEED=1,2"], "seeds are --seeds"),
    (["1x=2"], "expected NAME=V1,V2"),
  ],
)
def test_bad_grids_are_one_line(items, word):
  with pytest.raises(ValueError, match=word):
    sweep.parse_grid(items)


def test_grid_values_keep_their_brackets_and_points_span_the_product():
  grid = sweep.parse_grid(["TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 4},{'inputs': 16, 'targets': 8}", "B=1,2"])
  assert grid[0][1] == ["{'inputs': 8, 'targets': 4}", "{'inputs': 16, 'targets': 8}"]
  pts = sweep.points(grid, [0, 1])
  assert len(pts) == 8 and len({p.name for p in pts}) == 8
  with pytest.raises(ValueError, match="expected distinct integers"):
    sweep.parse_seeds("0,0")


@pytest.mark.integration
def test_two_rates_by_three_seeds_in_two_jobs_and_submitits_local_executor(tmp_path, embedded_cache, monkeypatch):
  """The issue's target at full width (6 points, --jobs 2), and one point through submitit's local executor."""
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  base = [a for a in _docs_command(tmp_path / "x") if not a.startswith(("--out", "--tune", "--select"))]
  base = [a for a in base if a not in ("optim.rsqrt_schedule.base_learning_rate", "validation/loss:min")]
  out = tmp_path / "grid"
  assert cli.main([*base, f"--out={out}"]) == 0
  with open(out / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    v = row["optim.rsqrt_schedule.base_learning_rate"]
    losses = [_best_validation_loss(out / f"base_learning_rate={v},seed={s}") for s in (0, 1, 2)]
    assert float(row["validation/loss_mean"]) == pytest.approx(np.mean(losses))
    assert float(row["validation/loss_std"]) == pytest.approx(np.std(losses, ddof=1))
  one = [a for a in base if not a.startswith("--seeds") and a != "0,1,2"]
  one = [a if not a.startswith("optim.rsqrt") else "optim.rsqrt_schedule.base_learning_rate=1.0" for a in one]
  assert cli.main([*one, "--seeds", "0", "--executor", "submitit_local", f"--out={tmp_path / 'sub'}"]) == 0
  assert (tmp_path / "sub" / "sweep.csv").exists()


def test_a_sweeps_points_share_a_tracking_group(monkeypatch):
  monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
  assert sweep._child_env("lr_study", "0")["WANDB_RUN_GROUP"] == "lr_study"
  monkeypatch.setenv("WANDB_RUN_GROUP", "mine")
  assert sweep._child_env("lr_study", None)["WANDB_RUN_GROUP"] == "mine"  # the user's own group wins
