"""What every task module here shares: idempotent registration keyed on the vocabulary."""
from __future__ import annotations

import seqio


def already_registered(name: str, vocabulary: seqio.Vocabulary) -> bool:
  """True when `name` is registered with an equal vocabulary (so registering again is a no-op).

  Raises ValueError when `name` is registered with another vocabulary: silently keeping either would make a
  config's vocabulary choice depend on import order.
  """
  if name not in seqio.TaskRegistry.names():
    return False
  existing = seqio.TaskRegistry.get(name).output_features["targets"].vocabulary
  if existing != vocabulary:
    raise ValueError(f"Task {name!r} is already registered with vocabulary {existing!r}, not {vocabulary!r}.")
  return True
