"""Finding a registered task or mixture by name, optionally with another vocabulary.

A run's VOCABULARY may differ from the one a task was registered with (a local copy of T5's model, the
embedded vocabulary for smoke tests). seqio looks tasks up by name everywhere (mixtures, the Evaluator), so
the swap registers copies named ``<name>#<vocabulary tag>`` (tasks and, for a mixture, each of its tasks and
the mixture itself with the same rates) and returns that name.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import seqio


def get_mixture_or_task(name: str):
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError as e:
    known = sorted(seqio.TaskRegistry.names()) + sorted(seqio.MixtureRegistry.names())
    raise ValueError(f"unknown task or mixture {name!r}; registered: {', '.join(known)}") from e


def vocabulary_tag(vocabulary: seqio.Vocabulary) -> str:
  """A short, stable name for a vocabulary: the model file's stem + a hash of its description."""
  path = getattr(vocabulary, "sentencepiece_model_file", None) or getattr(vocabulary, "_sentencepiece_model_file", None)
  stem = Path(str(path)).stem if path else type(vocabulary).__name__
  digest = hashlib.sha1(repr(vocabulary).encode()).hexdigest()[:8]
  return re.sub(r"\W", "_", f"{stem}_{digest}")  # seqio names allow only [\w.:#]


def _features(task: seqio.Task, vocabulary) -> dict[str, seqio.Feature]:
  return {
    k: seqio.Feature(vocabulary=vocabulary, add_eos=f.add_eos, required=f.required, dtype=f.dtype, rank=f.rank)
    for k, f in task.output_features.items()
  }


def with_vocabulary(name: str, vocabulary: seqio.Vocabulary | None) -> str:
  """The name of a registered task/mixture equal to ``name`` but using ``vocabulary`` (``name`` itself when
  ``vocabulary`` is None or already the one its tasks use)."""
  provider = get_mixture_or_task(name)
  tasks = [provider] if isinstance(provider, seqio.Task) else provider.tasks
  if vocabulary is None or all(t.output_features["targets"].vocabulary == vocabulary for t in tasks):
    return name
  copy = f"{name}#{vocabulary_tag(vocabulary)}"
  if copy in seqio.TaskRegistry.names() or copy in seqio.MixtureRegistry.names():
    return copy
  if isinstance(provider, seqio.Task):
    seqio.TaskRegistry.add(
      copy,
      source=provider.source,
      output_features=_features(provider, vocabulary),
      preprocessors=provider.preprocessors,
      postprocess_fn=provider.postprocessor,
      metric_fns=provider.metric_fns,
      shuffle_buffer_size=provider.shuffle_buffer_size,
    )
  else:
    rates = [(with_vocabulary(sub, vocabulary), rate) for sub, rate in provider.rate_per_task_name.items()]
    seqio.MixtureRegistry.add(copy, rates)
  return copy


def get_task(name: str, vocabulary: seqio.Vocabulary | None = None):
  """The registered task/mixture ``name``, with ``vocabulary`` swapped in when given (see module doc)."""
  return get_mixture_or_task(with_vocabulary(name, vocabulary))
