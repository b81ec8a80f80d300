"""Surviving faults: kill -9 at any moment (also mid-save), SIGTERM, a corrupt latest checkpoint and a NaN loss.

Each restarted run must reach the same parameters, bitwise, as a run that was never interrupted: the checkpoint
holds step, params, optimizer state, RNG and the input position (each process's tf.data iterator state, restored
in constant time; a checkpoint without one is replayed with skip), and the input pipeline is deterministic.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_util import xla_flags

from remixer_t5.training import checkpoints, metrics_log
from remixer_t5 import cli

RUN = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/demo.gin",
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
  "--gin.LOG_PERIOD=1",
  "--gin.EVAL_PERIOD=0",
  "--gin.network.T5Config.emb_dim=32",
  "--gin.network.T5Config.mlp_dim=48",
  "--gin.network.T5Config.num_encoder_layers=1",
  "--gin.network.T5Config.num_decoder_layers=1",
]
STEPS = 12


def _args(model_dir, steps=STEPS, period=1):
  return [
    "train",
    *RUN,
    f"--gin.MODEL_DIR='{model_dir}'",
    f"--gin.TRAIN_STEPS={steps}",
    f"--gin.CHECKPOINT_PERIOD={period}",
  ]


def _spawn(args, env):
  return subprocess.Popen(
    [sys.executable, "-m", "remixer_t5", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )


def _train_steps_logged(model_dir):
  path = Path(model_dir) / "metrics.jsonl"
  if not path.exists():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:  # a line being written right now
      pass
  return [r["step"] for r in rows if r["split"] == "train"]


def _params(model_dir):
  return checkpoints.restore_any_params(model_dir)


def _assert_same(a, b):
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def env(embedded_cache):
  e = dict(os.environ, REMIXER_T5_CACHE_DIR=str(embedded_cache.root), JAX_PLATFORMS="cpu")
  e["XLA_FLAGS"] = xla_flags()
  return e


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, embedded_cache):
  """The uninterrupted run, in process (checkpoints at 4, 8, 12)."""
  root = tmp_path_factory.mktemp("reference")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
    assert cli.main(_args(root, period=4)) == 0
  return root


@pytest.fixture(scope="module")
def reference(reference_dir):
  return _params(reference_dir)


@pytest.mark.integration
def test_kill_9_mid_save_then_restart_matches_uninterrupted(
  tmp_path, env, reference, monkeypatch, embedded_cache, capsys
):
  run = tmp_path / "run"
  ckpt_dir = run / "checkpoints"
  proc = _spawn(_args(run), env)
  deadline, killed_at = time.time() + 180, None
  while proc.poll() is None and time.time() < deadline:
    # Kill while orbax is writing a step (its temporary directory exists), once a few steps are done.
    saving = ckpt_dir.is_dir() and any("tmp" in p.name for p in ckpt_dir.iterdir())
    if saving and len(_train_steps_logged(run)) >= 3:
      proc.send_signal(signal.SIGKILL)
      killed_at = len(_train_steps_logged(run))
      break
    time.sleep(0.002)
  proc.wait(timeout=60)
  assert killed_at is not None, "never caught a checkpoint save in flight"
  assert killed_at < STEPS
  # Restart the same command (in process here): it resumes from the newest complete checkpoint.
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  capsys.readouterr()
  assert cli.main(_args(run)) == 0
  out = capsys.readouterr().out
  assert "resumed from" in out and "input position restored from" in out  # the iterator state, not a replay
  assert "taking over MODEL_DIR" in out and "has ended" in out  # the killed process's lock
  assert not (run / "LOCK").exists()
  assert not [p for p in ckpt_dir.iterdir() if "tmp" in p.name]  # the unfinished save was cleaned up
  # The history: re-logged steps supersede the killed run's, one current train row per step.
  rows = metrics_log.read_rows(run / "metrics.jsonl")
  assert [r["step"] for r in rows if r["split"] == "start"][0] == 0
  assert [r["step"] for r in metrics_log.current_rows(rows) if r["split"] == "train"] == list(range(1, STEPS + 1))
  # Every kept checkpoint has its input state; older ones are pruned (one save behind orbax's own deletions).
  kept = checkpoints.Checkpointer(run).all_steps()
  states = sorted(int(p.name) for p in (run / checkpoints.INPUT_STATE_DIR).iterdir())
  assert set(kept) <= set(states) and len(states) <= len(kept) + 1, (kept, states)
  assert not list((run / checkpoints.INPUT_STATE_DIR).rglob(".*tmp*"))
  _assert_same(_params(run), reference)


@pytest.mark.integration
@pytest.mark.parametrize(
  "signum, said", [(signal.SIGTERM, "preempted (SIGTERM)"), (signal.SIGINT, "interrupted (Ctrl-C)")]
)
def test_sigterm_or_ctrl_c_saves_exits_0_and_the_rerun_resumes_exactly(
  tmp_path, env, reference, monkeypatch, embedded_cache, capsys, signum, said
):
  run = tmp_path / "run"
  proc = _spawn(_args(run, period=100), env)  # no periodic checkpoint before the end
  deadline = time.time() + 180
  while proc.poll() is None and len(_train_steps_logged(run)) < 3 and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-2000:]
  assert f"{said}: saved step" in out and "Traceback" not in out
  saved = checkpoints.Checkpointer(run).latest_step()
  assert saved is not None and 3 <= saved < STEPS
  assert saved == _train_steps_logged(run)[-1]  # the step the signal's boundary ended
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  capsys.readouterr()
  assert cli.main(_args(run, period=100)) == 0
  out = capsys.readouterr().out
  assert f"resumed from {run / 'checkpoints'}/{saved}" in out
  assert f"input position restored from {run / checkpoints.INPUT_STATE_DIR / str(saved)}" in out
  _assert_same(_params(run), reference)


def test_a_second_ctrl_c_aborts_at_once():
  """The first Ctrl-C asks for a save at the step's end; a second one raises KeyboardInterrupt where the process
  is (`remixer-t5` then exits 130 in one line: tests/test_bad_input.py). Outside the loop Ctrl-C is Python's."""
  from remixer_t5.training import trainer

  with trainer._StopWatch(None) as watch:
    assert watch.requested() is None
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert watch.requested() == "interrupted (Ctrl-C)"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_checkpoint_without_input_state_resumes_by_replay(
  tmp_path, monkeypatch, embedded_cache, reference_dir, reference, capsys
):
  """A checkpoint of a run from before iterator checkpoints (position only) still resumes exactly: skip."""
  import shutil

  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  run = tmp_path / "run"
  shutil.copytree(reference_dir, run)
  shutil.rmtree(run / "checkpoints" / "12")
  shutil.rmtree(run / checkpoints.INPUT_STATE_DIR)
  capsys.readouterr()
  assert cli.main(_args(run, period=4)) == 0
  out = capsys.readouterr().out
  assert f"resumed from {run / 'checkpoints'}/8" in out
  assert "no input-iterator state for this checkpoint" in out and "replaying 8 batches with skip" in out
  _assert_same(_params(run), reference)


def test_corrupt_latest_checkpoint_is_reported_and_the_previous_one_restored(
  tmp_path, monkeypatch, embedded_cache, reference_dir, reference, capsys
):
  import shutil

  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  run = tmp_path / "run"
  shutil.copytree(reference_dir, run)
  assert checkpoints.Checkpointer(run).all_steps() == [4, 8, 12]
  for f in (run / "checkpoints" / "12").rglob("*"):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a partial copy
  capsys.readouterr()
  assert cli.main(_args(run, period=4)) == 0
  out = capsys.readouterr().out
  assert f"checkpoint {run / 'checkpoints' / '12'} cannot be restored" in out
  assert f"resumed from {run / 'checkpoints'}/8" in out
  assert any(p.name.startswith("12.corrupt") for p in (run / "checkpoints").iterdir())
  _assert_same(_params(run), reference)


def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
  tmp_path, monkeypatch, embedded_cache
):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  from remixer_t5 import gin_utils
  from remixer_t5.training import run_config, trainer

  gin_utils.parse_gin(
    ["models/t5_1_1/tiny.gin"],
    [
      "network.T5Config.emb_dim=32",
      "network.T5Config.mlp_dim=48",
      "network.T5Config.num_encoder_layers=1",
      "network.T5Config.num_decoder_layers=1",
    ],
  )
  model = gin_utils.macro("MODEL")
  lr = lambda step: jnp.where(step >= 5, jnp.nan, 1e-3)  # poisons the update made at step 6
  with pytest.raises(FloatingPointError, match=r"between steps 4 and 6.*last good checkpoint is 4"):
    trainer.train(
      run_config.Run(
        model_dir=str(tmp_path / "run"),
        training=run_config.Training(model=model, learning_rate=lr),
        data=run_config.Data(
          task="embedded_span_corruption", feature_lengths={"inputs": 16, "targets": 8}, batch_size=2
        ),
        schedule=run_config.Schedule(train_steps=10, checkpoint_period=2, eval_period=0, log_period=3),
      )
    )
  ckpt = checkpoints.Checkpointer(tmp_path / "run")
  assert ckpt.all_steps() == [2, 4]
  params = _params(tmp_path / "run")
  assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree_util.tree_leaves(params))
