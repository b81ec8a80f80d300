"""Only train and eval need MODEL_DIR: info and tasks take a run's gin files (MODEL_DIR = %gin.REQUIRED) as is."""

import json

import pytest

from remixer_t5 import cli, gin_utils

RUN = ["--gin_file=models/t5_1_1/tiny.gin", "--gin_file=runs/cogs.gin"]


def test_info_with_a_run_gin_needs_no_model_dir(capsys):
  assert cli.main(["info", *RUN, "--json"]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  # cogs.gin's TASK_FEATURE_LENGTHS reached info: the run's files were read, not skipped.
  assert report["feature_lengths"] == gin_utils.macro("TASK_FEATURE_LENGTHS")
  assert gin_utils.macro("MODEL_DIR") is None
  assert report["params"] > 0


def test_info_keeps_a_given_model_dir(capsys):
  assert cli.main(["info", *RUN, "--gin.MODEL_DIR='/tmp/somewhere'", "--json"]) == 0
  assert gin_utils.macro("MODEL_DIR") == "/tmp/somewhere"


def test_tasks_with_a_run_gin_needs_no_model_dir(capsys):
  assert cli.main(["tasks", *RUN]) == 0
  assert "cogs" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "eval"])
def test_train_and_eval_still_require_model_dir(capsys, command):
  assert cli.main([command, *RUN]) == 2
  err = capsys.readouterr().err
  assert "require MODEL_DIR" in err and "--gin.MODEL_DIR=" in err


def test_macro_defaults_bind_only_macros_the_files_define():
  gin_utils.parse_gin(["models/t5_1_1/tiny.gin"], [], macro_defaults={"MODEL_DIR": "None"})
  assert gin_utils.macro("MODEL_DIR", default="absent") == "absent"  # not invented where no file defines it


@pytest.mark.parametrize("given", ["gs://bucket/run", "runs/here", None])
def test_a_runs_folder_is_made_a_path_once_in_the_run_config(given):
  """run_config.Run.model_dir is the run-path type (etils.epath: local or gs://) as soon as the run is built, so
  nothing downstream converts it again; an unset MODEL_DIR stays None."""
  from etils import epath

  from remixer_t5.training import run_config

  gin_utils.parse_gin(["models/t5_1_1/tiny.gin", "runs/cogs.gin"], [f"MODEL_DIR={given!r}"])
  model_dir = run_config.from_gin().model_dir
  if given is None:
    assert model_dir is None
  else:
    assert isinstance(model_dir, epath.Path) and model_dir.as_posix().endswith(given)
