"""What every task module here shares: the vocabulary argument, idempotent registration keyed on it, and the two
preprocessing chains (T5's text-to-text tasks; span corruption)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import seqio

from remixer_t5.data import span_corruption as objective
from remixer_t5.data.vocab import get_vocabulary, t5_vocabulary


def as_vocabulary(vocabulary=None) -> seqio.Vocabulary:
  """A task's vocabulary: a seqio.Vocabulary as given, a SentencePiece model path, or None for T5's (lazy)."""
  if vocabulary is None:
    return t5_vocabulary()
  if isinstance(vocabulary, (str, os.PathLike)):
    return get_vocabulary(vocabulary)
  return vocabulary


def already_registered(name: str, vocabulary: seqio.Vocabulary) -> bool:
  """True when `name` is registered with an equal vocabulary (so registering again is a no-op).

  Raises ValueError when `name` is registered with another vocabulary: silently keeping either would make a
  config's vocabulary choice depend on import order."""
  if name not in seqio.TaskRegistry.names():
    return False
  existing = seqio.TaskRegistry.get(name).output_features["targets"].vocabulary
  if existing != vocabulary:
    raise ValueError(f"Task {name!r} is already registered with vocabulary {existing!r}, not {vocabulary!r}.")
  return True


def add_task(
  name: str,
  source: seqio.DataSource,
  text_preprocessors: Sequence[Callable],
  postprocess_fn: Callable | None,
  metric_fns: Sequence[Callable],
  vocabulary=None,
  *,
  span_corruption: bool = False,
) -> str:
  """Registers a task with T5's chain: `text_preprocessors`, tokenize, with `span_corruption` T5's objective over
  the tokens (remixer_t5/data/span_corruption.py; inputs then optional), EOS after trimming; both features with EOS.
  `vocabulary` as `as_vocabulary` takes it. Idempotent (`already_registered`); returns `name`."""
  vocabulary = as_vocabulary(vocabulary)
  if already_registered(name, vocabulary):
    return name
  seqio.TaskRegistry.add(
    name,
    source=source,
    preprocessors=[
      *text_preprocessors,
      seqio.preprocessors.tokenize,
      seqio.CacheDatasetPlaceholder(),
      *([objective.span_corruption] if span_corruption else []),
      seqio.preprocessors.append_eos_after_trim,
    ],
    output_features={
      "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=True, required=not span_corruption),
      "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True),
    },
    postprocess_fn=postprocess_fn,
    metric_fns=list(metric_fns),
  )
  return name


def add_span_corruption_task(name: str, source: seqio.DataSource, vocabulary=None) -> str:
  """Registers T5's span-corruption objective over the `text` feature of `source`; no metrics (loss evaluation
  only). Idempotent, as `add_task`."""
  rekey = functools.partial(seqio.preprocessors.rekey, key_map={"inputs": None, "targets": "text"})
  return add_task(name, source, [rekey], None, [], vocabulary, span_corruption=True)
