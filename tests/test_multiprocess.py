"""Two processes on 127.0.0.1 (gloo CPU collectives) train with the same losses as one process with the same
global batch: each process reads its own input shard, the global batch is assembled from process-local data,
only process 0 writes summaries, and orbax saves collectively; a resumed two-process run restores each process's
own input position."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_util import xla_flags

from remixer_t5.training import checkpoints

ROWS = [
  (f"Emma saw {n} cats .", f"see . agent ( x _ 1 , Emma ) AND see . theme ( x _ 1 , {n} )", "in_distribution")
  for n in ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven")
]
STEPS = 5


def _args(model_dir, data_dir):
  return [
    "train",
    "--gin_file=models/t5_1_1/tiny.gin",
    "--gin_file=runs/cogs.gin",
    "--gin.VOCABULARY=@vocab.get_vocabulary()",
    "--gin.BATCH_SIZE=4",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 32}",
    "--gin.LOG_PERIOD=1",
    f"--gin.EVAL_PERIOD={STEPS}",
    "--gin.EVAL_STEPS=1",
    f"--gin.CHECKPOINT_PERIOD={STEPS}",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.DROPOUT_RATE=0.0",
    "--gin.run_config.Data.shuffle=False",
    "--gin.run_config.Data.pack=False",
    f"--gin.run_config.Schedule.infer_eval_period={STEPS}",
    "--gin.run_config.Schedule.infer_examples=4",
    "--gin.network.T5Config.emb_dim=32",
    "--gin.network.T5Config.mlp_dim=48",
    f"--gin.MODEL_DIR='{model_dir}'",
    f"--gin.DATA_DIR='{data_dir}'",
  ]


def _rows(model_dir):
  return [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines()]


def _losses(model_dir):
  return [r["loss"] for r in _rows(model_dir) if r["split"] == "train"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, embedded_cache):
  root = tmp_path_factory.mktemp("multiprocess")
  cogs = root / "data" / "cogs"
  cogs.mkdir(parents=True)
  for name in ("train.tsv", "dev.tsv", "test.tsv", "gen.tsv"):
    (cogs / name).write_text("".join("\t".join(r) + "\n" for r in ROWS), encoding="utf-8")
  env = dict(os.environ, REMIXER_T5_CACHE_DIR=str(embedded_cache.root), JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags()  # one CPU device per process
  return root, env


def _two_processes(env, args):
  port = _free_port()
  procs = []
  for pid in range(2):
    penv = dict(
      env, REMIXER_T5_COORDINATOR=f"127.0.0.1:{port}", REMIXER_T5_NUM_PROCESSES="2", REMIXER_T5_PROCESS_ID=str(pid)
    )
    procs.append(
      subprocess.Popen(
        [sys.executable, "-m", "remixer_t5", *args],
        env=penv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  outs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs


@pytest.fixture(scope="module")
def two_run(setup):
  """The uninterrupted two-process run (its outputs per process)."""
  root, env = setup
  return _two_processes(env, _args(root / "two", root / "data"))


@pytest.mark.integration
def test_two_processes_match_one_process_with_the_same_global_batch(setup, two_run):
  root, env = setup
  outs = two_run
  assert "process 0 of 2" in outs[0] and "process 1 of 2" in outs[1]
  assert "[train] step" in outs[0] and "[train] step" not in outs[1]  # only process 0 reports

  single = subprocess.run(
    [sys.executable, "-m", "remixer_t5", *_args(root / "one", root / "data")],
    env=env,
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]

  two, one = _losses(root / "two"), _losses(root / "one")
  assert len(two) == len(one) == STEPS
  for a, b in zip(two, one):
    assert a == pytest.approx(b, abs=1e-5)
  assert len(set(round(x, 4) for x in one)) > 1  # the steps really trained on different batches
  assert checkpoints.Checkpointer(root / "two").all_steps() == [STEPS]  # saved collectively, once
  # Evaluation ran in both runs on the same data: loss on the validation split and decode-and-score.
  evals = {name: [r for r in _rows(root / name) if r["split"] != "train"] for name in ("one", "two")}
  for split in ("validation",):
    (a,), (b,) = ([r for r in evals[n] if r["split"] == split and r["step"] == STEPS] for n in ("two", "one"))
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
  infer = {n: [r for r in evals[n] if r["split"].startswith("infer/")] for n in ("one", "two")}
  assert len(infer["one"]) == len(infer["two"]) == 1
  assert infer["two"][0]["exact_match"] == infer["one"][0]["exact_match"]


@pytest.mark.integration
def test_two_processes_resume_each_its_own_input_position(setup, two_run):
  """Stopped at step 3 and rerun to 5, each process restores its own shard's iterator state: the resumed steps
  have exactly the losses of the uninterrupted two-process run."""
  root, env = setup
  quick = ["--gin.EVAL_PERIOD=0", "--gin.run_config.Schedule.infer_eval_period=0"]
  _two_processes(env, [*_args(root / "resumed", root / "data"), "--gin.TRAIN_STEPS=3", *quick])
  outs = _two_processes(env, [*_args(root / "resumed", root / "data"), *quick])
  for pid, out in enumerate(outs):
    state = root / "resumed" / checkpoints.INPUT_STATE_DIR / "3" / f"process-{pid:05d}-of-00002"
    assert f"input position restored from {state}" in out, out[-3000:]
  assert _losses(root / "resumed") == _losses(root / "two")  # steps 1-3, then the resumed 4-5: bitwise


def test_coordinator_without_process_count_is_a_clear_error(tmp_path):
  env = dict(os.environ, REMIXER_T5_COORDINATOR="127.0.0.1:1", JAX_PLATFORMS="cpu")
  env.pop("REMIXER_T5_NUM_PROCESSES", None)
  env.pop("REMIXER_T5_PROCESS_ID", None)
  out = subprocess.run(
    [sys.executable, "-m", "remixer_t5", "train", "--gin_file=models/t5_1_1/tiny.gin"],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2
  assert "--num_processes" in out.stderr and "127.0.0.1:1" in out.stderr
