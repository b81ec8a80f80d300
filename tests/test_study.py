"""remixer_t5.study: the statistics over seeds against scipy.stats on fixed numbers, a study's grouping, best
points and HyperMixer's mark on hand-built points, its files, and `compare --group_by_seed` over run folders
written by hand (no training)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from scipy import stats

from remixer_t5 import cli, compare, study

LOSSES = [4.21, 4.35, 4.02, 4.48, 4.30]
OTHER = [4.61, 4.44, 4.90, 4.52, 4.70, 4.58, 4.66]


def _scipy_interval(values):
  x = np.asarray(values)
  return stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))


# --- describe, welch, the t quantile ------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [LOSSES, OTHER, [0.5, 0.75], [1e-3, 2e-3, 1.5e-3]])
def test_describe_matches_scipy(values):
  got = study.describe(values)
  ref = stats.describe(values)
  assert got["n"] == ref.nobs
  assert got["mean"] == pytest.approx(ref.mean, rel=1e-12)
  assert got["std"] == pytest.approx(np.sqrt(ref.variance), rel=1e-12)  # scipy's variance is the sample one
  low, high = _scipy_interval(values)
  assert (got["ci95_low"], got["ci95_high"]) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))


def test_t_quantiles_are_the_printed_table_values():
  # Two-sided 95% critical values of Student's t, as printed in any statistics table.
  for df, value in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045)):
    assert study.t_quantile(0.975, df) == pytest.approx(value, abs=5e-4)


def test_describe_of_one_and_of_no_value():
  assert study.describe([3.5]) == {"n": 1, "mean": 3.5, "std": None, "ci95_low": None, "ci95_high": None}
  assert study.describe([]) == {"n": 0, "mean": None, "std": None, "ci95_low": None, "ci95_high": None}
  # Equal values: no spread, an interval of width zero.
  assert study.describe([2.0, 2.0, 2.0]) == {"n": 3, "mean": 2.0, "std": 0.0, "ci95_low": 2.0, "ci95_high": 2.0}
  with pytest.raises(ValueError, match=r"^describe: value 1 is nan; expected finite numbers$"):
    study.describe([1.0, float("nan")])


@pytest.mark.parametrize(
  "a, b", [(LOSSES, OTHER), (OTHER, LOSSES), ([1.0, 2.0], [1.5, 1.7, 1.9, 2.4]), ([0.1, 0.2, 0.3], [0.0, 0.2, 0.4])]
)  # the last: equal means
def test_welch_matches_scipy(a, b):
  got = study.welch(a, b)
  ref = stats.ttest_ind(a, b, equal_var=False)
  assert got["t"] == pytest.approx(ref.statistic, rel=1e-12, abs=1e-12)
  assert got["df"] == pytest.approx(ref.df, rel=1e-12)
  assert got["p"] == pytest.approx(ref.pvalue, rel=1e-10)


def test_welch_equal_means_and_undefined_cases():
  got = study.welch([0.1, 0.2, 0.3], [0.0, 0.2, 0.4])
  assert got["t"] == pytest.approx(0.0, abs=1e-12) and got["p"] == pytest.approx(1.0)
  # scipy answers nan for one value on a side; the module says the test is undefined.
  assert np.isnan(stats.ttest_ind([1.0, 2.0], [3.0], equal_var=False).statistic)
  assert study.welch([1.0, 2.0], [3.0]) == {"t": None, "df": None, "p": None}
  assert study.welch([1.0, 1.0], [2.0, 2.0]) == {"t": None, "df": None, "p": None}


def test_hypermixer_mark_on_the_papers_table_1():
  # (best mean, best std, second mean) per validation column of HyperMixer's Table 1: MNLI, SNLI, QQP, QNLI
  # lead by more than one standard deviation; SST's lead is "smaller than one standard deviation" (its text).
  columns = {
    "MNLI": (66.9, 0.48, 66.2),
    "SNLI": (82.7, 0.22, 81.9),
    "QQP": (85.6, 0.20, 83.7),
    "QNLI": (78.0, 0.19, 68.1),
    "SST": (80.7, 0.84, 80.5),
  }
  assert {k: study.hypermixer_mark(*v) for k, v in columns.items()} == {
    "MNLI": True,
    "SNLI": True,
    "QQP": True,
    "QNLI": True,
    "SST": False,
  }
  # The best's deviation decides, not the second's: a 0.5 lead over a noisy best (std 1) is no mark.
  assert study.hypermixer_mark(10.5, 1.0, 10.0) is False
  assert study.hypermixer_mark(10.5, 0.4, 10.0) is True
  assert study.hypermixer_mark(3.0, 0.0, 3.0) is False  # constant and equal: no lead
  assert study.hypermixer_mark(3.0, None, 1.0) is None  # one seed: no deviation to compare with


# --- summarize ---------------------------------------------------------------------------------------------------
def _points():
  """lr 1e-3 clearly best in loss; exact_match tied between 1e-3 and 1e-4; 1e-2 has a missing exact_match."""
  points = []
  for lr, losses, matches in (
    (1e-4, OTHER[:3], [0.50, 0.60, 0.70]),
    (1e-3, LOSSES[:3], [0.70, 0.60, 0.50]),
    (1e-2, [5.5, 5.9], [0.1, None]),
  ):
    points += [
      {"learning_rate": lr, "seed": s, "validation/loss": v, "cogs/exact_match": m}
      for s, (v, m) in enumerate(zip(losses, matches))
    ]
  return points


def test_summarize_groups_describes_and_tests():
  s = study.summarize(_points(), ["learning_rate"], {"validation/loss": "min", "cogs/exact_match": "max"})
  assert [r["learning_rate"] for r in s.rows] == [1e-4, 1e-3, 1e-2]  # first appearance
  assert [r["n"] for r in s.rows] == [3, 3, 2]
  assert [r["cogs/exact_match_n"] for r in s.rows] == [3, 3, 1]
  for row, values in zip(s.rows, (OTHER[:3], LOSSES[:3], [5.5, 5.9])):
    ref = study.describe(values)
    assert {k: row[f"validation/loss_{k}"] for k in ref} == ref
    assert row["validation/loss_mean"] == pytest.approx(np.mean(values), rel=1e-12)
  assert s.values[2]["cogs/exact_match"] == [(0, 0.1)]
  assert s.values[1]["validation/loss"] == [(0, 4.21), (1, 4.35), (2, 4.02)]
  # Loss: lower is better; 1e-3 (mean 4.193, std 0.166) leads 1e-4 (4.65) by far more than its std.
  loss = s.tests["validation/loss"]
  assert s.best["validation/loss"] == loss["best"] == {"learning_rate": 1e-3}
  assert loss["second"] == {"learning_rate": 1e-4}
  ref = stats.ttest_ind(LOSSES[:3], OTHER[:3], equal_var=False)
  assert (loss["welch"]["t"], loss["welch"]["p"]) == (pytest.approx(ref.statistic), pytest.approx(ref.pvalue))
  assert loss["gap"] == pytest.approx(np.mean(OTHER[:3]) - np.mean(LOSSES[:3]))
  assert loss["mark"] is True
  # Exact match: higher is better; the two 0.6 means tie, the first in order is named, and there is no mark.
  match = s.tests["cogs/exact_match"]
  assert match["best"] == {"learning_rate": 1e-4} and match["second"] == {"learning_rate": 1e-3}
  assert match["gap"] == pytest.approx(0.0, abs=1e-12) and match["mark"] is False
  assert match["welch"]["p"] == pytest.approx(1.0)
  # Min against max on the same numbers: the worst loss becomes the best.
  worst = study.summarize(_points(), ["learning_rate"], {"validation/loss": "max"})
  assert worst.best["validation/loss"] == {"learning_rate": 1e-2}
  assert worst.tests["validation/loss"]["mark"] is True  # 5.7 vs 4.65, best's std 0.28


def test_summarize_rejects_bad_input():
  with pytest.raises(ValueError, match=r"^summarize: metric 'loss' has direction 'lower'; expected 'min' or 'max'$"):
    study.summarize(_points(), ["learning_rate"], {"loss": "lower"})
  with pytest.raises(ValueError, match=r"^summarize: point 0 has no 'model'; expected every point to carry "):
    study.summarize(_points(), ["learning_rate", "model"], {"validation/loss": "min"})
  with pytest.raises(ValueError, match=r"^summarize: no points"):
    study.summarize([], ["learning_rate"], {"validation/loss": "min"})


def test_one_group_has_no_second():
  s = study.summarize(_points()[:3], ["learning_rate"], {"validation/loss": "min"})
  assert s.tests["validation/loss"] == {
    "best": {"learning_rate": 1e-4},
    "second": None,
    "welch": None,
    "gap": None,
    "mark": None,
  }
  assert "no second point to test against" in study.markdown_table(s)


def test_better_reads_the_metric_name():
  assert [
    study.better(m) for m in ("validation/loss", "train/loss", "cogs/exact_match", "glue/accuracy", "lm/perplexity")
  ] == ["min", "min", "max", "max", "min"]


# --- write --------------------------------------------------------------------------------------------------------
def test_write_csv_md_png(tmp_path):
  s = study.summarize(_points(), ["learning_rate"], {"validation/loss": "min", "cogs/exact_match": "max"})
  paths = study.write(tmp_path / "out", s, title="lr sweep")
  assert [Path(str(p)).name for p in paths] == list(study.OUTPUT_FILES)
  with open(tmp_path / "out" / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == ["learning_rate", "n"] + [f"{m}_{k}" for m in s.metrics for k in study.STAT_SUFFIXES]
  for got, row in zip(rows, s.rows):  # the same numbers, exactly; None as an empty cell
    assert {k: (None if v == "" else float(v)) for k, v in got.items()} == row
  md = (tmp_path / "out" / "sweep.md").read_text()
  assert md.startswith("# lr sweep\n")
  lines = md.splitlines()
  best = next(line for line in lines if line.startswith("| 0.001 |"))
  r = s.rows[1]
  cell = (
    f"{r['validation/loss_mean']:.4g} ± {r['validation/loss_std']:.4g} "
    f"[{r['validation/loss_ci95_low']:.4g}, {r['validation/loss_ci95_high']:.4g}]"
  )
  assert f"| **{cell}** |" in best  # the clear winner in loss, bold
  assert md.count("**") == 2 + 2  # that cell and the legend's own **Bold**: the exact-match tie is not bold
  assert "| 0.01 | 2 | 5.7 ± 0.2828 [3.159, 8.241] | 0.1 (n=1) |" in lines
  welch = s.tests["validation/loss"]["welch"]
  assert (
    f"- validation/loss: best learning_rate=0.001, second learning_rate=0.0001: Welch's t = "
    f"{welch['t']:.3f}, df = {welch['df']:.1f}, p = {welch['p']:.3g}"
  ) in md
  assert "one-standard-deviation mark holds" in md and "mark does not hold" in md
  png = (tmp_path / "out" / "sweep.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(tmp_path / "out" / "sweep.png")
  assert image.shape[0] >= 300 and np.std(image[..., :3]) > 0.05  # drawn, not blank


# --- compare --group_by_seed ---------------------------------------------------------------------------------------
CONFIG = """\
from __gin__ import dynamic_registration
from remixer_t5.training import run_config

# Macros:
# ==============================================================================
LEARNING_RATE = {lr}
MODEL_DIR = '{model_dir}'
RANDOM_SEED = {seed}
TASK_FEATURE_LENGTHS = \\
    {{'inputs': 16, 'targets': 8}}

# Parameters for run_config.Training:
# ==============================================================================
run_config.Training.random_seed = %RANDOM_SEED
"""
# Best validation loss per (learning rate, seed); each run also logs a worse validation row and a final train loss.
BEST = {(0.001, 0): 4.1, (0.001, 1): 4.3, (0.001, 2): 4.2, (0.01, 0): 5.0, (0.01, 1): 5.4}


def _write(d: Path, rows, config: str | None):
  d.mkdir(parents=True)
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if config is not None:
    (d / "config.gin").write_text(config)
  return d


def _run(root: Path, lr: float, seed: int, best: float) -> Path:
  d = root / f"lr{lr}_s{seed}"
  rows = [
    {"step": 10, "split": "train", "loss": best + 1.0, "tokens_per_s": 100.0, "steps_per_s": 1.0},
    {"step": 10, "split": "validation", "loss": best + 0.5},
    {"step": 20, "split": "train", "loss": best + 0.25, "tokens_per_s": 100.0, "steps_per_s": 1.0},
    {"step": 20, "split": "validation", "loss": best},
    {"step": 20, "split": "infer/cogs", "exact_match": 1.0 / best},
  ]
  return _write(d, rows, CONFIG.format(lr=lr, model_dir=d, seed=seed))


@pytest.fixture
def seed_runs(tmp_path):
  return [_run(tmp_path / "runs", lr, seed, best) for (lr, seed), best in BEST.items()]


def test_point_metrics_reads_a_finished_run(seed_runs):
  assert study.point_metrics(seed_runs[0]) == {
    "validation/loss": 4.1,
    "train/loss": 4.1 + 0.25,
    "cogs/exact_match": 1.0 / 4.1,
  }


def test_compare_group_by_seed_writes_the_study(seed_runs, tmp_path, capsys):
  out = tmp_path / "out"
  assert cli.main(["compare", *map(str, seed_runs), "--out", str(out), "--group_by_seed"]) == 0
  assert sorted(p.name for p in out.iterdir()) == sorted(compare.OUTPUT_FILES + study.OUTPUT_FILES)
  with open(out / "sweep.csv") as f:
    rows = {r["group"]: r for r in csv.DictReader(f)}
  assert list(rows) == ["LEARNING_RATE=0.001", "LEARNING_RATE=0.01"]
  for lr in (0.001, 0.01):
    row, logged = rows[f"LEARNING_RATE={lr}"], [v for (r, _), v in BEST.items() if r == lr]
    assert int(row["n"]) == len(logged)
    assert float(row["validation/loss_mean"]) == pytest.approx(np.mean(logged), rel=1e-12)
    assert float(row["validation/loss_std"]) == pytest.approx(np.std(logged, ddof=1), rel=1e-12)
    low, high = _scipy_interval(logged)
    assert float(row["validation/loss_ci95_low"]) == pytest.approx(low, rel=1e-12)
    assert float(row["validation/loss_ci95_high"]) == pytest.approx(high, rel=1e-12)
    assert float(row["cogs/exact_match_mean"]) == pytest.approx(np.mean([1 / v for v in logged]), rel=1e-12)
  md = (out / "sweep.md").read_text()
  assert "| LEARNING_RATE=0.001 | 3 | **4.2 ± 0.1 [3.952, 4.448]** |" in md
  captured = capsys.readouterr()
  assert captured.out == (out / "compare.md").read_text() + "\n" + md
  assert all(f"wrote {out / name}" in captured.err for name in study.OUTPUT_FILES)


def test_compare_without_the_flag_writes_no_study(seed_runs, tmp_path):
  assert cli.main(["compare", *map(str, seed_runs[:2]), "--out", str(tmp_path / "out")]) == 0
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(compare.OUTPUT_FILES)


def test_seed_points_groups_on_config_gin(seed_runs, tmp_path):
  runs = [compare.load_run(d, params=False) for d in seed_runs]
  points = compare.seed_points(runs)
  assert [(p["group"], p["seed"], p["run"]) for p in points] == [
    ("LEARNING_RATE=0.001", 0, "lr0.001_s0"),
    ("LEARNING_RATE=0.001", 1, "lr0.001_s1"),
    ("LEARNING_RATE=0.001", 2, "lr0.001_s2"),
    ("LEARNING_RATE=0.01", 0, "lr0.01_s0"),
    ("LEARNING_RATE=0.01", 1, "lr0.01_s1"),
  ]
  # One setting: the group is named after its first run.
  assert {p["group"] for p in compare.seed_points(runs[:3])} == {"lr0.001_s0 +2"}
  # A wrapped value is one setting: a run whose feature lengths differ is a group of its own.
  other = _run(tmp_path / "more", 0.001, 0, 4.0)
  (other / "config.gin").write_text((other / "config.gin").read_text().replace("'targets': 8", "'targets': 9"))
  groups = [p["group"] for p in compare.seed_points(runs[:2] + [compare.load_run(other, params=False)])]
  assert groups == ["TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}"] * 2 + [
    "TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 9}"
  ]


def test_group_by_seed_errors(seed_runs, tmp_path, capsys):
  twin = _run(tmp_path / "twin", 0.001, 1, 4.0)
  assert (
    cli.main(["compare", *map(str, seed_runs[:2]), str(twin), "--out", str(tmp_path / "o"), "--group_by_seed"]) == 2
  )
  assert (
    "--group_by_seed: runs runs/lr0.001_s1 and twin/lr0.001_s1 have the same config.gin and seed 1; "
    "expected one run per seed in a group"
  ) in capsys.readouterr().err
  assert not (tmp_path / "o").exists()  # refused before anything is written
  (seed_runs[1] / "config.gin").unlink()
  assert cli.main(["compare", *map(str, seed_runs[:2]), "--out", str(tmp_path / "o2"), "--group_by_seed"]) == 2
  assert f"--group_by_seed: {seed_runs[1]} has no config.gin" in capsys.readouterr().err
