"""Profiler traces of a run's steps, on demand: `train --profile_steps A:B` (run_config.Schedule.profile_steps),
or, in a run already going, a file `MODEL_DIR/PROFILE` holding `A:B`, read at each log step.

The trace is JAX's (jax.profiler: XLA's programs and kernels, the host's threads, each train step annotated as
`train` with its number, so the trace viewer groups it by step) on CPU, GPU and TPU alike. It is written in a
local folder and then copied under `MODEL_DIR/profile/` through the run's storage client (a bucket too), in the
layout TensorBoard's profile plugin and xprof read: `tensorboard --logdir MODEL_DIR/profile` or
`xprof MODEL_DIR/profile` (`pip install -e '.[profile]'`). `trace` is the one way this package takes a trace
(scripts/gpu_measure.py's too).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile

import jax

from remixer_t5 import storage

PROFILE_DIR = "profile"
REQUEST_FILE = "PROFILE"


def parse_steps(text: str, what: str = "profile_steps") -> tuple[int, int]:
  """'A:B' -> (A, B), the steps A to B (1-based, both included); ValueError naming `what` otherwise."""
  m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
  if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
    raise ValueError(f"{what}={text!r}: expected FIRST:LAST, two step numbers with 1 <= FIRST <= LAST, e.g. 22:25")
  return int(m.group(1)), int(m.group(2))


@contextlib.contextmanager
def trace(out_dir=None, perfetto: bool = False):
  """A jax.profiler trace of the block, written in a local folder (yielded) and then copied into `out_dir`
  (local or gs://; None: left in the yielded folder, which the caller then owns)."""
  local = tempfile.mkdtemp(prefix="remixer_t5-profile-")
  jax.profiler.start_trace(local, create_perfetto_trace=perfetto)
  try:
    yield local
  finally:
    jax.profiler.stop_trace()
    if out_dir is not None:
      target = storage.run_path(out_dir)
      storage.upload_tree(local, target)
      shutil.rmtree(local, ignore_errors=True)


def annotate(step: int):
  """The trace viewer's step marker around train step `step`."""
  return jax.profiler.StepTraceAnnotation("train", step_num=step)


class StepProfiler:
  """Traces the train steps of one range at a time: `steps` ('A:B') from the run config, then each new range
  that `MODEL_DIR/PROFILE` asks for (`poll`, at log steps; a range is taken once per launch)."""

  def __init__(self, model_dir, steps: str | None, log):
    self.model_dir, self.log = model_dir, log
    self.pending = [parse_steps(steps)] if steps else []
    self.taken: set[str] = set()
    self.active = None  # (first, last, the open trace context)

  def poll(self, step: int) -> None:
    """Reads MODEL_DIR/PROFILE: a range not seen before and not yet begun is queued."""
    path = self.model_dir / REQUEST_FILE
    try:
      text = path.read_text().strip() if path.exists() else ""
    except OSError:
      return
    if not text or text in self.taken:
      return
    self.taken.add(text)
    try:
      first, last = parse_steps(text, what=str(path))
    except ValueError as e:
      self.log(f"{e}; no profile taken")
      return
    if first <= step:
      self.log(f"{path} asks for steps {first}-{last}, which began before step {step + 1}; no profile taken")
      return
    self.pending.append((first, last))
    self.log(f"profiling steps {first}-{last} (asked by {path})")

  def before(self, step: int) -> None:
    """Before train step `step` (1-based) runs."""
    if self.active is None and self.pending and self.pending[0][0] == step:
      first, last = self.pending.pop(0)
      context = trace(self.model_dir / PROFILE_DIR / f"steps_{first}-{last}")
      context.__enter__()
      self.active = (first, last, context)
    elif self.pending and self.pending[0][0] < step:  # a range already passed (e.g. resumed beyond it)
      self.pending.pop(0)

  def after(self, step: int, outputs) -> None:
    """After train step `step` was dispatched: the last step of a range is waited for, then the trace ends."""
    if self.active is not None and step >= self.active[1]:
      first, last, context = self.active
      jax.block_until_ready(outputs)
      self.active = None
      context.__exit__(None, None, None)
      self.log(
        f"profile of steps {first}-{last} written to {self.model_dir / PROFILE_DIR / f'steps_{first}-{last}'}; "
        f"open it with `tensorboard --logdir {self.model_dir / PROFILE_DIR}` (the profile plugin) or xprof"
      )

  def close(self) -> None:
    if self.active is not None:
      _, _, context = self.active
      self.active = None
      context.__exit__(None, None, None)
