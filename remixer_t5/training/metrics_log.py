"""Host-side run logging: console progress, `MODEL_DIR/metrics.jsonl` and TensorBoard (process 0 only).

MODEL_DIR may be a bucket (remixer_t5.storage): metrics.jsonl grows by whole-object rewrites there, and the
TensorBoard event files, which only TensorFlow writes, are written in a local mirror copied up after each row."""
from __future__ import annotations

import json
import time
from typing import Any, Mapping, Sequence

import jax

from remixer_t5 import storage


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
    if self.enabled:
      self.path.parent.mkdir(parents=True, exist_ok=True)

  def info(self, message: str) -> None:
    if self.enabled:
      print(message, flush=True)

  def write(self, step: int, split: str, row: Mapping[str, float], suffix: str = "",
            examples: Sequence[Mapping[str, str]] = ()) -> None:
    if not self.enabled:
      return
    shown = " | ".join(_fmt(k, v) for k, v in row.items() if k in _CONSOLE_KEYS or split.startswith("infer/"))
    print(f"[{split}] step {step} | {shown}" + (f" | {suffix}" if suffix else ""), flush=True)
    for ex in examples:
      print(f"  input: {ex['inputs'][:160]}\n  target: {ex['targets'][:160]}\n  prediction: "
            f"{ex['prediction'][:160]}", flush=True)
    record = {"step": int(step), "split": split, "time": time.time(), **{k: float(v) for k, v in row.items()}}
    if examples:
      record["examples"] = list(examples)
    storage.append_text(self.path, json.dumps(record) + "\n")
    self._tensorboard(step, split, row, examples)

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
        tf.summary.text("examples", "\n\n".join(
            f"**input**: {e['inputs']}  \n**target**: {e['targets']}  \n**prediction**: {e['prediction']}"
            for e in examples))
    self._writers[split].flush()
    self._tb.sync()

  def close(self) -> None:
    for w in self._writers.values():
      w.close()
    self._writers.clear()
    if self._tb is not None:
      self._tb.close()
      self._tb = None


_CONSOLE_KEYS = ("loss", "accuracy", "tokens_per_s", "learning_rate")


def _fmt(k: str, v: float) -> str:
  if k == "tokens_per_s":
    return f"{v / 1000:.1f}k tok/s" if v >= 1000 else f"{v:.0f} tok/s"
  if k == "learning_rate":
    return f"lr {v:.2e}"
  return f"{k} {v:.4f}"
