"""Where a logged window's wall time went: the time split of every train row, and its goodput.

The host's time between two train rows is split by what the host was doing (`PARTS`): compiling the step,
waiting for the next batch (the input pipeline and its copy to the devices), the step itself (dispatching it and
waiting for it where the loop already waits: the device-to-host copy of the window's metrics at a log or save
step; no sync is added), evaluating, and the part of a checkpoint save that blocks training; `other` is the rest
(logging, bookkeeping). The parts sum to the window's `window_seconds`; `goodput` is `time/step` over it.

The device runs the dispatched steps while the host fetches the next batch, so input time that the devices hide
is counted as step time when the host then waits for them; what shows as `time/input` is what they could not
hide. An evaluation or a save made right after a row falls in the next row's window.
"""

from __future__ import annotations

import contextlib
import time

PARTS = ("compile", "input", "step", "eval", "checkpoint")
SHOWN_ABOVE = 0.03  # the console names the largest part besides the step when it exceeds this share


class TimeSplit:
  """Seconds per part since `reset()`; `with split("input"): ...` adds the block's wall time to a part."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self.t0 = time.perf_counter()
    self.parts = dict.fromkeys(PARTS, 0.0)

  @contextlib.contextmanager
  def __call__(self, part: str):
    t = time.perf_counter()
    try:
      yield
    finally:
      self.parts[part] += time.perf_counter() - t

  def row(self) -> dict[str, float]:
    """`window_seconds`, `time/<part>` for PARTS and `other`, and `goodput`, for the window since reset()."""
    seconds = max(time.perf_counter() - self.t0, 1e-9)
    row = {f"time/{k}": v for k, v in self.parts.items()}
    row["time/other"] = max(seconds - sum(self.parts.values()), 0.0)
    row.update(window_seconds=seconds, goodput=self.parts["step"] / seconds)
    return row


def summary(row) -> str:
  """'goodput 91%', and the largest other part when it takes more than SHOWN_ABOVE: 'goodput 91%, input 6%'."""
  seconds = row["window_seconds"]
  text = f"goodput {row['goodput']:.0%}"
  others = {k[len("time/") :]: v / seconds for k, v in row.items() if k.startswith("time/") and k != "time/step"}
  name, share = max(others.items(), key=lambda kv: kv[1])
  return text + (f", {name} {share:.0%}" if share > SHOWN_ABOVE else "")
