"""Where a run's time goes: every train row splits its window's wall time into compile, input, step, eval,
checkpoint and other (summing to `window_seconds`), with goodput the step's share; `--profile_steps` leaves a
jax.profiler trace of those steps under MODEL_DIR/profile/ that xprof (TensorBoard's profile plugin) reads, with
the train step's XLA program and a marker per step; MODEL_DIR/PROFILE asks a running train for one."""

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from remixer_t5 import cli
from remixer_t5.training import metrics_log, profiling, time_split

PARTS = ("time/compile", "time/input", "time/step", "time/eval", "time/checkpoint", "time/other")


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, embedded_cache):
  """25 steps of a tiny model: a row every 5 steps, validation and a checkpoint every 10, steps 22-25 traced."""
  root = tmp_path_factory.mktemp("split") / "run"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
    assert (
      cli.main(
        [
          "train",
          "--gin_file=models/t5_1_1/tiny.gin",
          "--gin_file=runs/demo.gin",
          "--gin.BATCH_SIZE=2",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
          "--gin.network.T5Config.emb_dim=32",
          "--gin.network.T5Config.mlp_dim=48",
          "--gin.network.T5Config.num_encoder_layers=1",
          "--gin.network.T5Config.num_decoder_layers=1",
          f"--gin.MODEL_DIR='{root}'",
          "--gin.TRAIN_STEPS=25",
          "--gin.LOG_PERIOD=5",
          "--gin.EVAL_PERIOD=10",
          "--gin.EVAL_STEPS=2",
          "--gin.CHECKPOINT_PERIOD=10",
          "--profile_steps",
          "22:25",
        ]
      )
      == 0
    )
  return root


def test_every_train_row_splits_its_window(profiled_run):
  rows = {r["step"]: r for r in metrics_log.read_rows(profiled_run / "metrics.jsonl") if r["split"] == "train"}
  assert sorted(rows) == [5, 10, 15, 20, 25]
  for step, row in rows.items():
    assert all(row[p] >= 0 for p in PARTS), row
    assert sum(row[p] for p in PARTS) == pytest.approx(row["window_seconds"], rel=0.03), (step, row)
    assert row["goodput"] == pytest.approx(row["time/step"] / row["window_seconds"])
    assert row["time/step"] > 0 and row["time/input"] > 0
  assert rows[5]["time/compile"] > 0 and all(rows[s]["time/compile"] == 0 for s in (10, 15, 20, 25))
  # The validation and the save at steps 10 and 20 ran right after those rows: in the next windows.
  for step in (15, 25):
    assert rows[step]["time/eval"] > 0 and rows[step]["time/checkpoint"] > 0, rows[step]
  assert rows[10]["time/eval"] == 0


def test_the_console_names_goodput_and_the_largest_other_part():
  row = {
    "window_seconds": 10.0,
    "time/step": 9.1,
    "time/input": 0.6,
    "time/other": 0.3,
    "time/eval": 0.0,
    "time/compile": 0.0,
    "time/checkpoint": 0.0,
    "goodput": 0.91,
  }
  assert time_split.summary(row) == "goodput 91%, input 6%"
  row.update({"time/input": 0.2, "time/other": 0.7, "time/step": 9.1})
  assert time_split.summary(row) == "goodput 91%, other 7%"
  row.update({"time/input": 0.2, "time/other": 0.2, "time/step": 9.6, "goodput": 0.96})
  assert time_split.summary(row) == "goodput 96%"  # nothing else above 3%


def _trace_events(folder: Path):
  """The trace viewer's events of the one trace under `folder`, read by xprof (the profile plugin's reader)."""
  xprof = pytest.importorskip("xprof.convert.raw_to_tool_data", reason="the profile extra (xprof) is not installed")
  planes = sorted(folder.rglob("*.xplane.pb"))
  assert len(planes) == 1, planes
  data, content_type = xprof.xspace_to_tool_data([str(planes[0])], "trace_viewer", {})
  assert content_type == "application/json"
  return json.loads(data)["traceEvents"]


def test_profile_steps_leave_a_trace_of_the_train_step(profiled_run):
  folder = profiled_run / profiling.PROFILE_DIR / "steps_22-25"
  events = _trace_events(folder)
  modules = {e.get("args", {}).get("hlo_module") for e in events}
  assert "jit_train_step" in modules  # the train step's XLA program ran inside the trace
  names = {e.get("name") for e in events}
  assert {f"train {s}" for s in (22, 23, 24, 25)} <= names and "train 21" not in names and "train 26" not in names


def test_a_profile_file_asks_a_running_train_for_steps(tmp_path):
  said = []
  profiler = profiling.StepProfiler(tmp_path, None, said.append)
  profiler.poll(3)
  assert not profiler.pending  # no PROFILE file
  (tmp_path / profiling.REQUEST_FILE).write_text("5:6\n")
  profiler.poll(3)
  profiler.poll(4)  # the same request is taken once
  assert profiler.pending == [(5, 6)] and said == [f"profiling steps 5-6 (asked by {tmp_path / 'PROFILE'})"]
  step_fn = jax.jit(lambda x: x * 2 + 1)
  x = jnp.ones(4)
  for step in range(4, 8):
    profiler.before(step)
    with profiling.annotate(step):
      x = step_fn(x)
    profiler.after(step, x)
  profiler.close()
  assert "profile of steps 5-6 written to" in said[-1]
  names = {e.get("name") for e in _trace_events(tmp_path / profiling.PROFILE_DIR / "steps_5-6")}
  assert {"train 5", "train 6"} <= names and "train 4" not in names and "train 7" not in names
  (tmp_path / profiling.REQUEST_FILE).write_text("2:9")  # begun already: said, not taken
  profiler.poll(7)
  assert not profiler.pending and "began before step 8" in said[-1]


@pytest.mark.parametrize("text", ["22", "5:3", "0:4", "a:b", "1:2:3"])
def test_bad_step_ranges_are_one_line(text):
  with pytest.raises(ValueError, match=r"profile_steps=.*expected FIRST:LAST"):
    profiling.parse_steps(text)


def test_the_split_sums_to_the_window():
  split = time_split.TimeSplit()
  with split("input"):
    time.sleep(0.02)
  with split("step"):
    time.sleep(0.03)
  time.sleep(0.01)
  row = split.row()
  assert row["time/input"] >= 0.02 and row["time/step"] >= 0.03 and row["time/other"] >= 0.01
  assert sum(row[p] for p in PARTS) == pytest.approx(row["window_seconds"], rel=1e-6)


def test_a_trace_goes_to_a_bucket_through_the_runs_storage_client(monkeypatch):
  import gcsfs
  from gcs_server import GCSServer

  server = GCSServer()
  try:
    server.create_bucket("bucket")
    for k, v in server.env.items():
      monkeypatch.setenv(k, v)
    gcsfs.GCSFileSystem.clear_instance_cache()
    with profiling.trace("gs://bucket/run/profile/steps_1-1"):
      jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
    names = server.objects("bucket", "run/profile/steps_1-1/")
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()
    server.stop()
  assert any(n.endswith(".xplane.pb") and "/plugins/profile/" in n for n in names), names
