"""Mirror a training run's metrics rows to an experiment tracker: Weights & Biases (the `wandb` extra).

Tracking is on when a W&B project is named: `WANDB_PROJECT` in the environment, or a gin binding
(`tracking.Wandb.project = 'my-project'` in a gin file that imports `remixer_t5.training.tracking`). The group is
`tracking.Wandb.group`, else W&B's own `WANDB_RUN_GROUP`; the `sweep` command sets `WANDB_RUN_GROUP` for its
points, so a sweep's runs share a group. The entity is `tracking.Wandb.entity`, else W&B's `WANDB_ENTITY` or the
login's default. Everything else (`WANDB_MODE=offline`, `WANDB_DIR` for W&B's own files, default `./wandb`) is
W&B's. Only `train` tracks, in process 0: `metrics_log.MetricsLogger.start` opens the run, `write` mirrors each
row, `close` finishes it.

One MODEL_DIR is one W&B run: its id is kept in `MODEL_DIR/wandb_run_id`, named after MODEL_DIR's basename, and
every launch resumes it (`resume="allow"`). The run's config is MODEL_DIR/config.gin (the launch's whole gin
config, `gin.config_str()`, not only the operative part) as a flat dict `binding -> value`: a number, string,
bool or None where the value text is that Python literal, else the value text (`@network.Transformer()`).

Steps. A resumed run logs again the steps after the checkpoint it restored, and W&B keeps one history per run
whose own step (`_step`) only grows. So rows are logged without W&B's step, which counts them, and carry the
train step as the value `step` (every metric plotted against it: `define_metric`) and the launch's `attempt`
(metrics.jsonl's). A step logged twice is in the history twice, each row with its attempt; as in metrics.jsonl,
the later attempt's row is the current one. The W&B history is therefore metrics.jsonl's rows, row for row
(less its `start` rows and decoded examples)."""

from __future__ import annotations

import ast
import dataclasses
import os
import secrets
import string
import sys
from typing import Any, Mapping

import gin

from remixer_t5 import storage

RUN_ID_FILE = "wandb_run_id"
CONFIG_FILE = "config.gin"  # written by the trainer before the logger starts


@dataclasses.dataclass(frozen=True)
class Wandb:
  """The W&B settings a gin file may bind; None leaves each to W&B's environment variable (module docstring)."""

  project: str | None = None
  group: str | None = None
  entity: str | None = None


def settings() -> Wandb:
  """The W&B settings of this process: the gin bindings of `Wandb`, each unset one from W&B's variable."""
  try:
    bound = gin.get_configurable(Wandb)()
  except ValueError:  # no gin file binds it
    bound = Wandb()
  return Wandb(
    project=bound.project or os.environ.get("WANDB_PROJECT") or None,
    group=bound.group or os.environ.get("WANDB_RUN_GROUP") or None,
    entity=bound.entity or os.environ.get("WANDB_ENTITY") or None,
  )


def gin_bindings(config_text: str) -> dict[str, Any]:
  """A gin config's bindings as `name -> value`: scalar literals as their values, anything else as its text.

  Reads what `gin.config_str()` writes: one binding per line from column 0, a long value continued on indented
  lines after a trailing backslash; comments and imports are skipped."""
  statements: list[list[str]] = []
  for line in config_text.splitlines():
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    if line[0].isspace() and statements:
      statements[-1].append(line.strip())
    elif not line.startswith(("import ", "from ", "include ")):
      statements.append([line.strip()])
  bindings = {}
  for parts in statements:
    name, eq, value = " ".join(p.removesuffix("\\").strip() for p in parts).partition("=")
    if eq:
      bindings[name.strip()] = _value(value.strip())
  return bindings


def _value(text: str):
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text
  return value if value is None or isinstance(value, (bool, int, float, str)) else text


class Tracker:
  """One launch's W&B run (module docstring): `log` each row, `close` at the end."""

  def __init__(self, run: Any):
    self._run = run
    run.define_metric("step")
    run.define_metric("*", step_metric="step")

  @property
  def id(self) -> str:
    return self._run.id

  def log(self, step: int, split: str, row: Mapping[str, float], attempt: int | None) -> None:
    """The row's values as `<split>/<key>`, with the train `step` and the launch's `attempt`."""
    values: dict[str, float | int] = {f"{split}/{k}": float(v) for k, v in row.items()}
    values["step"] = int(step)
    if attempt is not None:
      values["attempt"] = int(attempt)
    self._run.log(values)

  def close(self) -> None:
    """Finish the W&B run: failed (exit code 1) when closed while an exception propagates, else finished."""
    self._run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


def from_environment(model_dir: str) -> Tracker | None:
  """The run's tracker when a W&B project is named (module docstring), None otherwise; an ImportError when one
  is named and wandb is not installed."""
  chosen = settings()
  if not chosen.project:
    return None
  try:
    import wandb  # the optional `wandb` extra: imported here only, when tracking is asked for
  except ImportError as e:
    raise ImportError(
      f"W&B tracking is on (project {chosen.project!r}) and wandb is not installed: "
      "pip install -e '.[wandb]' (or unset WANDB_PROJECT)"
    ) from e
  folder = storage.run_path(model_dir)
  id_file = folder / RUN_ID_FILE
  if id_file.exists():
    run_id = id_file.read_text().strip()
  else:
    # 8 lowercase letters and digits, as W&B's own ids
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    storage.write_text(id_file, run_id + "\n")
  config_file = folder / CONFIG_FILE
  config = gin_bindings(config_file.read_text()) if config_file.exists() else {}
  run = wandb.init(
    project=chosen.project, entity=chosen.entity, group=chosen.group, id=run_id, name=folder.name, resume="allow"
  )
  run.config.update(config, allow_val_change=True)  # a resumed launch may change what may change
  return Tracker(run)
