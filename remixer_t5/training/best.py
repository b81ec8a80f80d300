"""The best checkpoint by a named metric, early stopping, and T5's per-task-best SuperGLUE report.

`run_config.Schedule.keep_best_by` ('validation/loss:min', '<task>/<metric>:max'; the macro KEEP_BEST_BY) names
the metric: every evaluation that improves on it saves that step (if the schedule does not already) and records
it in `MODEL_DIR/best_checkpoint.json`; keep-N (`keep_checkpoints`) never deletes it. `early_stop_patience` P
(EARLY_STOP_PATIENCE; 0: off) stops the run after P evaluations in a row without an improvement of at least
`early_stop_min_delta` (EARLY_STOP_MIN_DELTA), saving the last step. The keeper's state (best step and value,
evaluations since) is saved in each checkpoint, so a resumed run goes on counting from its checkpoint.

`eval`, `infer`, `plot` and `export-hf` read the best step with `--checkpoint best` (`checkpoint_dir`).

T5 reports SuperGLUE per task at the checkpoint with the highest validation score for that task (Raffel et al.
2020, §3.1.2, "we report the ... performance on each task at the checkpoint ..."), the average of those beside
the single best checkpoint's average (`super_glue_protocol`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from remixer_t5 import storage

BEST_FILE = "best_checkpoint.json"
MODES = ("min", "max")


def parse(spec: str, what: str = "KEEP_BEST_BY") -> tuple[str, str]:
  """'validation/loss:min' -> ('validation/loss', 'min'); ValueError naming `what` otherwise."""
  m = re.fullmatch(r"\s*([^:\s]+/[^:\s]+)\s*:\s*(min|max)\s*", str(spec))
  if not m:
    raise ValueError(
      f"{what}={spec!r}: expected '<split or task>/<metric>:min|max', e.g. 'validation/loss:min' "
      "or 'cogs/exact_match:max'"
    )
  return m.group(1), m.group(2)


class Keeper:
  """Follows the metric over evaluations: `observe` says whether a value improves on the best (by more than
  `min_delta`) and whether patience has run out."""

  def __init__(self, spec: str, patience: int = 0, min_delta: float = 0.0, state: Mapping[str, Any] | None = None):
    self.metric, self.mode = parse(spec)
    self.patience, self.min_delta = int(patience), float(min_delta)
    state = dict(state or {})
    if state.get("metric") not in (None, self.metric) or state.get("mode") not in (None, self.mode):
      state = {}  # another metric than the checkpoint followed: start again
    self.best_value: float | None = state.get("best_value")
    self.best_step: int | None = state.get("best_step")
    self.since = int(state.get("since", 0))

  def state(self) -> dict[str, Any]:
    return {
      "metric": self.metric,
      "mode": self.mode,
      "best_value": self.best_value,
      "best_step": self.best_step,
      "since": self.since,
    }

  def observe(self, step: int, values: Mapping[str, float]) -> tuple[bool, bool]:
    """(improved, stop) after an evaluation at `step` giving `values` ({'validation/loss': ..., ...}); an
    evaluation without the metric changes nothing."""
    if self.metric not in values:
      return False, False
    value = float(values[self.metric])
    if self.best_value is None:
      better = value == value  # the first finite value is the best so far
    else:
      margin = value - self.best_value if self.mode == "max" else self.best_value - value
      better = margin > self.min_delta or (self.min_delta == 0 and margin > 0)
    if better:
      self.best_value, self.best_step, self.since = value, int(step), 0
    else:
      self.since += 1
    return better, bool(self.patience) and self.since >= self.patience

  def stop_message(self) -> str:
    return (
      f"early stop: {self.metric} did not improve by more than {self.min_delta:g} in {self.since} "
      f"evaluations (best {self.best_value:.6g} at step {self.best_step})"
    )


def record(model_dir: storage.Path, keeper: Keeper) -> None:
  """MODEL_DIR/best_checkpoint.json: the best step, its metric and value (written once that step is saved)."""
  storage.write_text(
    model_dir / BEST_FILE,
    json.dumps(
      {"step": keeper.best_step, "metric": keeper.metric, "mode": keeper.mode, "value": keeper.best_value}, indent=1
    ),
  )


def best_step(model_dir: storage.Path) -> int:
  """The recorded best step; FileNotFoundError (one line) when the run recorded none."""
  path = model_dir / BEST_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f"{model_dir} records no best checkpoint ({BEST_FILE}): train with "
      "KEEP_BEST_BY (e.g. --gin.KEEP_BEST_BY=\"'validation/loss:min'\") to keep one"
    )
  return int(json.loads(path.read_text())["step"])


def checkpoint_dir(model_dir, which: str | None):
  """Where `--checkpoint WHICH` reads parameters for a MODEL_DIR: 'best' its best step's folder, a number that
  step's, None (or 'latest') the folder itself (its latest step)."""
  root = storage.run_path(model_dir)
  if which in (None, "latest"):
    return root
  step = best_step(root) if which == "best" else _step_number(which)
  folder = root / "checkpoints" / str(step)
  if not folder.is_dir():
    raise FileNotFoundError(f"checkpoint {folder} does not exist (kept steps are the folders in {folder.parent})")
  return folder


def _step_number(which: str) -> int:
  if not str(which).isdigit():
    raise ValueError(f"--checkpoint {which!r}: expected 'best', 'latest' or a step number")
  return int(which)


def super_glue_protocol(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
  """T5's report from a run's `infer/<task>` rows (metrics_log.current_rows): each SuperGLUE task's score at
  its own best step, their mean, and the single best step's SuperGLUE average; None without all 8 tasks."""
  from remixer_t5.tasks import super_glue

  scores: dict[str, dict[int, float]] = {}
  averages: dict[int, float] = {}
  for row in rows:
    split = str(row.get("split", ""))
    if not split.startswith("infer/"):
      continue
    name = split[len("infer/") :]
    if name == f"{super_glue.PREFIX}{super_glue.AVERAGE_NAME}":
      averages[int(row["step"])] = float(row[super_glue.AVERAGE_METRIC])
      continue
    for task, keys in super_glue.AVERAGE_METRICS.items():
      if name == f"{super_glue.PREFIX}{task}" and all(k in row for k in keys):
        scores.setdefault(task, {})[int(row["step"])] = sum(float(row[k]) for k in keys) / len(keys)
  if set(scores) != set(super_glue.AVERAGE_METRICS) or not averages:
    return None
  best = {task: max(by_step.items(), key=lambda kv: (kv[1], -kv[0])) for task, by_step in scores.items()}
  single_step, single = max(averages.items(), key=lambda kv: (kv[1], -kv[0]))
  return {
    "score": sum(v for _, v in best.values()) / len(best),
    **{f"{task}_score": v for task, (_, v) in best.items()},
    **{f"{task}_step": s for task, (s, _) in best.items()},
    "single_best_score": single,
    "single_best_step": single_step,
  }
