"""pNLP-Mixer's projection layer (Fusco et al. 2022, §3.1) and bottleneck (§3.2, §4) as the encoder input.

Instead of a trainable embedding table, each token gets non-trainable MinHash features (§3.1):

  * A vocabulary piece u has the fingerprint F^u ∈ N^n, F^u_i = min_v h_i(v) over the character trigrams v of
    u; a continuation piece ("##ing" in WordPiece) is hashed whole instead of by trigrams.
  * A token t made of pieces u_0..u_{j-1} has F^t_i = min_k F^{u_k}_i (MinHash is associative, so the piece
    fingerprints are computed once on the host and only integer minima are taken at run time).
  * Its feature is a counting Bloom filter C^t ∈ R^m: C^t[F^t_i mod m] += 1 for each of the n hash values.

SentencePiece marks word STARTS ('▁Bring', 'ing') where WordPiece marks continuations ('Bring', '##ing'), so
here a piece starting with '▁' is a word start (its trigrams are taken without the marker, as the paper's
"Bring" example), a piece without it is a continuation, hashed whole as WordPiece spells it ('##' + piece,
which keeps it apart from the identical trigram of a word start), and special pieces ('<pad>', '</s>',
'<unk>', '<extra_id_k>') are hashed whole and are words on their own. A WORD (the paper's token) is a
word-start piece followed by its continuation pieces; our sequences are pieces, so each position gets the
word features of the word it belongs to (and, by default, its own piece's features too, see
`ProjectionEmbed.mode`). Words never span padding, a special piece or a packed-segment boundary.

Hash functions: h_i(s) = (a_i·g(s) + b_i) mod (2³¹−1), with g a keyed BLAKE2b of the UTF-8 bytes and
(a_i, b_i) derived from BLAKE2b of (seed, i): stable across runs, processes and machines (Python's salted
hash() is never used). Everything up to the fingerprint table is numpy on the host; the model side reads the
SentencePiece model with `sentencepiece` only (no seqio).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.mixers import base

Array = jax.Array

WORD_MARKER = "\u2581"  # SentencePiece's '▁'
CONTINUATION_PREFIX = "##"
PRIME = (1 << 31) - 1  # hash values lie in [0, PRIME); fits int32 on the device
MODES = ("piece", "word", "piece+word")


# --- host side: hashing and fingerprints -------------------------------------------------------------------
def piece_kind(piece: str) -> str:
  """'special' (<pad>, </s>, <extra_id_3>, ...), 'word' (starts with '▁') or 'continuation'."""
  if len(piece) >= 3 and piece.startswith("<") and piece.endswith(">"):
    return "special"
  return "word" if piece.startswith(WORD_MARKER) else "continuation"


def hashed_strings(piece: str) -> list[str]:
  """The strings whose hashes a piece's fingerprint is the minimum of (§3.1).

  Word starts: the character trigrams of the piece without '▁' (the whole text if shorter than 3, the bare
  marker if nothing else); continuations: '##' + piece, whole; special pieces: the piece, whole."""
  kind = piece_kind(piece)
  if kind == "continuation":
    return [CONTINUATION_PREFIX + piece]
  if kind == "special":
    return [piece]
  text = piece[len(WORD_MARKER) :]
  if not text:
    return [piece]
  if len(text) < 3:
    return [text]
  return [text[i : i + 3] for i in range(len(text) - 2)]


def _base_hash(s: str) -> int:
  digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8, person=b"remixer-minhash").digest()
  return int.from_bytes(digest, "little") % PRIME


@functools.lru_cache(maxsize=16)
def hash_coefficients(num_hashes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(a, b) of the n universal hash functions h_i(s) = (a_i g(s) + b_i) mod PRIME, a_i ≠ 0."""
  a, b = np.empty(num_hashes, np.uint64), np.empty(num_hashes, np.uint64)
  for i in range(num_hashes):
    d = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16, person=b"minhash-coeffs").digest()
    a[i] = 1 + int.from_bytes(d[:8], "little") % (PRIME - 1)
    b[i] = int.from_bytes(d[8:], "little") % PRIME
  a.flags.writeable = b.flags.writeable = False
  return a, b


def minhash_fingerprints(pieces: Sequence[str], num_hashes: int, seed: int = 0) -> np.ndarray:
  """[num_pieces, num_hashes] int64 MinHash fingerprints of vocabulary pieces (§3.1), vectorised."""
  strings = [hashed_strings(p) for p in pieces]
  if not strings:
    return np.zeros((0, num_hashes), np.int64)
  index: dict[str, int] = {}
  flat = np.array([index.setdefault(s, len(index)) for ss in strings for s in ss])
  g = np.array([_base_hash(s) for s in index], np.uint64)[flat]
  a, b = hash_coefficients(num_hashes, seed)
  # a, g < 2^31, so a·g + b < 2^63: exact in uint64.
  hashes = (g[:, None] * a[None, :] + b[None, :]) % np.uint64(PRIME)
  starts = np.cumsum([0] + [len(ss) for ss in strings[:-1]])
  return np.minimum.reduceat(hashes, starts, axis=0).astype(np.int64)


def _word_flags(pieces: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  kinds = [piece_kind(p) for p in pieces]
  return (np.array([k != "continuation" for k in kinds], bool), np.array([k == "special" for k in kinds], bool))


def _read_bytes(path: str) -> bytes:
  if path.startswith("gs://"):  # cloud paths (the T5 vocabulary) need TF's file system; local ones do not
    import tensorflow as tf

    try:
      with tf.io.gfile.GFile(path, "rb") as f:
        return f.read()
    except tf.errors.OpError as e:
      raise FileNotFoundError(
        f"cannot read the SentencePiece model {path} ({e.message.splitlines()[0]}); "
        "set projection.ProjectionEmbed.vocab_model to a local copy"
      ) from e
  if not os.path.isfile(path):
    raise FileNotFoundError(f"SentencePiece model {path} not found; set projection.ProjectionEmbed.vocab_model")
  with open(path, "rb") as f:
    return f.read()


def pieces_from_sentencepiece(path: str, vocab_size: int | None = None, extra_ids: int = 100) -> list[str]:
  """The pieces of a SentencePiece model by id, then seqio-style sentinels, then unused fillers.

  seqio appends `extra_ids` sentinels after the model's pieces, <extra_id_0> LAST; `vocab_size` (the
  model's padded embedding size, e.g. 32128) is filled with '<unused_k>' pieces never produced by the data."""
  sp = spm.SentencePieceProcessor(model_proto=_read_bytes(str(path)))
  pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  pieces += [f"<extra_id_{extra_ids - 1 - k}>" for k in range(extra_ids)]
  if vocab_size is not None:
    if vocab_size < len(pieces):
      raise ValueError(
        f"vocab_size {vocab_size} is smaller than the {len(pieces)} pieces of {path} plus {extra_ids} extra ids"
      )
    pieces += [f"<unused_{k}>" for k in range(vocab_size - len(pieces))]
  return pieces


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static module field
class FingerprintTable:
  """Per-id MinHash fingerprints [vocab, n] int32 and word flags [vocab] bool (ids index the pieces)."""

  fingerprints: np.ndarray
  starts_word: np.ndarray  # a word-start or special piece: it begins a new word
  standalone: np.ndarray  # a special piece: the next piece begins a new word too

  @classmethod
  def from_pieces(cls, pieces: Sequence[str], num_hashes: int, seed: int = 0) -> "FingerprintTable":
    starts, alone = _word_flags(pieces)
    return cls(minhash_fingerprints(pieces, num_hashes, seed).astype(np.int32), starts, alone)

  @property
  def num_hashes(self) -> int:
    return self.fingerprints.shape[1]


@functools.lru_cache(maxsize=4)
def load_fingerprint_table(
  path: str, num_hashes: int, seed: int = 0, vocab_size: int | None = None, extra_ids: int = 100
) -> FingerprintTable:
  """The table of a SentencePiece model file (cached: built once per process, about a second for 32k)."""
  return FingerprintTable.from_pieces(pieces_from_sentencepiece(path, vocab_size, extra_ids), num_hashes, seed)


# --- device side ---------------------------------------------------------------------------------------------
def _bloom(fp: Array, m: int) -> Array:
  """[b, L, n] hash values -> [b, L, m] counts, by a scatter-add (never an [b, L, n, m] one-hot)."""
  b, length, _ = fp.shape
  rows, cols = jnp.arange(b)[:, None, None], jnp.arange(length)[None, :, None]
  return jnp.zeros((b, length, m), jnp.float32).at[rows, cols, fp % m].add(1.0)


def projection_features(
  ids: Array,
  table: FingerprintTable,
  m: int,
  mode: str = "piece+word",
  mask: Array | None = None,
  segment_ids: Array | None = None,
) -> Array:
  """[b, L, m] ('piece', 'word') or [b, L, 2m] ('piece+word': piece counts, then word counts) float32.

  Padded positions (mask 0) get zeros and are words of their own, so they change nothing elsewhere."""
  if mode not in MODES:
    raise ValueError(f"projection mode must be one of {MODES}, got {mode!r}")
  mask = (ids > 0) if mask is None else mask > 0
  fp = jnp.take(jnp.asarray(table.fingerprints), ids, axis=0)  # [b, L, n]
  parts = []
  if mode != "word":
    parts.append(_bloom(fp, m))
  if mode != "piece":
    b, length = ids.shape
    pad = ~mask
    starts = jnp.take(jnp.asarray(table.starts_word), ids) | pad
    follows = (jnp.take(jnp.asarray(table.standalone), ids) | pad)[:, :-1]  # after a special piece
    if segment_ids is not None:
      follows = follows | (segment_ids[:, 1:] != segment_ids[:, :-1])
    starts = starts.at[:, 1:].set(starts[:, 1:] | follows).at[:, 0].set(True)
    word = (jnp.cumsum(starts, axis=1) - 1 + length * jnp.arange(b)[:, None]).reshape(-1)  # unique word ids
    mins = jax.ops.segment_min(fp.reshape(b * length, -1), word, num_segments=b * length, indices_are_sorted=True)
    parts.append(_bloom(mins[word].reshape(fp.shape), m))
  return jnp.concatenate(parts, axis=-1) * mask[..., None]


def _context_window(feats: Array, window: int, same: Array) -> Array:
  """Concatenates the features of positions i-window..i+window (zeros outside i's example)."""
  length = feats.shape[1]
  out = []
  for k in range(-window, window + 1):
    if k == 0:
      out.append(feats)
      continue
    inside = (jnp.arange(length) + k >= 0) & (jnp.arange(length) + k < length)
    ok = inside[None] & (jnp.roll(same, -k, axis=1) == same)
    out.append(jnp.roll(feats, -k, axis=1) * ok[..., None])
  return jnp.concatenate(out, axis=-1)


class ProjectionEmbed(nn.Module):
  """pNLP-Mixer's input layer: MinHash counting-Bloom-filter features -> bottleneck (§3.1, §3.2, §4).

  Used INSTEAD of the token embedding for the encoder input (`network.Encoder.input_layer`), called as
  `(ids [b, L], ctx) -> [b, L, emb_dim]`. The bottleneck is §3.2's "dense layer followed by an activation
  function and a normalization layer", with §4's choices: Leaky ReLU and LayerNorm; its width is the
  model's emb_dim (the paper's hidden size h).

  Fields:
    vocab_model: path of the SentencePiece model whose pieces the ids index (the fingerprint table is built
      from it on first use and cached per process; cfg.vocab_size rows: pieces, `extra_ids` sentinels, then
      unused fillers). Ignored when `table` is given.
    extra_ids: seqio sentinels appended after the SentencePiece pieces.
    table: a ready FingerprintTable (programmatic use, tests).
    features: m, the size of the counting Bloom filter (per feature kind: 'piece+word' gives 2m inputs).
    num_hashes: n, the MinHash fingerprint length (each token's filter sums to n). The defaults are the
      paper's experiments (§4, Training Details; docs/architectures.md).
    seed: selects the hash functions.
    mode: 'word' is the paper's token feature (every piece of a word gets its word's filter); 'piece' is
      the piece's own filter; 'piece+word' (default) concatenates both, since our sequences are pieces and
      the word filter alone cannot tell the pieces of one word apart.
    window: 0 (the text of §3.2) or w > 0 to concatenate the features of the w neighbours on each side
      before the dense layer (a context window, as some implementations of the model do); neighbours
      outside the example (padding, other packed segments, beyond the ends) contribute zeros.
    negative_slope: of the Leaky ReLU.

  The fingerprint table is a host constant (numpy, not a parameter: it is not trainable and is shared by
  every model with the same vocabulary), so it needs no variable collection and no checkpointing; inside
  jit it is a device constant of vocab·n int32 (31 MiB for 32128 x 256).

  Parameters: bottleneck kernel [m·k·(2w+1), d] ('projection','embed') with k = 2 for 'piece+word' else 1,
  bottleneck_bias [d] ('embed',), bottleneck_norm scale and bias [d] ('embed',). Count: m·k·(2w+1)·d + 3d."""

  config: Any  # remixer_t5.model.config.T5Config
  vocab_model: str = ""
  extra_ids: int = 100
  table: FingerprintTable | None = None
  features: int = 512
  num_hashes: int = 256
  seed: int = 0
  mode: str = "piece+word"
  window: int = 0
  negative_slope: float = 0.01

  def fingerprint_table(self) -> FingerprintTable:
    table = self.table
    if table is None:
      if not self.vocab_model:
        raise ValueError(
          "ProjectionEmbed needs a vocabulary: set ProjectionEmbed.vocab_model to the "
          "SentencePiece model file of the task (or pass a FingerprintTable as `table`)"
        )
      table = load_fingerprint_table(
        self.vocab_model, self.num_hashes, self.seed, self.config.vocab_size, self.extra_ids
      )
    if table.num_hashes != self.num_hashes:
      raise ValueError(f"ProjectionEmbed.num_hashes is {self.num_hashes} but the table has {table.num_hashes}")
    if table.fingerprints.shape[0] < self.config.vocab_size:
      raise ValueError(
        f"the fingerprint table covers {table.fingerprints.shape[0]} ids, fewer than "
        f"vocab_size {self.config.vocab_size}"
      )
    return table

  @nn.compact
  def __call__(self, ids: Array, ctx: base.MixerContext | None = None, *, deterministic: bool = True) -> Array:
    cfg = self.config
    if ctx is not None and (ctx.causal or ctx.decode):
      raise ValueError(
        "ProjectionEmbed is an encoder input layer: its word features and context window "
        "look ahead, so it cannot feed a causal decoder"
      )
    if self.window < 0:
      raise ValueError(f"ProjectionEmbed.window must be >= 0, got {self.window}")
    mask = (ids > 0) if ctx is None else ctx.q_mask > 0
    segment_ids = None if ctx is None else ctx.q_segment_ids
    feats = projection_features(ids, self.fingerprint_table(), self.features, self.mode, mask, segment_ids)
    if self.window:
      same = mask.astype(jnp.int32) if segment_ids is None else segment_ids
      feats = _context_window(feats, self.window, same)
    x = layers.Dense(cfg.emb_dim, ("projection", "embed"), dtype=cfg.dtype, name="bottleneck")(feats.astype(cfg.dtype))
    bias = layers.param_with_axes(
      "bottleneck_bias", nn.initializers.zeros, (cfg.emb_dim,), jnp.float32, axes=("embed",)
    )
    x = nn.leaky_relu(x + bias.astype(cfg.dtype), self.negative_slope)
    return layers.LayerNorm(cfg.layer_norm_epsilon, cfg.dtype, "embed", name="bottleneck_norm")(x)
