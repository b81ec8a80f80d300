"""seqio task ``cogs``: COGS (Kim & Linzen 2020) semantic parsing from local files.

Data: the official release TSVs (no header; sentence, logical form, category) in ``<data dir>/cogs/``
(``sources.data_dir()``: the data_dir binding or ``$REMIXER_T5_DATA_DIR``). Splits follow TFDS naming:

    train -> train.tsv   validation -> dev.tsv   test -> test.tsv   gen -> gen.tsv

Examples: ``inputs`` = the sentence as is (no task prefix such as "cogs: "; COGS is trained on its own, and the
sentence is what the literature feeds the model), ``targets`` = the logical form. seqio keeps the raw text as
``inputs_pretokenized`` / ``targets_pretokenized``; ``category`` (e.g. ``in_distribution`` or a generalization type
in gen.tsv) is kept alongside. Both features get EOS.

The generalization split reads ``gen.tsv`` (the release's 21 categories) when it is there, else
``gen_sample.tsv`` (any subset of the categories in the same format), or the file given to
``set_gen_file`` / ``$REMIXER_T5_COGS_GEN``; ``gen_path()`` says which.

Vocabularies, two tasks over the same data:
  ``cogs``        T5's SentencePiece with 100 extra ids (``vocab.t5_vocabulary()``, read lazily on first use),
                  as the Remixer paper's pretrained models use (``gin/runs/cogs.gin``, finetuning);
  ``cogs_words``  the word vocabulary of COGS's train split, both columns (``cogs_word_vocabulary()``,
                  ``remixer_t5/data/word_vocab.py``): one piece per train word as Kim & Linzen's word tokens,
                  digits and characters as fallback so every dev/test/gen string round-trips; built on first
                  use and cached under ``$REMIXER_T5_CACHE_DIR/cogs/`` keyed on train.tsv's hash. Models trained
                  from scratch use it (``remixer-t5 repro cogs``, ``gin/runs/cogs_scratch.gin``).
``register_cogs_task(name, vocabulary)`` registers the data with any other vocabulary. The project's embedded
vocabulary is no substitute: it has no piece for "_" or "*", which every COGS logical form uses.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import seqio
import tensorflow as tf
from remixer_t5.data import embedded_corpus, word_vocab
from remixer_t5.tasks import sources
from remixer_t5.tasks.common import add_task
from remixer_t5.tasks.metrics import cogs_accuracy, cogs_postprocess

TASK_NAME = "cogs"
WORDS_TASK_NAME = "cogs_words"
DATA_ENV_VAR = sources.DATA_ENV_VAR
GEN_ENV_VAR = "REMIXER_T5_COGS_GEN"
SPLIT_FILES = {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv", "gen": "gen.tsv"}
GEN_FALLBACK = "gen_sample.tsv"  # a subset of gen.tsv's categories (the full file is 21 x 1,000 rows)
NUM_FIELDS = 3
_gen_file: str | None = None


def set_gen_file(path: str | os.PathLike | None) -> None:
  """Read the gen split from ``path`` (None: ``$REMIXER_T5_COGS_GEN``, else gen.tsv, else gen_sample.tsv)."""
  global _gen_file
  if path is not None and not Path(path).expanduser().is_file():
    raise FileNotFoundError(f"COGS gen file not found: {path} (looked at {Path(path).expanduser().resolve()})")
  _gen_file = None if path is None else str(Path(path).expanduser())


def gen_path(data_dir: str | os.PathLike | None = None) -> Path:
  """The file the gen split reads: set_gen_file's, $REMIXER_T5_COGS_GEN, cogs/gen.tsv, cogs/gen_sample.tsv."""
  chosen = _gen_file or os.environ.get(GEN_ENV_VAR)
  if chosen:
    path = Path(chosen).expanduser()
    if not path.is_file():
      raise FileNotFoundError(
        f"COGS gen file not found: {chosen} (from {'set_gen_file' if _gen_file else '$' + GEN_ENV_VAR})"
      )
    return path
  folder = cogs_dir(data_dir)
  for name in (SPLIT_FILES["gen"], GEN_FALLBACK):
    if (folder / name).is_file():
      return folder / name
  raise FileNotFoundError(
    f"COGS 'gen' split not found: looked for {folder.resolve()}/{SPLIT_FILES['gen']} and {GEN_FALLBACK}. Put "
    f"the release's gen.tsv there (the folder comes from {DATA_ENV_VAR}), or pass a gen file "
    f"(set ${GEN_ENV_VAR})."
  )


def cogs_dir(data_dir: str | os.PathLike | None = None) -> Path:
  """``<data_dir or $REMIXER_T5_DATA_DIR>/cogs``; FileNotFoundError if it is not there."""
  where = data_dir if data_dir is not None else sources.data_dir()
  if not where:
    raise FileNotFoundError(
      f"COGS data directory unknown: ${DATA_ENV_VAR} is not set. Set {DATA_ENV_VAR} to a "
      "folder holding cogs/{train,dev,test,gen}.tsv (the COGS release, "
      "github.com/najoungkim/COGS data/)."
    )
  if str(where).startswith("gs://"):
    raise ValueError(
      f"COGS reads its release files from a local folder; {where!r} is a bucket: copy "
      "cogs/{train,dev,test,gen}.tsv to a local DATA_DIR (about 6 MB)"
    )
  path = Path(where).expanduser() / "cogs"
  if not path.is_dir():
    raise FileNotFoundError(
      f"COGS data directory not found: looked for {path.resolve()} "
      f"(from {'data_dir' if data_dir is not None else '$' + DATA_ENV_VAR}={where!r}). "
      f"Set {DATA_ENV_VAR} to a folder holding cogs/{{train,dev,test,gen}}.tsv."
    )
  return path


def split_path(split: str, data_dir: str | os.PathLike | None = None) -> Path:
  """The TSV file of ``split``; FileNotFoundError if missing, ValueError for an unknown split."""
  if split not in SPLIT_FILES:
    raise ValueError(f"unknown COGS split {split!r}; expected one of {list(SPLIT_FILES)}")
  if split == "gen":
    return gen_path(data_dir)
  path = cogs_dir(data_dir) / SPLIT_FILES[split]
  if not path.is_file():
    raise FileNotFoundError(
      f"COGS {split!r} split not found: looked for {path.resolve()}. Put "
      f"{SPLIT_FILES[split]} there, or set {DATA_ENV_VAR} to a folder holding "
      f"cogs/{SPLIT_FILES[split]}."
    )
  return path


def read_cogs_tsv(path: str | os.PathLike) -> list[tuple[str, str, str]]:
  """Rows ``(sentence, logical form, category)`` of a COGS TSV, validated: blank lines are skipped; any other line
  must have exactly 3 tab-separated fields, else ValueError naming the file and (1-based) line number."""
  return [row for _, row in read_cogs_tsv_lines(path)]


def read_cogs_tsv_lines(path: str | os.PathLike) -> list[tuple[int, tuple[str, str, str]]]:
  """``read_cogs_tsv``'s rows, each with its 1-based line number in the file
  (blank lines skipped, so a row's index and its line may differ)."""
  rows = []
  with open(path, encoding="utf-8", newline="") as f:
    for lineno, line in enumerate(f, start=1):
      line = line.rstrip("\r\n")
      if not line.strip():
        continue
      fields = line.split("\t")
      if len(fields) != NUM_FIELDS:
        raise ValueError(
          f"{path}:{lineno}: malformed COGS row: expected {NUM_FIELDS} tab-separated fields "
          f"(sentence, logical form, category), got {len(fields)}: {line[:120]!r}"
        )
      rows.append((lineno, tuple(fields)))
  return rows


def cogs_dataset_fn(split: str, shuffle_files: bool, seed=None, *, data_dir=None):
  """seqio dataset_fn: features ``inputs``, ``targets``, ``category`` (tf.string). The TSV is read host-side
  when called (so errors surface in Python); ``shuffle_files`` is irrelevant for a single file per split."""
  del shuffle_files, seed

  rows = read_cogs_tsv(split_path(split, data_dir))
  columns = list(zip(*rows)) if rows else [(), (), ()]
  return tf.data.Dataset.from_tensor_slices(
    {key: tf.constant(list(values), dtype=tf.string) for key, values in zip(("inputs", "targets", "category"), columns)}
  )


def register_cogs_task(name: str = TASK_NAME, vocabulary=None, *, data_dir=None) -> str:
  """Registers COGS under ``name`` (splits train/validation/test/gen; no I/O here); returns ``name``.

  ``vocabulary``: a seqio.Vocabulary, a SentencePiece model path, or None (T5's vocabulary). ``data_dir``: folder
  holding ``cogs/`` (default: ``$REMIXER_T5_DATA_DIR``, read when a dataset is built). Registering the same name
  again with an equal vocabulary is a no-op; with another one, ValueError."""
  source = seqio.FunctionDataSource(functools.partial(cogs_dataset_fn, data_dir=data_dir), splits=list(SPLIT_FILES))
  return add_task(name, source, [], cogs_postprocess, [cogs_accuracy], vocabulary)


def _word_model_path(data_dir=None) -> Path:
  train = split_path("train", data_dir)
  name = f"word_vocab_v{word_vocab.FORMAT}_{word_vocab.file_digest(train)}.model"
  cache = embedded_corpus.cache_root() / "cogs" / name
  return word_vocab.cached_model(
    cache, lambda: [text for row in read_cogs_tsv(train) for text in row[:2]], f"COGS train ({train})"
  )


def cogs_word_vocabulary(data_dir=None) -> seqio.Vocabulary:
  """The word vocabulary of COGS's train split (sentences and logical forms); lazy: built on first use."""
  return word_vocab.lazy_vocabulary(f"cogs_words(data_dir={data_dir!r})", functools.partial(_word_model_path, data_dir))


register_cogs_task(TASK_NAME)
register_cogs_task(WORDS_TASK_NAME, cogs_word_vocabulary())
