"""remixer_t5/gin_names.py against the code it names: every run setting a run file once bound on the trainer's
functions names its run_config field, every macro a field, every moved module its place now; and the lines gin's
errors then carry."""

import dataclasses
import importlib

import pytest

from remixer_t5 import gin_utils
from remixer_t5.gin_names import MACROS, MOVED
from remixer_t5.training import run_config

# Old trainer parameters that are no field's name.
RENAMED = {
  "task_name": "run_config.Data.task",
  "infer_task": "run_config.Schedule.infer_eval_task",
  "mesh_shape": "run_config.Training.mesh (= @partitioning.mesh_spec())",
  "num_partitions": "partitioning.mesh_spec.num_partitions (with run_config.Training.mesh = @partitioning.mesh_spec())",
}


def _fields() -> dict[str, str]:
  """Each run setting's field name -> its binding (the Run's own fields but MODEL_DIR are the three parts)."""
  parts = (run_config.Training, run_config.Data, run_config.Schedule)
  out = {f.name: f"run_config.{cls.__name__}.{f.name}" for cls in parts for f in dataclasses.fields(cls)}
  return {**out, "model_dir": "run_config.Run.model_dir"}


def test_the_trainer_settings_table_is_run_config_s_fields():
  settings = {k[len("trainer.") :]: v for k, v in MOVED.items() if k.startswith("trainer.")}
  assert settings == {**_fields(), **RENAMED}
  assert {f.name for f in dataclasses.fields(run_config.Run)} == {"training", "data", "schedule", "model_dir"}


def test_every_macro_names_a_field():
  assert set(MACROS) <= set(_fields()), set(MACROS) - set(_fields())


@pytest.mark.parametrize("old", [k for k in MOVED if k.startswith("remixer_t5.")])
def test_every_moved_module_is_at_its_new_place(old):
  importlib.import_module(MOVED[old])
  with pytest.raises(ImportError):
    importlib.import_module(old)


@pytest.mark.parametrize(
  "binding, needle",
  [
    ("trainer.train.batch_size=8", "bind run_config.Data.batch_size (the macro BATCH_SIZE) instead"),
    ("trainer.evaluate_checkpoint.task_name='x'", "bind run_config.Data.task (the macro MIXTURE_OR_TASK_NAME)"),
    ("trainer.train.pack=False", "bind run_config.Data.pack instead"),
  ],
)
def test_a_run_setting_bound_on_the_trainer_is_told_its_field(binding, needle):
  with pytest.raises(gin_utils.GinError, match="trainer") as e:
    gin_utils.parse_gin(["models/t5_1_1/tiny.gin", "runs/pretrain.gin"], [binding])
  assert needle in str(e.value)


def test_an_unknown_trainer_parameter_gets_no_hint():
  with pytest.raises(gin_utils.GinError) as e:
    gin_utils.parse_gin(["models/t5_1_1/tiny.gin", "runs/pretrain.gin"], ["trainer.train.bogus=1"])
  assert "run_config" not in str(e.value)


def test_an_old_module_import_in_a_gin_file_is_told_the_new_one(tmp_path):
  (tmp_path / "old.gin").write_text("from __gin__ import dynamic_registration\nfrom remixer_t5 import bench_env\n")
  with pytest.raises(gin_utils.GinError, match="remixer_t5.bench_env has moved") as e:
    gin_utils.parse_gin([str(tmp_path / "old.gin")], [])
  assert "write `from remixer_t5.bench import env as bench_env`" in str(e.value)
