"""Where task data comes from: a dataset's official release files in a local data directory, else TFDS.

The local data directory is ``set_data_dir(path)`` (the trainer's ``data_dir`` gin binding) or
``$REMIXER_T5_DATA_DIR``; inside it each dataset keeps its release archive's own layout, e.g.
``super_glue/BoolQ/val.jsonl``, ``glue/MNLI/dev_matched.tsv``, ``anli/R1/dev.jsonl``, ``cogs/gen.tsv``.
A task reads its local copy when the dataset's folder exists there, and TFDS otherwise (or says where it
looked when it has no TFDS twin). The choice is made when a dataset is built, never at import.

The data directory may be a ``gs://bucket/path``: its folders are looked up and its files listed and read
through ``remixer_t5.storage`` (a bucket that cannot be reached is one error naming DATA_DIR); another URL
scheme is refused in one line rather than taken for a local folder that does not exist.

Local rows are converted to the TFDS features of the same dataset (same names, dtypes, label ids, -1 for
unlabeled test rows), so one chain of preprocessors serves both sources. Readers raise ``ValueError`` naming
file and line for a malformed row.
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import seqio
import tensorflow as tf

from remixer_t5 import storage

DATA_ENV_VAR = "REMIXER_T5_DATA_DIR"
_data_dir_override: str | None = None
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")  # a URL scheme (gs://, s3://); one letter is a Windows drive
_checked_buckets: set[str] = set()


def set_data_dir(path: str | os.PathLike | None) -> None:
  """Sets the local data directory for this process (None: back to ``$REMIXER_T5_DATA_DIR``)."""
  global _data_dir_override
  _data_dir_override = None if path is None else os.fspath(path)


def data_dir() -> str | None:
  """The local data directory: ``set_data_dir``'s value, else ``$REMIXER_T5_DATA_DIR``, else None."""
  return _data_dir_override or os.environ.get(DATA_ENV_VAR) or None


def dataset_dir(root: str, local_dir: str):
  """``<root>/<local_dir>``: a ``pathlib.Path`` for a local folder (``~`` expanded), an ``epath.Path`` for
  ``gs://`` (the bucket checked once per process: StorageError naming DATA_DIR when it cannot be read); another
  URL scheme is a ValueError."""
  if _URL.match(root):
    path = storage.run_path(root)  # ValueError for a scheme other than gs://
    if root not in _checked_buckets:
      storage.check_bucket(path, what="DATA_DIR")
      _checked_buckets.add(root)
    return path / local_dir
  return Path(root).expanduser() / local_dir


def glob_files(pattern: str) -> list[str]:
  """The files matching ``pattern`` (local or ``gs://``), sorted."""
  if pattern.startswith("gs://"):
    return storage.glob(pattern)
  return sorted(glob.glob(pattern))


def _describe_data_dir() -> str:
  if _data_dir_override:
    return f"data_dir={_data_dir_override!r}"
  if os.environ.get(DATA_ENV_VAR):
    return f"${DATA_ENV_VAR}={os.environ[DATA_ENV_VAR]!r}"
  return f"${DATA_ENV_VAR} is not set"


# --- row readers: every error names file and line ----------------------------------------------------------
def open_text(path: str) -> io.TextIOBase:
  """A UTF-8 text file (a BOM dropped, ``.gz`` decompressed), local or ``gs://`` (read through remixer_t5.storage)."""
  raw = storage.run_path(path).open("rb") if storage.is_bucket(path) else open(path, "rb")  # noqa: SIM115
  if path.endswith(".gz"):
    raw = gzip.GzipFile(fileobj=raw)
  return io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")


def parse_json_line(path: str, lineno: int, line: str, required: Sequence[str] = ()) -> dict | None:
  """One JSON-lines line as an object (None for a blank line); ValueError naming file and line."""
  if lineno == 1:
    line = line.lstrip("\ufeff")
  if not line.strip():
    return None
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg}): {line[:120]!r}") from None
  if not isinstance(row, dict):
    raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}: {line[:120]!r}")
  missing = [k for k in required if k not in row]
  if missing:
    raise ValueError(f"{path}:{lineno}: row lacks field(s) {missing}; expected {list(required)}, got {sorted(row)}")
  return row


def read_jsonl(path: str, required: Sequence[str] = ()) -> Iterator[tuple[int, dict]]:
  """(line number, object) for each non-blank line of a JSON-lines file (``.gz`` too)."""
  with open_text(path) as f:
    for lineno, line in enumerate(f, start=1):
      row = parse_json_line(path, lineno, line, required)
      if row is not None:
        yield lineno, row


def read_tsv(path: str, columns: Sequence[str] | None = None, *, header: bool = True) -> Iterator[tuple[int, dict]]:
  """(line number, {column: value}) for each row of a tab-separated file.

  With ``header``, the first line names the columns and must contain ``columns``; without, ``columns`` name the fields
  in order. A row with another number of fields than the columns is an error. No quoting (TFDS's ``csv.QUOTE_NONE``)."""
  with open_text(path) as f:
    reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    names = list(columns or [])
    for row in reader:
      lineno = reader.line_num
      if not any(cell.strip() for cell in row):
        continue
      if header and lineno == 1:
        names = [c.strip() for c in row]
        missing = [c for c in (columns or []) if c not in names]
        if missing:
          raise ValueError(f"{path}:1: header lacks column(s) {missing}; expected {list(columns)}, got {names}")
        continue
      if len(row) != len(names):
        raise ValueError(
          f"{path}:{lineno}: malformed row: expected {len(names)} tab-separated fields "
          f"({', '.join(names) or 'no header'}), got {len(row)}: {chr(9).join(row)[:120]!r}"
        )
      yield lineno, dict(zip(names, row))


def read_line_blocks(path: str) -> Iterator[tuple[int, list[str]]]:
  """(line number of its first line, its lines stripped) for each block of non-blank lines separated by blank
  lines (e.g. DPR's ``train.c.txt``: sentence, pronoun, candidates, answer, then a blank line)."""
  with open_text(path) as f:
    block, start = [], 0
    for lineno, line in enumerate(f, start=1):
      if line.strip():
        start = start or lineno
        block.append(line.strip())
      elif block:
        yield start, block
        block, start = [], 0
    if block:
      yield start, block


# --- the source ---------------------------------------------------------------------------------------------
RowReader = Callable[[str], Iterable[Mapping[str, Any]]]
# (path, line number, line) -> row, or None for a line that holds no row (blank).
LineParser = Callable[[str, int, str], Mapping[str, Any] | None]


class LocalOrTfdsSource(seqio.DataSource):
  """A seqio DataSource reading ``<data dir>/<local_dir>`` when it exists, else ``tfds_name``.

  Args:
    local_dir: the dataset's folder inside the data directory, e.g. ``"super_glue/BoolQ"``.
    local_files: split -> file name or glob(s) inside ``local_dir`` (several files are read in sorted order).
    reader: path -> rows (dicts in the TFDS feature layout); it validates and raises ValueError(file:line).
    features: feature name -> ``tf.TensorSpec`` (nested dicts allowed) of a row, as TFDS gives them.
    tfds_name: ``"name/config:version"`` (pinned) or None when TFDS lacks the dataset.
    tfds_splits: split -> TFDS split name, where they differ (default: the same names).
    line_parser: for corpora too large to hold (C4), (path, line number, line) -> row or None: the files are then
      streamed, one at a time, by tf.data itself (``lines_dataset``), so the input position can be checkpointed.
      Without it the files are read whole when the dataset is built, so a malformed row fails there with a plain
      ValueError.
    tfds_read_only: read the TFDS copy, never build it (C4: a Beam job over Common Crawl).

  Both local forms are tf.data-native (``rows_dataset``: tensors sliced by index; ``lines_dataset``:
  ``TextLineDataset`` with the parsing in a batched map), so a training run's ``tf.train.Checkpoint`` of its
  input iterator holds the position and restores it in constant time (docs/architecture.md, "Input position")."""

  def __init__(
    self,
    *,
    local_dir: str,
    local_files: Mapping[str, str | Sequence[str]],
    reader: RowReader,
    features: Mapping[str, Any],
    tfds_name: str | None = None,
    tfds_splits: Mapping[str, str] | None = None,
    line_parser: LineParser | None = None,
    tfds_read_only: bool = False,
  ):
    super().__init__(splits=list(local_files))
    self.local_dir = local_dir
    self.local_files = {k: [v] if isinstance(v, str) else list(v) for k, v in local_files.items()}
    self.reader = reader
    self.features = dict(features)
    self.tfds_name = tfds_name
    self.tfds_splits = {s: (tfds_splits or {}).get(s, s) for s in local_files}
    self.line_parser = line_parser
    self.tfds_read_only = tfds_read_only
    self._tfds: seqio.TfdsDataSource | None = None
    self._counts: dict[tuple[str, str], int] = {}

  # which copy ---------------------------------------------------------------------------------------------
  def local_root(self):
    """``<data dir>/<local_dir>`` (a ``Path``, or an ``epath.Path`` in a bucket) if it exists; None when the
    dataset should come from TFDS."""
    root = data_dir()
    if root:
      path = dataset_dir(root, self.local_dir)
      if path.is_dir():
        return path
    if self.tfds_name is None:
      looked = f"looked for {path if _URL.match(root) else path.resolve()}" if root else _describe_data_dir()
      raise FileNotFoundError(
        f"no local copy of {self.local_dir!r} ({looked}) and TFDS has no such dataset: set {DATA_ENV_VAR} "
        f"(or the data_dir gin binding) to a folder holding {self.local_dir}/ with "
        f"{', '.join(sorted({f for fs in self.local_files.values() for f in fs}))}"
      )
    return None

  def files(self, split: str) -> list[str]:
    """The local files of ``split`` (FileNotFoundError naming what is missing)."""
    if split not in self.local_files:
      raise ValueError(f"unknown split {split!r} for {self.local_dir}; expected one of {list(self.local_files)}")
    root = self.local_root()
    assert root is not None
    found = []
    for pattern in self.local_files[split]:
      matches = glob_files(str(root / pattern))
      if not matches:
        raise FileNotFoundError(f"{self.local_dir} split {split!r}: no file matches {root / pattern}")
      found.extend(matches)
    return found

  @property
  def tfds_source(self) -> seqio.TfdsDataSource:
    if self._tfds is None:
      self._tfds = seqio.TfdsDataSource(
        tfds_name=self.tfds_name, splits=self.tfds_splits, read_only=self.tfds_read_only
      )
    return self._tfds

  def _is_local(self) -> bool:
    return self.local_root() is not None

  # seqio.DataSource ---------------------------------------------------------------------------------------
  @property
  def supports_arbitrary_sharding(self) -> bool:
    return self.line_parser is None and self._is_local()

  def list_shards(self, split: str) -> Sequence[str]:
    return self.files(split) if self._is_local() else self.tfds_source.list_shards(split)

  def num_input_examples(self, split: str) -> int | None:
    if not self._is_local():
      return self.tfds_source.num_input_examples(split)
    if self.line_parser is not None:
      return None  # counting would read the whole corpus, and seqio asks on every get_dataset
    key = (str(self.local_root()), split)
    if key not in self._counts:
      self._counts[key] = sum(sum(1 for _ in self.reader(path)) for path in self.files(split))
    return self._counts[key]

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
    if not self._is_local():
      return self._tfds_dataset(split, shuffle, seed, shard_info)
    files = self.files(split)
    signature = self.features
    if self.line_parser is not None:
      if shard_info and shard_info.num_shards > 1:
        if len(files) < shard_info.num_shards:
          raise ValueError(
            f"{self.local_dir} split {split!r} has {len(files)} file(s), fewer than the "
            f"{shard_info.num_shards} input shards (processes) asked for"
          )
        files = files[shard_info.index :: shard_info.num_shards]
      if shuffle:
        files = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
      return lines_dataset(files, self.line_parser, signature)
    rows = [dict(row) for path in files for row in self.reader(path)]
    if shard_info and shard_info.num_shards > 1:
      rows = rows[shard_info.index :: shard_info.num_shards]
    return rows_dataset(rows, signature)

  def _tfds_dataset(self, split, shuffle, seed, shard_info):
    try:
      return self.tfds_source.get_dataset(split, shuffle=shuffle, seed=seed, shard_info=shard_info)
    except Exception as e:
      if isinstance(e, ValueError) and "split" in str(e).lower() and "not found" not in str(e).lower():
        raise
      raise FileNotFoundError(
        f"{self.local_dir} split {split!r}: no local copy ({_describe_data_dir()}) and TFDS "
        f"{self.tfds_name!r} could not be read ({type(e).__name__}: {str(e)[:300]}). Prepare it with TFDS "
        f"(tfds build / TFDS_DATA_DIR), or put the release files under <data dir>/{self.local_dir}/"
      ) from e

  def __repr__(self):
    return (
      f"{type(self).__name__}(local_dir={self.local_dir!r}, tfds_name={self.tfds_name!r}, splits={list(self.splits)})"
    )


# --- tf.data-native local datasets (checkpointable: their iterator state is an index) -----------------------
def rows_dataset(rows: Sequence[Mapping[str, Any]], signature: Mapping[str, Any]):
  """A ``tf.data.Dataset`` of ``rows`` (dicts, nested as ``signature``) sliced from column tensors.

  Leaves of ``signature`` are ``tf.TensorSpec`` of shape ``[]`` or ``[None]`` (variable-length lists, e.g.
  ReCoRD's entities). Unlike ``Dataset.from_generator``, the iterator's state is a row index, so
  ``tf.train.Checkpoint(iterator=...)`` saves and restores it in constant time."""

  def column(values, spec, where):
    if spec.shape.rank == 0:
      return tf.constant(values, dtype=spec.dtype, shape=[len(values)])
    if spec.shape.rank == 1 and spec.shape[0] is None:
      lengths = [len(v) for v in values]
      flat = tf.constant([x for v in values for x in v], dtype=spec.dtype, shape=[sum(lengths)])
      return tf.RaggedTensor.from_row_lengths(flat, tf.constant(lengths, tf.int64))
    raise ValueError(f"rows_dataset: feature {where} has spec {spec}; expected shape [] or [None]")

  def columns(rows, spec, where):
    if isinstance(spec, Mapping):
      return {k: columns([r[k] for r in rows], v, f"{where}/{k}") for k, v in spec.items()}
    return column(rows, spec, where)

  ds = tf.data.Dataset.from_tensor_slices(columns(list(rows), signature, ""))
  # Ragged columns slice to rank-1 RaggedTensorSpecs; give the rows the plain TensorSpecs TFDS gives.
  return ds.map(
    lambda row: tf.nest.map_structure(
      lambda x: x.to_tensor() if isinstance(x, tf.RaggedTensor) else tf.identity(x), row
    )
  )


def lines_dataset(files: Sequence[str], parse: LineParser, signature: Mapping[str, Any], lines_per_call: int = 128):
  """Rows of line-per-row files (``.gz`` too), read by ``tf.data.TextLineDataset`` in file order.

  ``parse(path, line number, line)`` runs in a ``tf.py_function`` over ``lines_per_call`` lines at a time, in parallel
  maps (order kept); it returns a row (flat dict of scalars as ``signature``) or None to drop the line. Its ValueError
  (naming file and line) surfaces as a tf.errors.OpError carrying the message. The parse is a pure function of the line,
  so the pipeline is checkpointable (the dataset's external-state policy is IGNORE: the py_function holds no state).
  A ``gs://`` file is read from a local copy (``storage.local_copy``, made when the file is reached, once per
  process), since TensorFlow's own GCS client cannot be pointed at anything but Google's endpoint."""
  names = list(signature)
  specs = [signature[k] for k in names]
  if any(isinstance(s, Mapping) or s.shape.rank != 0 for s in specs):
    raise ValueError(f"lines_dataset: rows must be flat dicts of scalars, got {signature}")
  compression = ["GZIP" if f.endswith(".gz") else "" for f in files]

  def read(path, comp):
    local = tf.py_function(lambda p: storage.local_copy(p.numpy().decode()), [path], tf.string)
    local.set_shape([])
    lines = tf.data.TextLineDataset(local, compression_type=comp).enumerate(start=1)
    return lines.map(lambda i, line: (path, i, line))

  def parse_many(paths, linenos, lines):
    keep, out = [], [[] for _ in names]
    for p, i, line in zip(paths.numpy(), linenos.numpy(), lines.numpy()):
      row = parse(p.decode(), int(i), line.decode("utf-8"))
      keep.append(row is not None)
      for col, name, spec in zip(out, names, specs):
        col.append(row[name] if row is not None else ("" if spec.dtype == tf.string else 0))
    return [tf.constant(keep, tf.bool)] + [tf.constant(c, s.dtype, shape=[len(c)]) for c, s in zip(out, specs)]

  def parse_batch(paths, linenos, lines):
    outs = tf.py_function(parse_many, [paths, linenos, lines], [tf.bool] + [s.dtype for s in specs])
    for o in outs:
      o.set_shape([None])
    return tuple(outs)

  ds = tf.data.Dataset.from_tensor_slices(
    (tf.constant(list(files), tf.string), tf.constant(compression, tf.string))
  ).flat_map(read)
  ds = ds.batch(lines_per_call).map(parse_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.unbatch().filter(lambda keep, *values: keep)
  ds = ds.map(lambda keep, *values: dict(zip(names, values)))
  options = tf.data.Options()
  options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
  return ds.with_options(options)
