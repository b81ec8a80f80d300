"""Bad invocations end in one line and a documented exit code (docs/cli.md, "Exit codes"), never a traceback.

The table runs `cli.main` in-process, each row failing before anything is compiled; the causes that arise
mid-run (a non-finite loss, storage, memory, an interrupt) come from a stand-in for `trainer.train` that raises
what the real one raises. One row runs a process, for the exit status the shell sees."""

import os
import re
import socket
import subprocess
import sys

import pytest

from remixer_t5 import cli, storage
from remixer_t5.commands import errors
from remixer_t5.training import checkpoints

TINY = ["--gin_file=models/t5_1_1/tiny.gin", "--gin_file=runs/demo.gin"]
START_LINE = re.compile(r"^remixer-t5 \w+: \d+ \w+ device\(s\)")  # the one line a run starts with (_start_line)


class Locked(RuntimeError):
  """An error of the project's own that carries its exit code (as the run-directory lock's does)."""

  exit_code = 75


def _raises(error):
  def train(*args, **kwargs):
    raise error

  return train


def _out_of_memory(*args, **kwargs):
  import jax.numpy as jnp

  jnp.zeros((1 << 42,), jnp.float32).block_until_ready()  # 16 TiB: XLA's own RESOURCE_EXHAUSTED


MULTI_LINE = checkpoints.IncompatibleModelDirError(
  "MODEL_DIR /tmp/run holds a run with a different configuration; refusing to mix them:\n"
  "  config.emb_dim: 32 in /tmp/run/run_signature.json vs 48 now\nUse a new MODEL_DIR (or delete the old run)."
)
PYBIND = ValueError(
  "OUT_OF_RANGE: Error reading \"step/.zarray\": byte range [0, 6486) is not valid for value of "
  "size 100 [tensorstore_spec='{\"driver\":\"zarr\",\"kvstore\":{\"path\":\"/tmp/x\"}}'] "
  "[source locations='tensorstore/kvstore/file/file_key_value_store.cc:412']"
)

# (id, argv ({tmp}: the row's folder), exit code, a word naming the cause, a stand-in for trainer.train or None)
ROWS = [
  # train: the configuration
  (
    "misspelled-configurable",
    ["train", *TINY, "--gin.run_config.Trainng.random_seed=3", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "did you mean run_config.Training?",
    None,
  ),
  (
    "misspelled-parameter",
    ["train", *TINY, "--gin.network.T5Config.emb_dimm=3", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "did you mean emb_dim?",
    None,
  ),
  (
    "misspelled-macro",
    ["train", *TINY, "--gin.TRAIN_STEPZ=3", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "did you mean TRAIN_STEPS?",
    None,
  ),
  ("unknown-macro-reference", ["train", *TINY, "--gin.MODEL=%MODLE", "--gin.MODEL_DIR='{tmp}/r'"], 2, "%MODLE", None),
  (
    "bad-value-type",
    ["train", *TINY, "--gin.BATCH_SIZE=eight", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "run_config.Data.batch_size (the macro BATCH_SIZE) = 'eight': expected an integer",
    None,
  ),
  ("zero-log-period", ["train", *TINY, "--gin.LOG_PERIOD=0", "--gin.MODEL_DIR='{tmp}/r'"], 2, "log_period", None),
  (
    "lengths-without-targets",
    ["train", *TINY, "--gin.TASK_FEATURE_LENGTHS={{'inputs': 32}}", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "lacks ['targets']",
    None,
  ),
  (
    "train-steps-below-warmup",
    [
      "train",
      "--gin_file=models/t5_1_1/tiny.gin",
      "--gin_file=runs/pretrain_nanot5.gin",
      "--gin.TRAIN_STEPS=80",
      "--gin.MODEL_DIR='{tmp}/r'",
    ],
    2,
    "warmup_steps=10000",
    None,
  ),
  (
    "broken-binding",
    ["train", *TINY, "--gin.network.T5Config.emb_dim=(3", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "not a gin value",
    None,
  ),
  (
    "missing-run-file",
    ["train", "--gin_file=models/t5_1_1/tiny.gin", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "add a run config",
    None,
  ),
  (
    "missing-model-file",
    ["train", "--gin_file=runs/demo.gin", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "pass a model config",
    None,
  ),
  ("no-such-gin-file", ["train", "--gin_file=models/t5_1_1/nope.gin"], 2, "nope.gin", None),
  ("no-model-dir", ["train", *TINY], 2, "MODEL_DIR", None),
  ("model-dir-is-a-file", ["train", *TINY, "--gin.MODEL_DIR='{tmp}/a_file'"], 2, "is a file", None),
  (
    "unknown-task",
    ["train", *TINY, "--gin.MIXTURE_OR_TASK_NAME='no_such_task'", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "no_such_task",
    None,
  ),
  ("unknown-flag", ["train", *TINY, "--bogus"], 2, "unrecognized arguments: --bogus", None),
  (
    "objective-without-files",
    ["train", *TINY, "--objective=span_corruption", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "--objective",
    None,
  ),
  (
    "train-file-missing",
    ["train", *TINY, "--train_file={tmp}/none.tsv", "--validation_file={tmp}/none.tsv", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "none.tsv",
    None,
  ),
  # train: what stops a run once it is going
  (
    "non-finite-loss",
    ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"],
    3,
    "non-finite",
    _raises(
      FloatingPointError(
        "non-finite loss or update between steps 4 and 6 (loss nan); stopped without "
        "saving. The last good checkpoint is 4 in /tmp/run/checkpoints"
      )
    ),
  ),
  (
    "storage-error",
    ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"],
    4,
    "did not answer",
    _raises(storage.StorageError("MODEL_DIR gs://b/run: Cloud Storage did not answer for gs://b; retry")),
  ),
  (
    "disk-full",
    ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"],
    4,
    "No space left on device",
    _raises(OSError(28, "No space left on device", "/tmp/run/checkpoints")),
  ),
  (
    "storage-client-error",
    ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"],
    4,
    "UNAVAILABLE",
    _raises(RuntimeError("UNAVAILABLE: Connection reset by peer")),
  ),
  ("out-of-memory", ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"], 5, "RESOURCE_EXHAUSTED", _out_of_memory),
  ("interrupted", ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"], 130, "interrupted", _raises(KeyboardInterrupt())),
  (
    "own-exit-code",
    ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"],
    75,
    "locked",
    _raises(Locked("MODEL_DIR /tmp/run is locked by process 12 on host a")),
  ),
  ("refused-model-dir", ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"], 2, "config.emb_dim", _raises(MULTI_LINE)),
  (
    "pybind-repr",
    ["train", *TINY, "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "is not valid for value of size 100",
    _raises(PYBIND),
  ),
  # eval
  ("eval-empty-model-dir", ["eval", *TINY, "--gin.MODEL_DIR='{tmp}/empty'"], 2, "no checkpoint", None),
  (
    "eval-without-run-file",
    ["eval", "--gin_file=models/t5_1_1/tiny.gin", "--gin.MODEL_DIR='{tmp}/r'"],
    2,
    "add a run config",
    None,
  ),
  ("eval-without-config", ["eval"], 2, "needs a config", None),
  # infer
  ("infer-without-checkpoint", ["infer", *TINY, "--gin.MODEL_DIR='{tmp}/none'"], 2, "no checkpoint", None),
  ("infer-missing-checkpoint", ["infer", *TINY, "--checkpoint={tmp}/none"], 2, "--checkpoint", None),
  ("infer-missing-inputs", ["infer", *TINY, "--checkpoint={tmp}/full", "--inputs={tmp}/none.txt"], 2, "none.txt", None),
  ("infer-bad-beam-size", ["infer", *TINY, "--beam_size=two"], 2, "invalid int value", None),
  # compile
  ("compile-unknown-topology", ["compile", *TINY, "--topology", "v9-8"], 2, "v9-8", None),
  ("compile-without-topology", ["compile", *TINY], 2, "--topology", None),
  ("compile-without-config", ["compile", "--topology", "v3-8"], 2, "needs a config", None),
  # import-hf
  ("import-hf-missing-folder", ["import-hf", "{tmp}/no_hf", "{tmp}/out"], 2, "does not exist", None),
  ("import-hf-into-non-empty", ["import-hf", "{tmp}/no_hf", "{tmp}/full"], 2, "not empty", None),
  ("import-hf-into-a-file", ["import-hf", "{tmp}/no_hf", "{tmp}/a_file"], 2, "is a file", None),
  # tasks
  ("tasks-unknown-name", ["tasks", "no_such_task"], 2, "no_such_task", None),
  ("tasks-unknown-split", ["tasks", "cogs", "--split", "nosplit"], 2, "nosplit", None),
  ("tasks-bad-lengths", ["tasks", "cogs", "--lengths", "abc"], 2, "--lengths abc", None),
  ("tasks-zero-lengths", ["tasks", "cogs", "--lengths", "0,8"], 2, "--lengths 0,8", None),
  # elsewhere
  (
    "model-config-bad-type",
    ["info", "--gin_file=models/t5_1_1/tiny.gin", "--gin.network.T5Config.emb_dim=abc"],
    2,
    "T5Config.emb_dim = 'abc': expected an integer",
    None,
  ),
  (
    "model-config-bad-dropout",
    ["info", "--gin_file=models/t5_1_1/tiny.gin", "--gin.network.T5Config.dropout_rate='abc'"],
    2,
    "T5Config.dropout_rate = 'abc': expected a number",
    None,
  ),
  ("info-bad-lengths", ["info", "--gin_file=models/t5_1_1/tiny.gin", "--lengths", "x"], 2, "--lengths x", None),
  ("bench-unknown-mixer", ["bench", "mixing", "--mixers", "attention,nosuch"], 2, "unknown mixer(s) nosuch", None),
  ("unknown-command", ["trian"], 2, "invalid choice: 'trian'", None),
]


@pytest.fixture
def folder(tmp_path):
  (tmp_path / "a_file").write_text("not a folder")
  (tmp_path / "empty").mkdir()
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "something").write_text("x")
  return tmp_path


def _error_lines(err: str) -> list[str]:
  return [line for line in err.splitlines() if line.strip() and not START_LINE.match(line)]


def _main(argv):
  try:
    return cli.main(argv)
  except SystemExit as e:  # argparse's own errors
    return e.code


@pytest.mark.parametrize("argv, code, word, train", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_a_bad_invocation_is_one_line_and_its_exit_code(
  argv, code, word, train, folder, embedded_env, capsys, monkeypatch
):
  monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
  if train is not None:
    from remixer_t5.training import trainer

    monkeypatch.setattr(trainer, "train", train)
  capsys.readouterr()
  assert _main([a.format(tmp=folder) for a in argv]) == code
  err = capsys.readouterr().err
  lines = _error_lines(err)
  assert len(lines) == 1 and lines[0].startswith("remixer-t5: error: "), err
  assert "Traceback" not in err and word in lines[0], err
  assert "tensorstore_spec" not in err and "source locations" not in err


def test_at_least_thirty_rows_across_the_commands():
  assert len(ROWS) >= 30
  assert {"train", "eval", "infer", "compile", "import-hf", "tasks"} <= {row[1][0] for row in ROWS}


def test_the_traceback_variable_shows_the_traceback_behind_the_line(embedded_env, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
  capsys.readouterr()
  assert cli.main(["train", *TINY, "--gin.BATCH_SIZE=eight", f"--gin.MODEL_DIR='{tmp_path}'"]) == 2
  err = capsys.readouterr().err
  assert "Traceback (most recent call last)" in err and "__post_init__" in err, err
  assert err.strip().splitlines()[-1].startswith("remixer-t5: error: run_config.Data.batch_size"), err


def test_an_unexpected_error_keeps_its_traceback(embedded_env, tmp_path, monkeypatch):
  """A bug is not a bad invocation: it is raised as it is (the interpreter prints it, exit 1)."""
  from remixer_t5.training import trainer

  monkeypatch.setattr(trainer, "train", _raises(AttributeError("'NoneType' object has no attribute 'shape'")))
  with pytest.raises(AttributeError, match="shape"):
    cli.main(["train", *TINY, f"--gin.MODEL_DIR='{tmp_path}'"])


def test_an_unreachable_default_vocabulary_names_the_file_and_the_fix(monkeypatch):
  """T5's vocabulary is read from gs://t5-data on first use; where that fails (no network here) the error names
  the file and $REMIXER_T5_VOCAB."""
  from remixer_t5.data import vocab

  try:
    socket.getaddrinfo("www.googleapis.com", 443)
    pytest.skip("Cloud Storage resolves on this machine: the default vocabulary is reachable")
  except OSError:
    pass
  monkeypatch.delenv(vocab.T5_VOCAB_ENV_VAR, raising=False)
  with pytest.raises(vocab.VocabularyUnavailable) as info:
    vocab.t5_vocabulary().vocab_size  # noqa: B018 - the first use reads the model
  message = str(info.value)
  assert vocab.T5_VOCAB_PATH in message and "$REMIXER_T5_VOCAB" in message and "\n" not in message
  assert errors.exit_code(info.value) == 2


def test_a_process_exits_with_the_code_and_one_line(tmp_path):
  """What the shell sees: the status and stderr of `python -m remixer_t5` (start-up lines hidden too)."""
  out = subprocess.run(
    [sys.executable, "-m", "remixer_t5", "train", *TINY, "--gin.BATCH_SIZE=eight", f"--gin.MODEL_DIR='{tmp_path}'"],
    capture_output=True,
    text=True,
    timeout=300,
    env={k: v for k, v in os.environ.items() if k != errors.TRACEBACK_ENV},
  )
  assert out.returncode == 2, out.stderr
  assert out.stderr.splitlines() == [
    "remixer-t5: error: run_config.Data.batch_size (the macro BATCH_SIZE) = 'eight': expected an integer >= 1"
  ], out.stderr
