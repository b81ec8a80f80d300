"""Vocabularies: the project's embedded SentencePiece model, or a given one.

The embedded vocabulary is a SentencePiece unigram model trained on the train split of the embedded corpus (see
``embedded_corpus``) with T5's special ids (pad=0, eos=1, unk=2, no bos). It is cached beside the corpus as
``<corpus dir>/spm_unigram_<size>.model`` and trained only on first use: the vocabulary object returned by
``get_vocabulary()`` does no I/O until something asks it for its model (``vocab_size``, ``encode``, ...).
"""

from __future__ import annotations

import functools
import io
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm

from remixer_t5.data import embedded_corpus, word_vocab

if TYPE_CHECKING:
  import seqio

# seqio (and with it TensorFlow) is imported only when a vocabulary is built: gin model files import this module,
# and `remixer-t5 compile` must not pull TensorFlow in (tests/test_compile.py checks).

# T5's public vocabulary (32k pieces, cc_all); needs GCS access at use time. seqio 0.0.20 no longer exports
# DEFAULT_SPM_PATH (t5.data did), so it is spelled out.
T5_VOCAB_PATH = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
T5_VOCAB_ENV_VAR = "REMIXER_T5_VOCAB"  # a local copy of T5's vocabulary, for machines without GCS
DEFAULT_VOCAB_SIZE = 2000
DEFAULT_EXTRA_IDS = 100

PAD_ID, EOS_ID, UNK_ID, BOS_ID = 0, 1, 2, -1
_MIN_VOCAB_SIZE = 100


def vocab_model_path(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir=None) -> Path:
  """Where the embedded SentencePiece model of ``vocab_size`` pieces lives (no I/O)."""
  return embedded_corpus.corpus_dir(cache_dir) / f"spm_unigram_{vocab_size}.model"


def train_sentencepiece(texts, vocab_size: int = DEFAULT_VOCAB_SIZE) -> bytes:
  """Trains a deterministic unigram SentencePiece model; returns the model proto. ``texts`` is an iterable of
  documents; each line is one training sentence. Single thread, no sentence sampling or shuffling: the same texts
  give the same model bytes."""
  if vocab_size < _MIN_VOCAB_SIZE:
    raise ValueError(f"vocab_size must be >= {_MIN_VOCAB_SIZE}, got {vocab_size}")

  def sentences():
    for text in texts:
      for line in text.split("\n"):
        line = line.strip()
        if line:
          yield line

  model = io.BytesIO()
  spm.set_random_generator_seed(1234)
  spm.SentencePieceTrainer.train(
    sentence_iterator=sentences(),
    model_writer=model,
    model_type="unigram",
    vocab_size=vocab_size,
    hard_vocab_limit=False,  # a small corpus may support fewer pieces
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    pad_piece="<pad>",
    eos_piece="</s>",
    unk_piece="<unk>",
    character_coverage=0.9995,
    num_threads=1,
    input_sentence_size=0,  # use every sentence
    shuffle_input_sentence=False,
    max_sentence_length=1 << 16,
    minloglevel=2,
  )
  return model.getvalue()


def prepare_vocabulary(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir=None) -> Path:
  """Returns the embedded model file, training it (and the corpus) on first call."""
  path = vocab_model_path(vocab_size, cache_dir)
  if path.exists():
    return path
  embedded_corpus.prepare(cache_dir)
  start = time.perf_counter()
  texts = [doc["text"] for doc in embedded_corpus.read_split("train", cache_dir)]
  model = train_sentencepiece(texts, vocab_size)
  embedded_corpus.atomic_write_bytes(path, model)
  print(
    f"remixer_t5: trained SentencePiece vocabulary {path} ({time.perf_counter() - start:.1f}s)",
    file=sys.stderr,
    flush=True,
  )
  return path


@functools.cache
def _embedded_class():
  """``EmbeddedSentencePieceVocabulary``, defined on first use (it subclasses a seqio class)."""

  class EmbeddedSentencePieceVocabulary(word_vocab.LazySentencePieceVocabulary):
    """``seqio.SentencePieceVocabulary`` over the embedded model, prepared lazily.

    The model path is resolved (from ``cache_dir`` or ``$REMIXER_T5_CACHE_DIR``) at each use, and the
    model trained if missing only when the model is first needed there."""

    def __init__(
      self,
      vocab_size: int = DEFAULT_VOCAB_SIZE,
      extra_ids: int = DEFAULT_EXTRA_IDS,
      cache_dir: str | os.PathLike | None = None,
    ):
      self._spm_vocab_size = vocab_size
      self._cache_dir = None if cache_dir is None else str(cache_dir)
      super().__init__(
        f"embedded({vocab_size}, {self._cache_dir!r})",
        functools.partial(prepare_vocabulary, vocab_size, self._cache_dir),
        extra_ids,
      )

    def _resolve(self) -> str:
      if str(vocab_model_path(self._spm_vocab_size, self._cache_dir)) != self._resolved_file:
        self._resolved_file = None  # first use, or $REMIXER_T5_CACHE_DIR moved: prepare there
      return super()._resolve()

    def __repr__(self):
      return (
        f"{type(self).__name__}(vocab_size={self._spm_vocab_size}, "
        f"extra_ids={self._extra_ids}, cache_dir={self._cache_dir!r})"
      )

    __str__ = __repr__

  EmbeddedSentencePieceVocabulary.__qualname__ = "EmbeddedSentencePieceVocabulary"
  EmbeddedSentencePieceVocabulary.__module__ = __name__
  return EmbeddedSentencePieceVocabulary


def __getattr__(name: str):
  if name == "EmbeddedSentencePieceVocabulary":  # pickling and isinstance checks find it here
    return _embedded_class()
  if name == "SentencePieceVocabulary":
    return _sentencepiece_class()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class VocabularyUnavailable(FileNotFoundError):
  """A SentencePiece model that cannot be read where it was looked for (an unreachable bucket, no credentials, a
  missing object); the message names it and what to do."""


@functools.cache
def _sentencepiece_class():
  """This module's ``SentencePieceVocabulary``, defined on first use (it subclasses seqio's)."""
  import seqio

  class SentencePieceVocabulary(seqio.SentencePieceVocabulary):
    """``seqio.SentencePieceVocabulary`` as it is (same name, state and ids: equal to seqio's over the same
    file), except that a model that cannot be read (``gs://...`` unreachable, no credentials) is one
    VocabularyUnavailable naming the path and the fix, where seqio raises TensorFlow's I/O error from deep
    inside tf.io.gfile."""

    def _model_context(self):
      try:
        return super()._model_context()
      except VocabularyUnavailable:
        raise
      except Exception as e:  # noqa: BLE001 - tf.errors.* and OSError: any failed read of the model
        raise VocabularyUnavailable(unavailable_message(self._sentencepiece_model_file, e)) from e

  SentencePieceVocabulary.__qualname__ = "SentencePieceVocabulary"  # pickled by name: the module's __getattr__
  SentencePieceVocabulary.__module__ = __name__
  return SentencePieceVocabulary


def unavailable_message(path: str, error: BaseException) -> str:
  """What to say when the SentencePiece model at ``path`` cannot be read: the path, the first line of the
  reader's error, and the fix (for T5's default vocabulary: $REMIXER_T5_VOCAB)."""
  text = str(getattr(error, "message", None) or error).strip().splitlines()
  why = f" ({type(error).__name__}: {text[0][:200]})" if text else f" ({type(error).__name__})"
  if path == T5_VOCAB_PATH and not os.environ.get(T5_VOCAB_ENV_VAR):
    fix = (
      f"set ${T5_VOCAB_ENV_VAR} to a local copy of this sentencepiece.model (fetched once with `gcloud "
      f"storage cp {T5_VOCAB_PATH} .`)"
    )
  else:
    fix = "check the path, the network and the credentials, or point at a local copy of the file"
  return f"cannot read the SentencePiece model {path}{why}; {fix}"


def get_vocabulary(
  path: str | None = None,
  extra_ids: int = DEFAULT_EXTRA_IDS,
  *,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
  cache_dir: str | os.PathLike | None = None,
) -> seqio.SentencePieceVocabulary:
  """The vocabulary for ``path``, or the embedded one when ``path`` is None (``vocab_size`` and ``cache_dir`` apply
  to it only). Remote paths (``gs://...``) are read on first use, a failed read raising VocabularyUnavailable; a
  local path that does not exist raises FileNotFoundError."""
  if path is None:
    return _embedded_class()(vocab_size, extra_ids, cache_dir)
  path = os.fspath(path)
  if "://" not in path:
    local = Path(path).expanduser()
    if not local.is_file():
      raise FileNotFoundError(
        f"SentencePiece model not found: {path} (looked at {local.resolve()}). Pass the path of an existing "
        ".model file (e.g. the shared T5 vocabulary t5_cc_all_32000/sentencepiece.model, or T5_VOCAB_PATH = "
        f"{T5_VOCAB_PATH!r} with GCS access), or None for the project's embedded vocabulary."
      )
    path = str(local)
  return _sentencepiece_class()(path, extra_ids=extra_ids)  # read on first use (a remote one: gs://)


def t5_vocab_path() -> str:
  """T5's SentencePiece model: ``$REMIXER_T5_VOCAB`` when set (a local copy), else ``T5_VOCAB_PATH`` (GCS)."""
  return os.environ.get(T5_VOCAB_ENV_VAR) or T5_VOCAB_PATH


def t5_vocabulary(path: str | None = None, extra_ids: int = DEFAULT_EXTRA_IDS) -> seqio.SentencePieceVocabulary:
  """T5's vocabulary with 100 extra ids (32,100 ids), the default of every benchmark task; lazy (no I/O).

  ``path``: a copy of T5's SentencePiece model (default: ``t5_vocab_path()``)."""
  return get_vocabulary(path or t5_vocab_path(), extra_ids)
