"""seqio task ``c4_span_corruption``: T5's span-corruption pretraining on C4 English.

Data (Raffel et al. 2020, §2.2 "The Colossal Clean Crawled Corpus"), from either

* a local copy in the allenai/c4 release layout, ``<data dir>/c4/en/c4-train.00000-of-01024.json.gz`` ...
  and ``c4-validation.00000-of-00008.json.gz`` ...; uncompressed ``.jsonl`` / ``.json`` shards of the same
  names are read too. Rows are JSON objects with ``text``, ``timestamp`` and ``url`` (``text`` required).
  Shards are streamed one file at a time by tf.data (``TextLineDataset``; JSON parsed in a batched map), so
  the input position is checkpointable; each input shard (process) reads its own files.
* else TFDS ``c4/en:3.1.0`` (features text/url/timestamp/content-type/content-length), read-only: building
  C4 is a Beam job over Common Crawl that a training run should never start on its own.

Splits: train, validation. Objective (T5 §3.3.4, §3.7): ``text`` becomes ``targets``, is tokenized, and
``remixer_t5.data.span_corruption.span_corruption`` (15% noise, mean span 3, documents concatenated and split
so that inputs come out at exactly their length) turns it into inputs/targets; EOS is appended after
trimming. Default lengths 512 / 114 (``DEFAULT_SEQUENCE_LENGTH``), T5.1.1's pretraining lengths.

Vocabulary: T5's (``t5_vocabulary()``); ``register_c4_task(name, vocabulary)`` registers the same data and
objective with another.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator

import tensorflow as tf

from remixer_t5.tasks.common import add_span_corruption_task
from remixer_t5.tasks.sources import LocalOrTfdsSource, glob_files, parse_json_line, read_jsonl


TASK_NAME = "c4_span_corruption"
TFDS_NAME = "c4/en:3.1.0"
LOCAL_DIR = "c4/en"
SPLITS = ("train", "validation")
# The release's gzipped shards, and the same shards decompressed (either, per shard).
SHARD_SUFFIXES = (".json.gz", ".jsonl", ".json")
LOCAL_FILES = {split: [f"c4-{split}.*-of-*{suffix}" for suffix in SHARD_SUFFIXES] for split in SPLITS}
# Span corruption of 568 raw tokens gives exactly these lengths (random_spans_helper(512)).
DEFAULT_SEQUENCE_LENGTH = {"inputs": 512, "targets": 114}
OPTIONAL_FIELDS = ("timestamp", "url")


def _c4_row(path: str, lineno: int, row: dict) -> dict:
  if not isinstance(row["text"], str):
    raise ValueError(f"{path}:{lineno}: 'text' must be a string, got {type(row['text']).__name__}")
  out = {"text": row["text"]}
  for key in OPTIONAL_FIELDS:
    value = row.get(key)
    if value is not None and not isinstance(value, str):
      raise ValueError(f"{path}:{lineno}: {key!r} must be a string, got {type(value).__name__}")
    out[key] = value or ""
  return out


def read_c4_jsonl(path: str) -> Iterator[dict]:
  """Rows ``{text, timestamp, url}`` (strings) of one release shard; ValueError naming file:line."""
  for lineno, row in read_jsonl(path, required=["text"]):
    yield _c4_row(path, lineno, row)


def parse_c4_line(path: str, lineno: int, line: str) -> dict | None:
  """One release-shard line as ``{text, timestamp, url}`` (None if blank): what tf.data's reader parses."""
  row = parse_json_line(path, lineno, line, required=["text"])
  return None if row is None else _c4_row(path, lineno, row)


class C4Source(LocalOrTfdsSource):
  """``LocalOrTfdsSource`` whose split is every shard matching any of its patterns."""

  def files(self, split: str) -> list[str]:
    if split not in self.local_files:
      raise ValueError(f"unknown split {split!r} for {self.local_dir}; expected one of {list(self.local_files)}")
    root = self.local_root()
    assert root is not None
    patterns = self.local_files[split]
    found = sorted({path for pattern in patterns for path in glob_files(str(root / pattern))})
    if not found:
      raise FileNotFoundError(
        f"C4 split {split!r}: no shard in {root} matches {' or '.join(patterns)} (the allenai/c4 release "
        f"layout: {LOCAL_DIR}/c4-{split}.00000-of-NNNNN.json.gz, ...)"
      )
    # A shard present both gzipped and decompressed would be read twice.
    stems = collections.Counter(map(_shard_stem, found))
    twice = [[p for p in found if _shard_stem(p) == stem] for stem, n in stems.items() if n > 1]
    if twice:
      raise ValueError(f"C4 split {split!r}: shard(s) present in more than one form, keep one of each: {twice}")
    return found


def _shard_stem(path: str) -> str:
  return re.sub(r"\.(json\.gz|jsonl|json)$", "", path)


def c4_source() -> C4Source:
  """C4 English as a seqio source: local release shards (streamed) or TFDS ``c4/en:3.1.0``, read only; no I/O here."""
  return C4Source(
    local_dir=LOCAL_DIR,
    local_files=LOCAL_FILES,
    reader=read_c4_jsonl,
    features={key: tf.TensorSpec([], tf.string) for key in ("text",) + OPTIONAL_FIELDS},
    tfds_name=TFDS_NAME,
    line_parser=parse_c4_line,
    tfds_read_only=True,
  )


def register_c4_task(name: str = TASK_NAME, vocabulary=None) -> str:
  """Registers span corruption over C4 English under ``name``; returns ``name``.

  ``vocabulary``: a seqio.Vocabulary, a SentencePiece model path, or None (T5's). Registering the same name
  again with an equal vocabulary is a no-op; with another one, ValueError."""
  return add_span_corruption_task(name, c4_source(), vocabulary)


register_c4_task(TASK_NAME)
