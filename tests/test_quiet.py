"""Start-up output: TensorFlow's native start-up lines are hidden unless $REMIXER_T5_VERBOSE is set."""

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    from remixer_t5 import quiet
    quiet.configure()
    import tensorflow as tf
    print(tf.data.Dataset.range(3).reduce(tf.constant(0, tf.int64), lambda a, b: a + b).numpy())  # TF's devices are set up here
    print("gpus visible to tf:", len(tf.config.get_visible_devices("GPU")))
""")


def _run(code, **env):
  full = {**os.environ, **env}
  full.pop("TF_CPP_MIN_LOG_LEVEL", None) if "TF_CPP_MIN_LOG_LEVEL" not in env else None
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


@pytest.mark.integration
def test_tensorflow_start_up_lines_are_hidden_unless_verbose():
  loud = _run(PROBE, REMIXER_T5_VERBOSE="1")
  quiet = _run(PROBE)
  assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
  assert quiet.stdout == loud.stdout and "3\n" in quiet.stdout  # the same work was done
  assert "gpus visible to tf: 0" in quiet.stdout
  noise = [line for line in loud.stderr.splitlines() if line.strip()]
  if not noise:
    pytest.skip("TensorFlow printed nothing at start-up on this machine; nothing to hide")
  assert quiet.stderr.strip() == "", quiet.stderr


def test_a_failing_tensorflow_import_shows_what_it_printed(tmp_path):
  fake = tmp_path / "tensorflow"
  fake.mkdir()
  (fake / "__init__.py").write_text(
    "import os\nos.write(2, b'native: libfoo.so missing\\n')\nraise ImportError('broken tensorflow')\n"
  )
  code = "from remixer_t5 import quiet\nquiet.configure()\nimport tensorflow\n"
  out = _run(code, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  assert out.returncode != 0
  assert "native: libfoo.so missing" in out.stderr and "broken tensorflow" in out.stderr


def test_cli_prints_only_its_own_lines_at_start_up():
  out = subprocess.run(
    [sys.executable, "-m", "remixer_t5", "tasks"],
    capture_output=True,
    text=True,
    env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"},
    timeout=300,
  )
  assert out.returncode == 0, out.stderr
  for needle in ("absl::InitializeLog", "oneDNN", "cudart_stub", "cuInit", "libtpu", "TPU accelerator type"):
    assert needle not in out.stderr, out.stderr


def test_a_train_its_resume_and_a_params_restore_log_nothing_from_absl_orbax_or_asyncio(
  tmp_path, embedded_env, caplog, capsys
):
  """orbax logs through absl ("Metadata file does not exist" at every params restore); the CLI's filters
  (quiet.quiet_logs) drop those records and asyncio's before any handler sees them."""
  import logging

  from remixer_t5 import cli
  from remixer_t5.training import checkpoints

  run = [
    "train",
    "--gin_file=models/t5_1_1/tiny.gin",
    "--gin_file=runs/demo.gin",
    "--gin.BATCH_SIZE=2",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
    "--gin.LOG_PERIOD=2",
    "--gin.EVAL_PERIOD=0",
    "--gin.CHECKPOINT_PERIOD=2",
    "--gin.network.T5Config.emb_dim=32",
    "--gin.network.T5Config.mlp_dim=48",
    "--gin.network.T5Config.num_encoder_layers=1",
    "--gin.network.T5Config.num_decoder_layers=1",
    f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
  ]
  caplog.set_level(logging.WARNING)  # what a user's stderr shows (the root logger's level)
  assert cli.main([*run, "--gin.TRAIN_STEPS=2"]) == 0
  assert cli.main([*run, "--gin.TRAIN_STEPS=3"]) == 0
  checkpoints.restore_any_params(tmp_path / "run")  # what infer, export-hf and plot read
  assert "resumed from" in capsys.readouterr().out
  foreign = [
    f"{r.name}: {r.getMessage()}"
    for r in caplog.records
    if r.levelno >= logging.WARNING and (r.name in ("absl", "asyncio") or r.name.startswith("orbax"))
  ]
  assert not foreign, foreign
  err = capsys.readouterr().err
  assert "absl" not in err and "asyncio" not in err, err
