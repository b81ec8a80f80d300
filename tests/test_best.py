"""The best checkpoint and early stopping: the step with the best KEEP_BEST_BY value survives keep-N and is what
`--checkpoint best` reads; EARLY_STOP_PATIENCE stops at the evaluation the rule names (checked against the logged
validation losses), saving that step, and a resumed run goes on counting; T5's per-task-best SuperGLUE report."""

import json

import numpy as np
import pytest

from remixer_t5 import cli
from remixer_t5.tasks import super_glue
from remixer_t5.training import best, checkpoints, metrics_log

SIZES = [
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
  "--gin.EVAL_STEPS=2",
  "--gin.network.T5Config.emb_dim=32",
  "--gin.network.T5Config.mlp_dim=48",
  "--gin.network.T5Config.num_encoder_layers=1",
  "--gin.network.T5Config.num_decoder_layers=1",
]


def _args(command, model_dir, *extra):
  return [
    command,
    "--gin_file=models/t5_1_1/tiny.gin",
    "--gin_file=runs/demo.gin",
    *SIZES,
    f"--gin.MODEL_DIR='{model_dir}'",
    *extra,
  ]


STUDY = [
  "--gin.TRAIN_STEPS=80",
  "--gin.EVAL_PERIOD=5",
  "--gin.LOG_PERIOD=10",
  "--gin.CHECKPOINT_PERIOD=10",
  "--gin.run_config.Schedule.keep_checkpoints=1",
  "--gin.KEEP_BEST_BY='validation/loss:min'",
  "--gin.EARLY_STOP_PATIENCE=2",
]


def _expected(losses, patience, min_delta=0.0):
  """(best step, stop step or None) by the rule, from (step, loss) pairs in order: a numpy loop of its own."""
  best_value, best_step, since = np.inf, None, 0
  for step, loss in losses:
    if best_value - loss > min_delta:
      best_value, best_step, since = loss, step, 0
    else:
      since += 1
      if since >= patience:
        return best_step, step
  return best_step, None


def _validation(model_dir):
  rows = metrics_log.current_rows(metrics_log.read_rows(model_dir / "metrics.jsonl"))
  return [(r["step"], r["loss"]) for r in rows if r["split"] == "validation" and r["step"] > 0]


@pytest.fixture(scope="module")
def studied(tmp_path_factory, embedded_cache):
  root = tmp_path_factory.mktemp("best") / "run"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
    assert cli.main(_args("train", root, *STUDY)) == 0
  trained = _validation(root)  # before `eval` below adds its own validation row
  return root, trained


def test_early_stopping_stops_where_the_rule_says_and_the_best_step_survives(studied):
  studied, losses = studied
  best_step, stop_step = _expected(losses, patience=2)
  assert stop_step is not None and stop_step < 80, losses  # the tiny run plateaus within 80 steps
  assert losses[-1][0] == stop_step  # no evaluation after the stop
  kept = checkpoints.Checkpointer(studied).all_steps()
  assert sorted(kept) == sorted({best_step, stop_step})  # keep_checkpoints=1 plus the best
  recorded = json.loads((studied / best.BEST_FILE).read_text())
  assert recorded["step"] == best_step and recorded["value"] == pytest.approx(dict(losses)[best_step])


def test_checkpoint_best_is_what_eval_and_infer_read(studied, embedded_cache, monkeypatch, capsys):
  studied, losses = studied
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  best_step = json.loads((studied / best.BEST_FILE).read_text())["step"]
  capsys.readouterr()
  assert cli.main(_args("eval", studied, "--checkpoint", "best")) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["validation"]["loss"] == pytest.approx(dict(losses)[best_step])
  out = studied / "best.jsonl"
  assert cli.main(_args("infer", studied, "--checkpoint", "best", "--output", str(out))) == 0
  assert out.read_text().strip()
  params = checkpoints.restore_any_params(best.checkpoint_dir(studied, "best"))
  latest = checkpoints.restore_any_params(studied)
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(*map(lambda t: __import__("jax").tree_util.tree_leaves(t), (params, latest)))
  )


def test_a_resumed_run_goes_on_counting_from_its_checkpoint(studied, tmp_path, embedded_cache, monkeypatch):
  studied, losses = studied
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  _, stop_step = _expected(losses, patience=2)
  run = tmp_path / "run"
  first = [a if not a.startswith("--gin.TRAIN_STEPS=") else f"--gin.TRAIN_STEPS={stop_step - 5}" for a in STUDY]
  assert cli.main(_args("train", run, *first)) == 0
  assert cli.main(_args("train", run, *STUDY)) == 0
  assert _validation(run) == losses  # the same evaluations, the same stop
  assert checkpoints.Checkpointer(run).all_steps() == checkpoints.Checkpointer(studied).all_steps()


def test_without_a_best_recorded_checkpoint_best_is_one_line(tmp_path):
  with pytest.raises(FileNotFoundError, match="records no best checkpoint.*KEEP_BEST_BY"):
    best.checkpoint_dir(tmp_path, "best")
  with pytest.raises(ValueError, match="expected 'best', 'latest' or a step number"):
    best.checkpoint_dir(tmp_path, "newest")


@pytest.mark.parametrize("spec", ["loss", "validation/loss", "validation/loss:lowest", ":min"])
def test_bad_metric_specs_are_one_line(spec):
  with pytest.raises(ValueError, match=r"expected '<split or task>/<metric>:min\|max'"):
    best.parse(spec)


def test_the_keeper_follows_min_max_delta_and_patience():
  k = best.Keeper("cogs/exact_match:max", patience=2, min_delta=0.05)
  assert k.observe(10, {"validation/loss": 3.0}) == (False, False)  # not its metric
  assert k.observe(20, {"cogs/exact_match": 0.5}) == (True, False)
  assert k.observe(30, {"cogs/exact_match": 0.54}) == (False, False)  # within the delta
  assert k.observe(40, {"cogs/exact_match": 0.6}) == (True, False)
  assert k.observe(50, {"cogs/exact_match": 0.6}) == (False, False)
  restored = best.Keeper("cogs/exact_match:max", patience=2, min_delta=0.05, state=k.state())
  assert restored.observe(60, {"cogs/exact_match": 0.1}) == (False, True)
  assert (restored.best_step, restored.best_value) == (40, 0.6)
  other = best.Keeper("validation/loss:min", state=k.state())  # another metric: starts again
  assert other.best_step is None


def test_t5s_super_glue_report_takes_each_task_at_its_best_step():
  rng = np.random.default_rng(0)
  rows, per_step = [], {}
  for step in (100, 200, 300):
    scores = {}
    for task, keys in super_glue.AVERAGE_METRICS.items():
      values = {k: float(rng.uniform(40, 90)) for k in keys}
      rows.append({"step": step, "split": f"infer/{super_glue.PREFIX}{task}", **values})
      scores[f"{super_glue.PREFIX}{task}"] = values
    per_step[step] = super_glue.super_glue_average(scores)
    rows.append({"step": step, "split": "infer/super_glue_average", "score": per_step[step]})
  report = best.super_glue_protocol(rows)
  task_score = lambda r, keys: sum(r[k] for k in keys) / len(keys)
  expected = np.mean(
    [
      max(task_score(r, keys) for r in rows if r["split"] == f"infer/{super_glue.PREFIX}{task}")
      for task, keys in super_glue.AVERAGE_METRICS.items()
    ]
  )
  assert report["score"] == pytest.approx(expected)
  assert report["single_best_score"] == pytest.approx(max(per_step.values()))
  assert report["score"] >= report["single_best_score"]
  assert best.super_glue_protocol([r for r in rows if "cb" not in r["split"]]) is None


@pytest.mark.parametrize("command", ["plot", "export-hf"])
def test_plot_and_export_hf_read_the_best_step(studied, tmp_path, monkeypatch, command):
  studied, _ = studied
  read = []
  restore = checkpoints.restore_any_params
  monkeypatch.setattr(checkpoints, "restore_any_params", lambda path: read.append(path) or restore(path))
  argv = (
    ["plot", str(studied), "--checkpoint", "best", "--out", str(tmp_path), "--length", "8"]
    if command == "plot"
    else ["export-hf", str(studied), str(tmp_path / "hf"), "--checkpoint", "best"]
  )
  assert cli.main(argv) == 0
  best_step = json.loads((studied / best.BEST_FILE).read_text())["step"]
  assert [str(p) for p in read] == [str(studied / "checkpoints" / str(best_step))]


def test_the_super_glue_report_is_written_at_the_end_of_a_run(tmp_path):
  from remixer_t5.training import trainer

  rows = []
  for step in (10, 20):
    for task, keys in super_glue.AVERAGE_METRICS.items():
      rows.append({"step": step, "split": f"infer/{super_glue.PREFIX}{task}", **{k: 50.0 + step for k in keys}})
    rows.append({"step": step, "split": "infer/super_glue_average", "score": 50.0 + step})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  log = metrics_log.MetricsLogger(str(tmp_path))
  trainer._report_super_glue(tmp_path, 20, log)
  log.close()
  written = [
    r for r in metrics_log.read_rows(tmp_path / "metrics.jsonl") if r["split"] == "infer/super_glue_t5_protocol"
  ]
  assert len(written) == 1 and written[0]["score"] == pytest.approx(70.0) and written[0]["single_best_step"] == 20
