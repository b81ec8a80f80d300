"""Reproductions of paper experiments that run on a CPU (`remixer-t5 repro ...`), and what their commands share."""

from __future__ import annotations

import json
from typing import Callable, Sequence

import numpy as np

from remixer_t5.training import plots


def ints(text: str, what: str) -> tuple[int, ...]:
  """The comma-separated integers of flag `--what`; ValueError naming the flag and the text otherwise."""
  try:
    vals = tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    vals = ()
  if not vals:
    raise ValueError(f"--{what} expects comma-separated integers, got {text!r}")
  return vals


def emitter(as_json: bool) -> Callable[[dict], None]:
  """`--json`'s row printer: one JSON line per row on stdout, flushed; without it, nothing."""
  return (lambda r: print(json.dumps(r), flush=True)) if as_json else (lambda r: None)


def mean_range(values: Sequence[float], digits: int) -> str:
  """'mean (min-max)' of `values` to `digits` decimals ('mean' alone for one value, '-' for none)."""
  if not values:
    return "-"
  return f"{np.mean(values):.{digits}f}" + (
    f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else ""
  )


def pyplot():
  """(matplotlib.pyplot on the file-only Agg backend, plots.save_png)."""
  return plots.pyplot(), plots.save_png
