"""A run's settings: what is trained, on which data, and when it checkpoints, logs and evaluates.

Four small frozen dataclasses, bound once per run file in gin (gin/runs/pretrain.gin) and read by every command
that builds the run: `train`, `eval`, `compile`, `bench` and the scripts (`from_gin`). The macros users write
keep their names, each bound once to its field (gin_names.MACROS: BATCH_SIZE -> Data.batch_size, ...); the rest
are bound by their field (`--gin.run_config.Training.num_microbatches=4`). What a run file used to bind on
`trainer.train` / `trainer.evaluate_checkpoint` is refused with the field to bind instead (gin_names.MOVED).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any, Callable, Mapping

import gin
import optax

from remixer_t5 import storage
from remixer_t5.gin_utils import GinError, gin_dir
from remixer_t5.gin_names import MACROS
from remixer_t5.training import best, optim
from remixer_t5.training.partitioning import MeshSpec
from remixer_t5.training.profiling import parse_steps


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(part, name: str, minimum: int | None = None, optional: bool = False) -> None:
  """ValueError naming the binding and its value unless `part.name` is an integer >= `minimum` (or None where
  `optional`): a string or float there would otherwise fail far from its binding, or not at all."""
  value = getattr(part, name)
  if (optional and value is None) or (_is_int(value) and (minimum is None or value >= minimum)):
    return
  want = "an integer" + ("" if minimum is None else f" >= {minimum}") + (" or None" if optional else "")
  raise ValueError(f"run_config.{_where(type(part).__name__, name)} = {value!r}: expected {want}")


@dataclasses.dataclass(frozen=True)
class Training:
  """What is trained and how: the model, its optimizer and schedule, where its parameters start, the mesh.

  `optimizer`: a factory, learning_rate -> optax transformation (optim.adafactor), that programs.make_tx makes
  the run's `tx` with. `learning_rate`: a float or a schedule (step -> rate; logged each step). `init_checkpoint`:
  parameters to start from (a training MODEL_DIR, an import-hf output or a t5x checkpoint), with a fresh optimizer
  state. `num_microbatches`: gradient accumulation (memory), the same gradient as the whole batch. `mesh`:
  `partitioning.mesh_spec(...)` (None: every device on 'data', t5x's standard rules). `peak_flops_per_device`: the
  MFU's peak where the device is not in mfu.py's table."""

  model: Any
  optimizer: Callable[..., optax.GradientTransformation] = optim.adafactor
  learning_rate: Callable | float | None = None
  random_seed: int = 0
  init_checkpoint: str | None = None
  num_microbatches: int | None = None
  mesh: MeshSpec | None = None
  peak_flops_per_device: float | None = None

  def __post_init__(self):
    if self.model is None:
      raise ValueError(
        "run_config.Training.model (the macro MODEL) is None: pass a model config, e.g. "
        "--gin_file=models/t5_1_1/small.gin"
      )
    _check_int(self, "random_seed")
    _check_int(self, "num_microbatches", minimum=1, optional=True)
    where = lambda name: f"run_config.{_where('Training', name)} = {getattr(self, name)!r}"
    if not (self.learning_rate is None or callable(self.learning_rate) or _is_number(self.learning_rate)):
      raise ValueError(f"{where('learning_rate')}: expected a number or a schedule (e.g. @optim.rsqrt_schedule())")
    if not (self.peak_flops_per_device is None or _is_number(self.peak_flops_per_device)):
      raise ValueError(f"{where('peak_flops_per_device')}: expected a number of FLOP/s or None")
    if not (self.init_checkpoint is None or isinstance(self.init_checkpoint, str)):
      raise ValueError(f"{where('init_checkpoint')}: expected a path (a string) or None")

  @property
  def schedule(self) -> Callable | None:
    return self.learning_rate if callable(self.learning_rate) else None


@dataclasses.dataclass(frozen=True)
class Data:
  """The examples: a seqio task or mixture, its lengths and the global batch. `vocabulary` swaps the task's
  (tasks/lookup.py); `data_dir`: local dataset release files (tasks/sources.py; None: $REMIXER_T5_DATA_DIR,
  else TFDS); `pack`: several examples a row where every mixer of the model can mix them exactly."""

  task: str
  feature_lengths: Mapping[str, int]
  batch_size: int
  vocabulary: Any = None
  data_dir: str | None = None
  pack: bool = True
  shuffle: bool = True

  def __post_init__(self):
    _check_int(self, "batch_size", minimum=1)
    lengths = self.feature_lengths
    example = "expected e.g. {'inputs': 512, 'targets': 114}"
    if not isinstance(lengths, Mapping):
      raise ValueError(f"run_config.{_where('Data', 'feature_lengths')} = {lengths!r}: {example}")
    object.__setattr__(self, "feature_lengths", dict(lengths))
    missing = {"inputs", "targets"} - set(self.feature_lengths)
    if missing:
      raise ValueError(f"TASK_FEATURE_LENGTHS={self.feature_lengths!r} lacks {sorted(missing)}; {example}")
    bad = {k: v for k, v in self.feature_lengths.items() if not _is_int(v) or v < 1}
    if bad:
      raise ValueError(
        f"TASK_FEATURE_LENGTHS={self.feature_lengths!r}: {', '.join(map(repr, bad))} must be a "
        f"positive integer; {example}"
      )
    if not self.task:
      raise ValueError(
        f"run_config.{_where('Data', 'task')} = {self.task!r}: expected a task or mixture name "
        "(remixer-t5 tasks lists them)"
      )


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When things happen: steps, checkpoints (every `checkpoint_period`, the last `keep_checkpoints` kept; None
  keeps all), the train log, the validation loss (`eval_steps` batches, `num_decoded_examples` decodes shown),
  and inference evaluation (every `infer_eval_period` steps, 0: never; of `infer_eval_task`, None: the task
  trained on, first `infer_examples` examples, None: all); `profile_steps` ('A:B'): a profiler trace of steps A
  to B under MODEL_DIR/profile/ (training/profiling.py); `keep_best_by`, `early_stop_patience`,
  `early_stop_min_delta`: the best checkpoint kept and early stopping (training/best.py)."""

  train_steps: int = 0
  checkpoint_period: int = 1000
  keep_checkpoints: int | None = 3
  log_period: int = 100
  eval_period: int = 1000
  eval_steps: int = 10
  num_decoded_examples: int = 3
  infer_eval_period: int = 0
  infer_eval_task: str | None = None
  infer_examples: int | None = None
  profile_steps: str | None = None
  keep_best_by: str | None = None
  early_stop_patience: int = 0
  early_stop_min_delta: float = 0.0

  def __post_init__(self):
    for name in ("train_steps", "eval_period", "eval_steps", "num_decoded_examples", "infer_eval_period"):
      _check_int(self, name, minimum=0)
    for name in ("log_period", "checkpoint_period"):  # every N steps: N >= 1
      _check_int(self, name, minimum=1)
    for name in ("keep_checkpoints", "infer_examples"):
      _check_int(self, name, minimum=1, optional=True)
    if self.profile_steps is not None:
      parse_steps(self.profile_steps, what="run_config.Schedule.profile_steps")
    _check_int(self, "early_stop_patience", minimum=0)
    if not _is_number(self.early_stop_min_delta) or self.early_stop_min_delta < 0:
      raise ValueError(
        f"{_where('Schedule', 'early_stop_min_delta')} = {self.early_stop_min_delta!r}: expected a number >= 0"
      )
    if self.keep_best_by is not None:
      best.parse(self.keep_best_by, what=_where("Schedule", "keep_best_by"))
    elif self.early_stop_patience:
      raise ValueError(
        f"{_where('Schedule', 'early_stop_patience')} = {self.early_stop_patience}: early stopping "
        "follows the KEEP_BEST_BY metric; bind it too (e.g. 'validation/loss:min')"
      )


@dataclasses.dataclass(frozen=True)
class Run:
  """One run: its directory (local or gs://; made a `storage.run_path` here, once) and its three parts."""

  training: Training
  data: Data
  schedule: Schedule = Schedule()
  model_dir: storage.Path | None = None

  def __post_init__(self):
    if self.model_dir:
      object.__setattr__(self, "model_dir", storage.run_path(self.model_dir))


def _where(cls: str, name: str) -> str:
  return f"{cls}.{name}" + (f" (the macro {MACROS[name]})" if name in MACROS else "")


def _no_run_config(what: str):
  """The error for a config without a run file: `what` it lacks, and the run files there are."""
  runs = sorted(p.name for p in (gin_dir() / "runs").glob("*.gin"))
  return GinError(
    f"the gin config binds no {what}: add a run config, e.g. --gin_file=runs/pretrain.gin beside "
    f"the model config; gin/runs/ holds {', '.join(runs)}"
  )


def from_gin() -> Run:
  """The run the parsed gin config binds (each class built with its gin bindings).

  A GinError when no run file was loaded (a class never registered with gin, or a field without a default left
  unbound); an error raised while a part is built (a bad value, a schedule's own check) propagates unchanged."""
  parts = {}
  for cls in (Training, Data, Schedule):
    try:
      make = gin.get_configurable(cls)
    except ValueError as e:  # never registered: no run file was loaded
      raise _no_run_config(f"run_config.{cls.__name__}") from e
    try:
      parts[cls.__name__.lower()] = make()
    except TypeError as e:  # a field without a default and without a binding
      m = re.search(r"No values supplied by Gin or caller for arguments: \[([^\]]*)\]", str(e))
      if not m:
        raise
      names = [n.strip(" '") for n in m.group(1).split(",")]
      raise _no_run_config(", ".join(f"run_config.{cls.__name__}.{n}" for n in names)) from e
  try:
    make_run = gin.get_configurable(Run)
  except ValueError:  # the run file binds no MODEL_DIR
    make_run = Run
  return make_run(**parts)
