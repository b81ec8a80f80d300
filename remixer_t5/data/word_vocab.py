"""Word vocabularies as SentencePiece models: one piece per training word, characters and bytes as fallback.

Kim & Linzen (2020) train COGS models on word tokens. A word list built from a train split alone cannot represent every
evaluation string (COGS's dev/test hold 'gardner', gen's variable indices run to ``x _ 44`` where train's stop at 18),
so the model built here is a SentencePiece *unigram* model written directly (no training): its pieces are

  - the specials pad=0, eos=1, unk=2 (T5's ids, no bos), as every vocabulary of this project;
  - one piece ``▁word`` per distinct whitespace-separated training word without a digit (score -1);
  - every digit alone, with and without the word-start mark (``▁4``, ``4``): numbers are spelled digit by
    digit, so ``44`` is ``▁4 4`` and every index of any split is made of pieces seen in training;
  - every training character alone, with and without the word-start mark (score -20), so a word never seen
    in training is spelled from known characters;
  - the 256 byte pieces (SentencePiece's byte fallback) for characters never seen in training.

Encoding is SentencePiece's Viterbi over these pieces, so a training word is always one piece and an unseen word the
fewest pieces that spell it. The normaliser is the identity on every character but one and whitespace is kept as
written, so any single-space-separated string decodes back exactly (``round_trip_failures`` counts those that do not).
The one exception, ``NORMALIZATION_RULE``, exists because with an empty character map (plain identity) tf_text's copy of
SentencePiece logs "precompiled_charsmap is empty. use identity normalization." whenever it loads the model (on every
dataset built from it), and SentencePiece compiles no map without a rule: it refuses an empty rule list and identity
rules. So the map holds one rule on a character no text should hold, the Unicode noncharacter U+FFFF, mapped to U+FFFD
(the replacement character), compiled by SentencePiece's own trainer.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from remixer_t5.data.embedded_corpus import atomic_write_bytes

SPACE = "\u2581"  # SentencePiece's word-start mark
WORD_SCORE, CHAR_SCORE = -1.0, -20.0
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
NORMALIZATION_RULE = ("\uffff", "\ufffd")  # the character map's one rule (module docstring)
# Bumped when build_word_model's output changes for the same texts (cache file names carry it). 2: the one-rule
# character map instead of an empty one (same pieces and ids).
FORMAT = 2


def _charsmap() -> bytes:
  """SentencePiece's precompiled character map of ``NORMALIZATION_RULE`` alone, compiled by its trainer (a
  throwaway 12-piece model over a few letters; milliseconds, deterministic)."""
  source, target = (" ".join(f"{ord(c):04X}" for c in side) for side in NORMALIZATION_RULE)
  with tempfile.TemporaryDirectory() as tmp:
    rules = Path(tmp) / "rules.tsv"
    rules.write_text(f"{source}\t{target}\n", encoding="utf-8")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(["a b c d e f g"] * 20),
      model_writer=out,
      vocab_size=12,
      model_type="char",
      normalization_rule_tsv=str(rules),
      minloglevel=2,
    )
  m = pb.ModelProto()
  m.ParseFromString(out.getvalue())
  return m.normalizer_spec.precompiled_charsmap


def build_word_model(texts: Iterable[str]) -> bytes:
  """The serialized SentencePiece ModelProto of the word vocabulary of ``texts`` (deterministic)."""
  words: collections.Counter = collections.Counter()
  chars: set[str] = set()
  for text in texts:
    for word in text.split(" "):
      if word:
        chars.update(word)
        if not any(c.isdigit() for c in word):
          words[word] += 1
  if not words and not chars:
    raise ValueError("build_word_model: the texts hold no word; a vocabulary needs at least one")
  m = pb.ModelProto()
  spec = m.trainer_spec
  spec.model_type = pb.TrainerSpec.UNIGRAM
  spec.pad_id, spec.eos_id, spec.unk_id, spec.bos_id = PAD_ID, EOS_ID, UNK_ID, -1
  spec.pad_piece, spec.eos_piece, spec.unk_piece = "<pad>", "</s>", "<unk>"
  spec.byte_fallback = True
  spec.split_digits = True
  norm = m.normalizer_spec
  norm.name = "user_defined"  # what SentencePiece's trainer names a map compiled from a rule file
  norm.precompiled_charsmap = _charsmap()
  norm.add_dummy_prefix = True
  norm.remove_extra_whitespaces = False
  norm.escape_whitespaces = True
  Piece = pb.ModelProto.SentencePiece

  def add(piece: str, score: float, kind=Piece.NORMAL):
    p = m.pieces.add()
    p.piece, p.score, p.type = piece, score, kind

  add("<pad>", 0.0, Piece.CONTROL)
  add("</s>", 0.0, Piece.CONTROL)
  add("<unk>", 0.0, Piece.UNKNOWN)
  for b in range(256):
    add(f"<0x{b:02X}>", 0.0, Piece.BYTE)
  seen = set()
  # Words by frequency then spelling (deterministic ids); digits and characters after them.
  for word, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
    seen.add(SPACE + word)
    add(SPACE + word, WORD_SCORE)
  singles = sorted(chars | set("0123456789"))
  for prefix in (SPACE, ""):
    for c in singles:
      if prefix + c not in seen:
        seen.add(prefix + c)
        add(prefix + c, CHAR_SCORE)
  if SPACE not in seen:
    add(SPACE, CHAR_SCORE)
  spec.vocab_size = len(m.pieces)
  return m.SerializeToString()


def round_trip_failures(vocabulary, texts: Iterable[str]) -> list[str]:
  """The texts that do not decode back to themselves after encoding with ``vocabulary`` (a seqio one)."""
  return [t for t in texts if vocabulary.decode(vocabulary.encode(t)) != t]


def cached_model(cache_path: Path, texts_fn: Callable[[], Iterable[str]], what: str) -> Path:
  """``cache_path``, built from ``texts_fn()`` with ``build_word_model`` (atomically) when missing."""
  if cache_path.is_file():
    return cache_path
  start = time.perf_counter()
  model = build_word_model(texts_fn())
  cache_path.parent.mkdir(parents=True, exist_ok=True)
  atomic_write_bytes(cache_path, model)
  print(
    f"remixer_t5: built the word vocabulary of {what}: {cache_path} ({time.perf_counter() - start:.1f}s)",
    file=sys.stderr,
    flush=True,
  )
  return cache_path


def file_digest(*paths: str | os.PathLike) -> str:
  """First 12 hex digits of the sha256 of the files' bytes, in order (the cache key of a vocabulary)."""
  h = hashlib.sha256()
  for p in paths:
    h.update(Path(p).read_bytes())
  return h.hexdigest()[:12]


@functools.cache
def _lazy_class():
  import seqio

  class LazySentencePieceVocabulary(seqio.SentencePieceVocabulary):
    """A ``seqio.SentencePieceVocabulary`` whose model file is found (and built) only when first needed.

    ``resolve()`` returns the model path; ``key`` names the vocabulary for equality (task registration
    compares vocabularies) and must change when ``resolve`` would give another model."""

    def __init__(self, key: str, resolve: Callable[[], str | os.PathLike], extra_ids: int = 0):
      self._key, self._resolver = key, resolve
      self._resolved_file: str | None = None
      super().__init__(sentencepiece_model_file=None, extra_ids=extra_ids)

    def _resolve(self) -> str:
      if self._resolved_file is None:
        self._resolved_file = str(self._resolver())
        self._model = None
      return self._resolved_file

    def _model_context(self):
      self._sentencepiece_model_file = self._resolve()
      return super()._model_context()

    @property
    def sentencepiece_model_file(self) -> str:
      return self._resolve()

    def __getstate__(self):
      state = super().__getstate__()
      state["_sentencepiece_model_file"] = None
      state["_resolved_file"] = None
      return state

    def __eq__(self, other):
      return isinstance(other, LazySentencePieceVocabulary) and (self._key, self._extra_ids) == (
        other._key,
        other._extra_ids,
      )

    def __hash__(self):
      return hash((type(self).__name__, self._key, self._extra_ids))

    def __repr__(self):
      return f"{type(self).__name__}({self._key!r}, extra_ids={self._extra_ids})"

    __str__ = __repr__

  # Pickled by name (seqio's Beam caching and process pools pickle tasks): the module's __getattr__ finds it.
  LazySentencePieceVocabulary.__module__ = __name__
  LazySentencePieceVocabulary.__qualname__ = LazySentencePieceVocabulary.__name__
  return LazySentencePieceVocabulary


def lazy_vocabulary(key: str, resolve: Callable[[], str | os.PathLike], extra_ids: int = 0):
  """A seqio vocabulary over the SentencePiece model at ``resolve()``, called on first use (no I/O here)."""
  return _lazy_class()(key, resolve, extra_ids)


def __getattr__(name: str):
  if name == "LazySentencePieceVocabulary":
    return _lazy_class()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
