"""seqio tasks from your own TSV or JSON-lines files: train or evaluate on them without writing Python.

``register(name, train=..., validation=..., test=..., objective=...)`` registers a task whose splits read the given
files (each a path, a glob, or a list of them; local or ``gs://``), with one of two objectives:

* ``inputs_targets``: text-to-text. Each row gives ``inputs`` and ``targets`` (the fields ``inputs_field`` and
  ``targets_field``); both are tokenized and get EOS, and seqio keeps the text as ``inputs_pretokenized`` /
  ``targets_pretokenized``. Decoded outputs are scored by ``metrics`` (``exact_match``, ``accuracy``).
* ``span_corruption``: T5's pretraining objective over raw text (the field ``text_field``), exactly as the C4 and
  embedded-corpus tasks do it (``common.add_span_corruption_task``; remixer_t5/data/span_corruption.py): documents
  are tokenized, concatenated and split, 15% of the tokens dropped in spans of mean length 3, each span replaced by
  a sentinel counting down from the top of the vocabulary. Loss evaluation only.

Formats (``format='auto'`` tells them by the file name, ``.gz`` allowed):
  ``jsonl`` (``.jsonl``, ``.json``, ``.ndjson``): one JSON object a line holding the fields (strings; numbers are
    taken as their text). Other fields are ignored.
  ``tsv`` (``.tsv``, ``.txt``): tab-separated, no quoting. The first line is a header when it names the fields
    (other columns ignored); otherwise the file has no header and every line holds exactly the fields in order:
    ``inputs<TAB>targets``, or for span corruption one document a line.

Files are streamed by tf.data (``sources.lines_dataset``), so a corpus of any size works and a training run's input
position is checkpointed; a ``gs://`` file is copied to local disk when the run reaches it (once per process, removed
at exit), as TensorFlow's GCS client cannot be pointed at anything but Google's endpoint. When a dataset is built,
each file's first row is checked (header, fields, empty file); any later malformed line stops the run with an error
naming the file, the line and what was expected.

Vocabulary: ``vocabulary`` (a seqio.Vocabulary or a SentencePiece model path), default the project's embedded
vocabulary, which ``models/t5_1_1/tiny.gin`` pairs with; a run's ``VOCABULARY`` swaps it as for any task
(tasks/lookup.py). Runs use it through ``gin/runs/custom.gin`` (``MIXTURE_OR_TASK_NAME = @custom.register()``),
which ``remixer-t5 train|eval|infer --train_file=... --validation_file=...`` adds (docs/data.md, "Your own data").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

from remixer_t5 import storage
from remixer_t5.data.vocab import get_vocabulary
from remixer_t5.tasks import metrics as metrics_lib
from remixer_t5.tasks import sources
from remixer_t5.tasks.common import add_span_corruption_task, add_task, as_vocabulary

TASK_NAME = "custom"
OBJECTIVES = ("inputs_targets", "span_corruption")
FORMATS = ("auto", "tsv", "jsonl")
SPLITS = ("train", "validation", "test")
SUFFIXES = {"tsv": (".tsv", ".txt"), "jsonl": (".jsonl", ".json", ".ndjson")}
METRICS = {"exact_match": metrics_lib.exact_match, "accuracy": metrics_lib.accuracy}
DEFAULT_METRICS = ("exact_match",)
CHECK_ALL_BYTES = 16 << 20  # files up to this size are checked whole when a dataset is built

# name -> the (normalized) arguments it was registered with, for idempotent registration.
_registered: dict[str, dict] = {}


def file_format(path: str, format: str = "auto") -> str:
  """``format`` itself, or for ``'auto'`` the format ``path``'s name says (ValueError when it says none)."""
  if format not in FORMATS:
    raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
  if format != "auto":
    return format
  name = path.lower()
  name = name[: -len(".gz")] if name.endswith(".gz") else name
  for kind, suffixes in SUFFIXES.items():
    if name.endswith(suffixes):
      return kind
  known = ", ".join(s for suffixes in SUFFIXES.values() for s in suffixes)
  raise ValueError(
    f"{path}: cannot tell the format from the file name (expected a name ending in {known}, or "
    "'.gz' after one); pass format='tsv' or format='jsonl'"
  )


def _fields(objective: str, inputs_field: str, targets_field: str, text_field: str) -> dict[str, str]:
  """The task's features -> the file's field (column) names."""
  if objective == "span_corruption":
    return {"text": text_field}
  return {"inputs": inputs_field, "targets": targets_field}


def _text_value(path: str, lineno: int, name: str, value) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  raise ValueError(
    f"{path}:{lineno}: field {name!r} must be a string (or a number), got {type(value).__name__}: {value!r:.120}"
  )


def parse_jsonl_line(fields: Mapping[str, str], path: str, lineno: int, line: str) -> dict | None:
  """One JSON-lines line as the task's row (None if blank); ValueError naming file and line."""
  row = sources.parse_json_line(path, lineno, line, required=list(fields.values()))
  if row is None:
    return None
  return {key: _text_value(path, lineno, name, row[name]) for key, name in fields.items()}


def tsv_layout(path: str, lineno: int, line: str, fields: Mapping[str, str]) -> list[str] | None:
  """The column names of a TSV file from its first non-blank line: that line's cells when it is a header (names
  every field), None when the file has no header (the line then has one cell per field). ValueError otherwise."""
  cells = [c.strip() for c in line.lstrip("\ufeff").rstrip("\r").split("\t")]
  wanted = list(fields.values())
  named = [f for f in wanted if f in cells]
  if len(named) == len(wanted):
    return cells
  if named:
    raise ValueError(
      f"{path}:{lineno}: header lacks column(s) {[f for f in wanted if f not in cells]}; expected {wanted}, got {cells}"
    )
  if len(cells) != len(wanted):
    raise ValueError(
      f"{path}:{lineno}: expected a header row naming {', '.join(map(repr, wanted))}, or no header "
      f"and {len(wanted)} tab-separated field(s) ({', '.join(wanted)}) a line; got {len(cells)} "
      f"field(s): {line[:120]!r}"
    )
  return None


def parse_tsv_line(
  fields: Mapping[str, str], columns: Sequence[str], header_line: int, path: str, lineno: int, line: str
) -> dict | None:
  """One TSV line as the task's row (None for a blank line or the header); ValueError naming file and line."""
  if lineno == header_line:
    return None
  line = (line.lstrip("\ufeff") if lineno == 1 else line).rstrip("\r")
  if not line.strip():
    return None
  cells = line.split("\t")
  if len(cells) != len(columns):
    raise ValueError(
      f"{path}:{lineno}: expected {len(columns)} tab-separated field(s) ({', '.join(columns)}), "
      f"got {len(cells)}: {line[:120]!r}"
    )
  row = dict(zip(columns, cells))
  return {key: row[name] for key, name in fields.items()}


class FileSource(seqio.DataSource):
  """A seqio DataSource over TSV / JSON-lines files given by path or glob, local or ``gs://``.

  Args:
    split_files: split -> paths or globs (several files are read in sorted order, each pattern's in turn).
    fields: the row's features -> the file's field (column) names, e.g. ``{"inputs": "question", ...}``.
    format: ``'tsv'``, ``'jsonl'`` or ``'auto'`` (each file by its name).

  Files are read by ``sources.lines_dataset`` (tf.data's TextLineDataset, a bucket's files from a local copy;
  checkpointable) and listed through remixer_t5.storage. Input shards
  (processes) each read their own files when a split has enough of them, else every file with seqio keeping
  every n-th example."""

  def __init__(self, split_files: Mapping[str, Sequence[str]], fields: Mapping[str, str], format: str = "auto"):
    super().__init__(splits=list(split_files))
    self.split_files = {k: list(v) for k, v in split_files.items()}
    self.fields = dict(fields)
    self.format = format

  def files(self, split: str) -> list[str]:
    """The files of ``split``: each pattern's matches, sorted (FileNotFoundError naming a pattern that matches none)."""
    if split not in self.split_files:
      raise ValueError(f"unknown split {split!r}; this task has {list(self.split_files)}")
    found = []
    for pattern in self.split_files[split]:
      matches = storage.glob(pattern)
      if not matches:
        raise FileNotFoundError(f"split {split!r}: no file matches {pattern}")
      found += [m for m in matches if m not in found and storage.run_path(m).is_file()]
    return found

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False  # seqio shards by file when a split has enough, else by example

  def list_shards(self, split: str) -> Sequence[str]:
    return self.files(split)

  def num_input_examples(self, split: str) -> int | None:
    return None  # counting would read every file, and seqio asks on every get_dataset

  def line_parser(self, path: str):
    """(path, line number, line) -> row, for one file. Its first row is parsed here, and every row of a file of
    at most ``CHECK_ALL_BYTES``, so a wrong header, format or field (an empty file too) fails when the dataset is
    built with a plain ValueError; a later bad line of a larger file fails as tf.data reaches it (an OpError
    carrying the same message)."""
    kind = file_format(path, self.format)
    check_all = storage.run_path(path).stat().length <= CHECK_ALL_BYTES
    found = None
    if kind == "jsonl":
      parse = functools.partial(parse_jsonl_line, self.fields)
    header = None
    with sources.open_text(path) as f:
      for lineno, line in enumerate(f, start=1):
        line = line.rstrip("\n")
        if not line.strip().lstrip("\ufeff"):
          continue
        if kind == "tsv" and header is None:
          columns = tsv_layout(path, lineno, line, self.fields)
          header = lineno if columns is not None else 0
          columns = columns or list(self.fields.values())
          parse = functools.partial(parse_tsv_line, self.fields, columns, header)
        if parse(path, lineno, line) is not None:
          found = parse
          if not check_all:
            return parse
    if found is not None:
      return found
    what = "only a header row" if header else "no rows"
    raise ValueError(
      f"{path}: empty file ({what}); expected {kind.upper()} rows with {', '.join(map(repr, self.fields.values()))}"
    )

  def get_dataset(
    self,
    split: str = "train",
    shuffle: bool = True,
    seed: int | None = None,
    shard_info: seqio.ShardInfo | None = None,
    *,
    sequence_length=None,
    use_cached=False,
    num_epochs=1,
  ):
    del sequence_length, use_cached, num_epochs
    files = self.files(split)
    if shard_info and shard_info.num_shards > 1:
      files = files[shard_info.index :: shard_info.num_shards]
    if shuffle:
      files = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    parsers = {path: self.line_parser(path) for path in files}
    signature = {key: tf.TensorSpec([], tf.string) for key in self.fields}
    return sources.lines_dataset(files, lambda path, lineno, line: parsers[path](path, lineno, line), signature)

  def __repr__(self):
    return f"{type(self).__name__}({self.split_files!r}, fields={self.fields!r}, format={self.format!r})"


def as_text(output, example=None, is_target=False) -> str:
  """seqio postprocess_fn: targets arrive as bytes, predictions as strings; metrics compare strings."""
  del example, is_target
  return output.decode("utf-8") if isinstance(output, bytes) else str(output)


def _patterns(value, split: str) -> list[str]:
  """A split's files as absolute local paths or ``gs://`` paths (storage.run_path's rules)."""
  values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
  if not values or not all(isinstance(v, (str, os.PathLike)) and os.fspath(v) for v in values):
    raise ValueError(f"{split}={value!r}: expected a path, a glob, or a list of them")
  out = []
  for v in values:
    path = storage.run_path(v)
    out.append(path.as_posix() if storage.is_bucket(path) else str(path))
  return out


def _check_local(split_files: Mapping[str, Sequence[str]], format: str) -> None:
  """Local patterns must match a file whose format is known now, not when training starts (gs:// ones are
  listed when the dataset is built)."""
  for split, patterns in split_files.items():
    for pattern in patterns:
      if pattern.startswith("gs://"):
        continue
      matches = [m for m in storage.glob(pattern) if os.path.isfile(m)]
      if not matches:
        raise FileNotFoundError(f"{split}: no file matches {pattern}")
      for path in matches:
        file_format(path, format)


def register(
  name: str = TASK_NAME,
  train=None,
  validation=None,
  test=None,
  format: str = "auto",
  objective: str = "inputs_targets",
  inputs_field: str = "inputs",
  targets_field: str = "targets",
  text_field: str = "text",
  vocabulary=None,
  metrics: Sequence[str] | None = None,
) -> str:
  """Registers the seqio task ``name`` over your files (module doc); returns ``name``.

  ``train`` / ``validation`` / ``test``: each a path, a glob, or a list of them (local or ``gs://``); at least one.
  ``format``: 'auto' (by file name), 'tsv' or 'jsonl'. ``objective``: 'inputs_targets' or 'span_corruption'.
  ``inputs_field`` / ``targets_field`` (inputs_targets) or ``text_field`` (span_corruption): the JSON fields or
  TSV header columns read. ``vocabulary``: a seqio.Vocabulary, a SentencePiece model path, or None (the project's
  embedded vocabulary). ``metrics``: of 'exact_match', 'accuracy' (inputs_targets only; default exact_match).

  Registering ``name`` again with equal arguments is a no-op (gin calls this each time the run's config is read);
  with other arguments it raises ValueError naming the argument that differs. Local paths are checked here."""
  if objective not in OBJECTIVES:
    raise ValueError(f"unknown objective {objective!r}; expected one of {list(OBJECTIVES)}")
  if format not in FORMATS:
    raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
  if metrics is None:
    metrics = DEFAULT_METRICS if objective == "inputs_targets" else ()
  metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
  unknown = [m for m in metrics if m not in METRICS]
  if unknown:
    raise ValueError(f"unknown metric(s) {unknown}; expected some of {list(METRICS)}")
  if metrics and objective == "span_corruption":
    raise ValueError(f"metrics={list(metrics)}: span_corruption is evaluated by its loss only; pass metrics=()")
  given = {"train": train, "validation": validation, "test": test}
  split_files = {split: _patterns(value, split) for split, value in given.items() if value is not None}
  if not split_files:
    raise ValueError(
      f"custom.register({name!r}): no files; pass train=, validation= and/or test= (a path, a glob "
      "or a list), e.g. --train_file/--validation_file or --gin.custom.register.train=\"'my.tsv'\""
    )
  fields = _fields(objective, inputs_field, targets_field, text_field)
  vocab = get_vocabulary() if vocabulary is None else as_vocabulary(vocabulary)
  args = {
    **{split: split_files.get(split) for split in SPLITS},
    "format": format,
    "objective": objective,
    "inputs_field": inputs_field,
    "targets_field": targets_field,
    "text_field": text_field,
    "vocabulary": vocab,
    "metrics": metrics,
  }
  if name in seqio.TaskRegistry.names() or name in seqio.MixtureRegistry.names():
    before = _registered.get(name)
    if before is None:
      raise ValueError(f"task {name!r} is already registered (not by custom.register); choose another name")
    differing = [k for k in args if args[k] != before[k]]
    if differing:
      k = differing[0]
      raise ValueError(
        f"task {name!r} is already registered with {k}={before[k]!r}, not {args[k]!r}; register "
        "these files under another name"
      )
    return name
  _check_local(split_files, format)
  source = FileSource(split_files, fields, format)
  if objective == "span_corruption":
    add_span_corruption_task(name, source, vocab)
  else:
    add_task(name, source, [], as_text, [METRICS[m] for m in metrics], vocab)
  _registered[name] = args
  return name
