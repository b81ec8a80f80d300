"""End to end through the CLI: train, resume, refuse an incompatible MODEL_DIR, eval, export/import HF."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from remixer_t5.training import checkpoints
from remixer_t5 import cli, gin_utils

SMALL_RUN = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/demo.gin",
  "--gin.BATCH_SIZE=4",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
  "--gin.LOG_PERIOD=2",
  "--gin.EVAL_PERIOD=3",
  "--gin.CHECKPOINT_PERIOD=3",
  "--gin.EVAL_STEPS=1",
  "--gin.network.T5Config.emb_dim=32",
  "--gin.network.T5Config.mlp_dim=48",
]


def _train(model_dir, steps, *extra):
  return cli.main(["train", *SMALL_RUN, f"--gin.MODEL_DIR={model_dir}", f"--gin.TRAIN_STEPS={steps}", *extra])


def _rows(model_dir):
  return [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_cache):
  mp = pytest.MonkeyPatch()
  mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  root = tmp_path_factory.mktemp("runs")
  assert _train(root / "a", 6) == 0
  yield root
  mp.undo()


@pytest.fixture(scope="module")
def uninterrupted(trained, embedded_cache):
  """trained / 'b': 8 steps in one go, the reference of the resume and the gradient accumulation tests."""
  mp = pytest.MonkeyPatch()
  mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  assert _train(trained / "b", 8) == 0
  yield trained / "b"
  mp.undo()


def test_train_logs_evaluates_and_checkpoints(trained):
  rows = _rows(trained / "a")
  train = [r for r in rows if r["split"] == "train"]
  val = [r for r in rows if r["split"] == "validation"]
  assert [r["step"] for r in train] == [2, 4, 6]
  assert [r["step"] for r in val] == [0, 3, 6]
  for r in train:
    assert np.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 and r["tokens_per_s"] > 0
  # Each row's window is the time since the row before, less that row's own logging (TensorBoard's first
  # writer takes seconds to start).
  for prev, r in zip(train, train[1:]):
    assert 0 < r["window_seconds"] <= r["time"] - prev["time"] < r["window_seconds"] + 5.0
  assert val[0]["examples"] and {"inputs", "targets", "prediction"} <= set(val[0]["examples"][0])
  assert checkpoints.Checkpointer(trained / "a").all_steps() == [3, 6]
  assert (trained / "a" / "config.gin").is_file()
  assert (trained / "a" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert any((trained / "a" / "tensorboard" / "train").iterdir())


def test_a_preempted_run_logs_its_last_partial_window(tmp_path, monkeypatch, embedded_cache):
  """SIGTERM between two log steps: the trainer saves and logs the steps since the last row (their time counts
  in a resumed run's total, repro cogs' training_seconds)."""
  from remixer_t5.training import trainer

  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  polls = []
  monkeypatch.setattr(
    trainer._StopWatch,
    "requested",
    lambda self: polls.append(1) or ("preempted (SIGTERM)" if len(polls) >= 3 else None),
  )
  assert _train(tmp_path / "p", 8, "--gin.LOG_PERIOD=5", "--gin.EVAL_PERIOD=0") == 0
  train = [r for r in _rows(tmp_path / "p") if r["split"] == "train"]
  assert [r["step"] for r in train] == [3] and train[0]["window_seconds"] > 0
  assert train[0]["steps_per_s"] * train[0]["window_seconds"] == pytest.approx(3)
  assert checkpoints.Checkpointer(tmp_path / "p").latest_step() == 3


def test_resume_reaches_the_same_parameters_as_an_uninterrupted_run(
  trained, uninterrupted, monkeypatch, embedded_cache
):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  assert _train(trained / "a", 8) == 0  # resumes from step 6
  a = checkpoints.restore_any_params(trained / "a")
  b = checkpoints.restore_any_params(uninterrupted)
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
  assert [r["step"] for r in _rows(trained / "a") if r["split"] == "train"] == [2, 4, 6, 8]


def test_gradient_accumulation_trains_like_the_whole_batch(trained, uninterrupted, monkeypatch, embedded_cache):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  assert (
    _train(
      trained / "acc",
      4,
      "--gin.run_config.Training.num_microbatches=2",
      "--gin.run_config.Training.peak_flops_per_device=1e12",
    )
    == 0
  )
  whole = [r for r in _rows(uninterrupted) if r["split"] == "train"][:2]
  accumulated = [r for r in _rows(trained / "acc") if r["split"] == "train"]
  assert [r["step"] for r in accumulated] == [2, 4]
  for a, w in zip(accumulated, whole):
    assert a["loss"] == pytest.approx(w["loss"], rel=1e-5)
    assert 0 < a["mfu"] < 1  # the model's FLOPs against the overridden 1 TFLOP/s peak
    assert "hfu" not in a  # XLA counts the microbatch loop's body once: no whole-step hardware count
  assert all("mfu" not in r for r in whole)  # a CPU has no peak in the table


def test_incompatible_config_in_same_model_dir_is_refused(trained, capsys, monkeypatch, embedded_cache):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  before = checkpoints.Checkpointer(trained / "a").all_steps()
  config_before = (trained / "a" / "config.gin").read_text()
  assert _train(trained / "a", 12, "--gin.network.T5Config.num_heads=2") == 2
  err = capsys.readouterr().err
  assert "config.num_heads" in err and "4" in err and "2" in err
  assert checkpoints.Checkpointer(trained / "a").all_steps() == before
  assert (trained / "a" / "config.gin").read_text() == config_before


def test_eval_command_writes_validation_metrics(trained, capsys, monkeypatch, embedded_cache):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  n = len(_rows(trained / "a"))
  assert cli.main(["eval", *SMALL_RUN, f"--gin.MODEL_DIR={trained / 'a'}"]) == 0
  metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  rows = _rows(trained / "a")
  latest = checkpoints.Checkpointer(trained / "a").latest_step()
  assert len(rows) == n + 1 and rows[-1]["split"] == "validation" and rows[-1]["step"] == latest
  assert metrics["validation"]["loss"] == pytest.approx(rows[-1]["loss"])


def test_export_then_import_hf_round_trips_params(trained, tmp_path):
  hf_dir, back = tmp_path / "hf", tmp_path / "imported"
  assert cli.main(["export-hf", str(trained / "a"), str(hf_dir)]) == 0
  assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
  assert cli.main(["import-hf", str(hf_dir), str(back)]) == 0
  original = checkpoints.restore_any_params(trained / "a")
  imported = checkpoints.restore_any_params(back)
  jax.tree_util.tree_map(np.testing.assert_array_equal, original, imported)
  # The written model.gin describes the same model.
  gin_utils.parse_gin([str(back / "model.gin")], [])
  assert gin_utils.macro("MODEL").module.config.emb_dim == 32


T5_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"


@pytest.mark.skipif(not T5_VOCAB.exists(), reason=f"real T5 vocabulary not found at {T5_VOCAB}")
def test_a_config_can_name_a_real_vocabulary(tmp_path, capsys, monkeypatch, embedded_cache):
  from remixer_t5.data import input_pipeline, vocab
  from remixer_t5.tasks import lookup as task_lookup

  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  task = task_lookup.get_task("embedded_span_corruption", vocab.get_vocabulary(str(T5_VOCAB)))
  assert task.output_features["inputs"].vocabulary.vocab_size == 32100
  batch = next(
    input_pipeline.get_batches(
      task, {"inputs": 64, "targets": 16}, "validation", 2, seed=0, shuffle=False, repeat=False, pack=False
    )
  )
  assert batch["encoder_input_tokens"].max() > 2100  # T5 ids, e.g. its sentinels from 32099 down
  # The tiny model's 2,176-row embedding cannot hold that vocabulary: a clear refusal, nothing written.
  code = _train(
    tmp_path / "run", 2, "--gin.VOCABULARY=@vocab.get_vocabulary()", f"--gin.vocab.get_vocabulary.path='{T5_VOCAB}'"
  )
  assert code == 2
  err = capsys.readouterr().err
  assert "32100" in err and "2176" in err
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_initialisers_rng_form_is_chosen_by_the_builder_and_scoped_to_its_thread():
  """programs.build decides whether the initialiser draws its bits with jax's GPU threefry kernel (`init_rng`:
  'auto' only where the state is whole on every device) and `Program.init_state` turns jax's option on for that
  call, in this thread only, and off after, also when the call raises (its GPU lowering is checked on a
  deviceless H100 in tests/test_compile_gpu.py)."""
  import dataclasses
  import threading

  from jax._src import config as jax_config

  from remixer_t5.model import models
  from remixer_t5.training import optim, partitioning, programs

  option = jax_config.threefry_gpu_kernel_lowering
  before = option.value

  class Sharded:  # a sharding that splits a value over devices (fsdp or model rules)
    is_fully_replicated = False

  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  assert programs.init_rng_kernel("auto", {"w": cpu, "b": cpu})
  assert not programs.init_rng_kernel("auto", {"w": Sharded(), "b": cpu})
  assert programs.init_rng_kernel("kernel", {"w": Sharded()}) and not programs.init_rng_kernel("inline", {"w": cpu})
  with pytest.raises(ValueError, match="init_rng='gpu'"):
    programs.init_rng_kernel("gpu", {})

  model = models.EncoderDecoderModel(
    models.from_gin(
      "models/t5_1_1/tiny.gin", "network.T5Config.num_encoder_layers=1", "network.T5Config.num_decoder_layers=1"
    )
  )
  part = partitioning.partitioner(None, jax.devices()[:1])
  prog = programs.build(model, programs.make_tx(model, optim.adafactor, 1e-2), {"inputs": 8, "targets": 4}, part)
  assert prog.init_rng_kernel  # one device: the state is whole
  assert not programs.build(
    model, programs.make_tx(model), {"inputs": 8, "targets": 4}, part, init_rng="inline"
  ).init_rng_kernel
  seen = []

  def init(rng):  # records the option when the initialiser is traced, here and in another thread
    other = threading.Thread(target=lambda: seen.append(("other thread", option.value)))
    other.start()
    other.join()
    seen.append(("tracing", option.value))
    return rng

  traced = dataclasses.replace(prog, init=jax.jit(init))
  traced.init_state(0)
  assert seen == [("other thread", before), ("tracing", True)] and option.value is before
  boom = dataclasses.replace(prog, init=lambda rng: (_ for _ in ()).throw(RuntimeError("boom")))
  with pytest.raises(RuntimeError, match="boom"):
    boom.init_state(0)
  assert option.value is before
