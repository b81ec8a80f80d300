"""Host-side run logging: console progress, `MODEL_DIR/metrics.jsonl` and TensorBoard (process 0 only).

MODEL_DIR may be a bucket (remixer_t5.storage): metrics.jsonl grows by whole-object rewrites there, and the
TensorBoard event files, which only TensorFlow writes, are written in a local mirror copied up after each row.

A resumed run logs again the steps after the checkpoint it restored. Every launch of `train` writes a row
`{"split": "start", "step": S, "attempt": k}` (S: the step it starts from) and tags its rows with `attempt`, so
the file says which rows supersede which: a `start` row at step S makes every earlier row with a step above S
stale (`current_rows`). One curve is the rows that no later `start` row makes stale.

With a W&B project named (tracking.py), `start` also opens the run's W&B run, every row is mirrored there and
`close` finishes it; `eval` (no `start`) does not track."""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Sequence

import jax

from remixer_t5 import storage
from remixer_t5.training import tracking


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsLogger:
  """One JSON object per logged step in metrics.jsonl (`step`, `split`, metrics...), mirrored to TensorBoard."""

  def __init__(self, model_dir: str):
    self.enabled = jax.process_index() == 0
    self.path = storage.run_path(model_dir) / "metrics.jsonl"
    self._writers: dict[str, Any] = {}
    self._tb: storage.Mirror | None = None
    self.attempt: int | None = None
    self.tracker: tracking.Tracker | None = None
    if self.enabled:
      self.path.parent.mkdir(parents=True, exist_ok=True)

  def start(self, step: int) -> None:
    """The launch's `start` row: this launch continues from `step`; its rows carry the next `attempt` number."""
    if not self.enabled:
      return
    rows = read_rows(self.path) if self.path.exists() else []
    self.attempt = 1 + sum(1 for r in rows if r.get("split") == "start")
    # The W&B run (when asked for) opens before the start row: a launch that cannot track writes no start row.
    # The start row itself is not mirrored; each mirrored row carries its attempt instead.
    self.tracker = tracking.from_environment(str(self.path.parent))
    record = {"step": int(step), "split": "start", "time": time.time(), "attempt": self.attempt}
    storage.append_text(self.path, json.dumps(record) + "\n")

  def info(self, message: str) -> None:
    if self.enabled:
      print(message, flush=True)

  def write(
    self, step: int, split: str, row: Mapping[str, float], suffix: str = "", examples: Sequence[Mapping[str, str]] = ()
  ) -> None:
    if not self.enabled:
      return
    shown = " | ".join(_fmt(k, v) for k, v in row.items() if k in _CONSOLE_KEYS or split.startswith("infer/"))
    print(f"[{split}] step {step} | {shown}" + (f" | {suffix}" if suffix else ""), flush=True)
    for ex in examples:
      print(
        f"  input: {ex['inputs'][:160]}\n  target: {ex['targets'][:160]}\n  prediction: {ex['prediction'][:160]}",
        flush=True,
      )
    record = {"step": int(step), "split": split, "time": time.time(), **{k: float(v) for k, v in row.items()}}
    if self.attempt is not None:
      record["attempt"] = self.attempt
    if examples:
      record["examples"] = list(examples)
    storage.append_text(self.path, json.dumps(record) + "\n")
    self._tensorboard(step, split, row, examples)
    if self.tracker is not None:
      self.tracker.log(step, split, row, self.attempt)

  def _tensorboard(self, step, split, row, examples):
    import tensorflow as tf  # host-side only; TF is already a dependency of the input pipeline

    if self._tb is None:
      self._tb = storage.Mirror(self.path.parent / "tensorboard")
    if split not in self._writers:
      self._writers[split] = tf.summary.create_file_writer(str(self._tb.local / split))
    with self._writers[split].as_default(step=int(step)):
      for k, v in row.items():
        tf.summary.scalar(k, float(v))
      if examples:
        tf.summary.text(
          "examples",
          "\n\n".join(
            f"**input**: {e['inputs']}  \n**target**: {e['targets']}  \n**prediction**: {e['prediction']}"
            for e in examples
          ),
        )
    self._writers[split].flush()
    self._tb.sync()

  def close(self) -> None:
    for w in self._writers.values():
      w.close()
    self._writers.clear()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self.tracker is not None:
      tracker, self.tracker = self.tracker, None
      tracker.close()


_CONSOLE_KEYS = ("loss", "accuracy", "tokens_per_s", "learning_rate")


def _fmt(k: str, v: float) -> str:
  if k == "tokens_per_s":
    return f"{v / 1000:.1f}k tok/s" if v >= 1000 else f"{v:.0f} tok/s"
  if k == "learning_rate":
    return f"lr {v:.2e}"
  return f"{k} {v:.4f}"


def read_rows(path) -> list[dict[str, Any]]:
  """The rows of a metrics.jsonl in file order; a last line cut short by a kill is skipped."""
  rows = []
  for line in storage.run_path(path).read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def current_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The rows no later `start` row supersedes (module docstring), in file order, without the `start` rows."""
  kept: list[dict[str, Any]] = []
  for row in rows:
    if row.get("split") == "start":
      kept = [r for r in kept if int(r["step"]) <= int(row["step"])]
    else:
      kept.append(dict(row))
  return kept
