"""seqio tasks: T5 span corruption over the embedded corpus.

``embedded_span_corruption`` uses the project's embedded SentencePiece vocabulary; ``register_span_corruption_task(name,
vocabulary)`` registers the same corpus and objective with another vocabulary. Registration does no I/O: the corpus is
prepared (and the embedded vocabulary trained) when a dataset is first built from the task.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import seqio
import tensorflow as tf
from remixer_t5.tasks.common import add_span_corruption_task

from remixer_t5.data import embedded_corpus
from remixer_t5.data.vocab import get_vocabulary

TASK_NAME = "embedded_span_corruption"


class LazySplitFiles(Mapping):
  """``{split: tfrecord path}`` that prepares the corpus on first lookup. Handed to seqio as ``split_to_filepattern``:
  seqio reads only the keys when the task is registered and looks a split up when it reads it."""

  def __init__(self, cache_dir=None):
    self._cache_dir = cache_dir

  def __getitem__(self, split: str) -> str:
    if split not in embedded_corpus.SPLITS:
      raise KeyError(split)
    embedded_corpus.prepare(self._cache_dir)
    return str(embedded_corpus.split_paths(self._cache_dir, "tfrecord")[split])

  def __iter__(self) -> Iterator[str]:
    return iter(embedded_corpus.SPLITS)

  def __len__(self) -> int:
    return len(embedded_corpus.SPLITS)

  def __repr__(self) -> str:
    where = self._cache_dir or f"${embedded_corpus.CACHE_ENV_VAR} or ~/.cache/remixer_t5"
    return f"LazySplitFiles(embedded corpus in {where}, splits={list(embedded_corpus.SPLITS)})"


def embedded_source(cache_dir=None) -> seqio.TFExampleDataSource:
  """The embedded corpus as a seqio source: features text/title/source, train/validation."""
  return seqio.TFExampleDataSource(
    split_to_filepattern=LazySplitFiles(cache_dir),
    feature_description={key: tf.io.FixedLenFeature([], tf.string) for key in ("text", "title", "source")},
  )


def register_span_corruption_task(name: str, vocabulary=None, *, cache_dir=None) -> str:
  """Registers span corruption over the embedded corpus under ``name``; returns ``name``.

  ``vocabulary``: a seqio.Vocabulary, a SentencePiece model path, or None (the embedded vocabulary). ``cache_dir``:
  the corpus folder (default: see ``embedded_corpus.corpus_dir``). Registering the same name again with an equal
  vocabulary is a no-op; with another vocabulary it raises ValueError."""
  if vocabulary is None:
    vocabulary = get_vocabulary(cache_dir=cache_dir)
  return add_span_corruption_task(name, embedded_source(cache_dir), vocabulary)


register_span_corruption_task(TASK_NAME)
