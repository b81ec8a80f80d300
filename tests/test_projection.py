"""pNLP-Mixer projection (Fusco et al. 2022 §3.1-3.2): MinHash fingerprints, word minima, Bloom counts."""

import functools
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.model import projection as pj
from remixer_t5.model.mixers import base
from remixer_t5.model.network import T5Config

CFG = T5Config(
  vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=1, num_decoder_layers=1
)
N, M = 16, 64  # hashes, Bloom filter size (small for tests)
# A 32-piece SentencePiece-style vocabulary: specials, word starts ('▁...') and continuations.
PIECES = [
  "<pad>",
  "</s>",
  "<unk>",
  "▁",
  "▁Bring",
  "ing",
  "▁the",
  "▁a",
  "s",
  "▁unbeliev",
  "able",
  "▁things",
  "▁ing",
  "ed",
  "▁re",
  "read",
  "▁cat",
  "▁dog",
  "▁ca",
  "t",
  "▁x",
  "y",
  "z",
  "▁hello",
  "▁world",
  "er",
  "▁walk",
  "▁talk",
  "ly",
  "<extra_id_1>",
  "<extra_id_0>",
  "▁Bringing",
]
assert len(PIECES) == CFG.vocab_size
T5_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"


# --- numpy references of §3.1, independent of the device code ----------------------------------------------
def string_hashes(s: str, num_hashes: int, seed: int = 0) -> np.ndarray:
  """[n] int64: h_0(s) .. h_{n-1}(s) by their definition: a keyed BLAKE2b of s, then a_i g + b_i mod 2^31 - 1."""
  a, b = pj.hash_coefficients(num_hashes, seed)
  digest = hashlib.blake2b(s.encode(), digest_size=8, person=b"remixer-minhash").digest()
  g = int.from_bytes(digest, "little") % pj.PRIME
  return np.array([(int(ai) * g + int(bi)) % pj.PRIME for ai, bi in zip(a, b)], np.int64)


def word_fingerprints(
  ids: np.ndarray, fingerprints: np.ndarray, pieces: Sequence[str], segment_ids: np.ndarray | None = None
) -> np.ndarray:
  """[..., n]: at each position the fingerprint of its word, the element-wise min over the word's pieces.

  `ids` is [len] or [batch, len] (0 = padding). A word starts at a non-continuation piece, after a special
  piece or padding, and at a segment boundary. A plain host-side loop, the reference of the device code."""
  ids = np.asarray(ids)
  if ids.ndim == 1:
    seg = None if segment_ids is None else np.asarray(segment_ids)[None]
    return word_fingerprints(ids[None], fingerprints, pieces, seg)[0]
  kinds = [pj.piece_kind(p) for p in pieces]
  starts = np.array([k != "continuation" for k in kinds])
  alone = np.array([k == "special" for k in kinds])
  out = np.zeros(ids.shape + (fingerprints.shape[1],), fingerprints.dtype)
  for r, row in enumerate(ids):
    begin = 0
    for i in range(len(row) + 1):
      boundary = (
        i == len(row)
        or i == 0
        or starts[row[i]]
        or alone[row[i - 1]]
        or row[i] == 0
        or (row[i - 1] == 0)
        or (segment_ids is not None and segment_ids[r][i] != segment_ids[r][i - 1])
      )
      if boundary and i > begin:
        out[r, begin:i] = fingerprints[row[begin:i]].min(axis=0)
        begin = i
  return out


def counting_bloom_filter(fingerprints: np.ndarray, m: int) -> np.ndarray:
  """[..., m] float32 counts: each of the n values F_i adds one at F_i mod m (§3.1)."""
  fingerprints = np.asarray(fingerprints)
  flat = fingerprints.reshape(-1, fingerprints.shape[-1]) % m
  counts = np.zeros((flat.shape[0], m), np.float32)
  np.add.at(counts, (np.arange(flat.shape[0])[:, None], flat), 1.0)
  return counts.reshape(fingerprints.shape[:-1] + (m,))


def build_feature_table(pieces: Sequence[str], m: int, num_hashes: int, seed: int = 0) -> np.ndarray:
  """[vocab, m] counting Bloom filters of the pieces on their own (single-piece words)."""
  return counting_bloom_filter(pj.minhash_fingerprints(pieces, num_hashes, seed), m)


@functools.lru_cache(maxsize=None)
def table():
  return pj.FingerprintTable.from_pieces(PIECES, N, seed=0)


def naive_fingerprint(piece, num_hashes, seed):
  """Independent of the module's vectorised code: trigrams by hand, then the min of each hash."""
  if piece.startswith("<") and piece.endswith(">"):
    grams = [piece]
  elif not piece.startswith("▁"):
    grams = ["##" + piece]
  else:
    text = piece[1:]
    grams = [text[i : i + 3] for i in range(len(text) - 2)] or [text or piece]
  best = [None] * num_hashes
  for g in grams:
    h = string_hashes(g, num_hashes, seed)
    for i in range(num_hashes):
      best[i] = h[i] if best[i] is None else min(best[i], h[i])
  return np.array(best, np.int64)


def test_hash_family_is_fixed_and_unsalted():
  """h_i follows its documented definition (keyed BLAKE2b + universal hashing mod 2^31-1)."""
  g = int.from_bytes(hashlib.blake2b("ing".encode(), digest_size=8, person=b"remixer-minhash").digest(), "little") % (
    2**31 - 1
  )
  d = hashlib.blake2b(b"7/3", digest_size=16, person=b"minhash-coeffs").digest()
  a = 1 + int.from_bytes(d[:8], "little") % (2**31 - 2)
  b = int.from_bytes(d[8:], "little") % (2**31 - 1)
  assert string_hashes("ing", 5, seed=7)[3] == (a * g + b) % (2**31 - 1)
  assert not np.array_equal(string_hashes("ing", 5, 0), string_hashes("ing", 5, 1))  # seeds differ


def test_fingerprints_are_min_over_trigrams_and_deterministic():
  fp = pj.minhash_fingerprints(PIECES, N, seed=3)
  assert fp.shape == (len(PIECES), N) and fp.dtype == np.int64
  for i, piece in enumerate(PIECES):
    np.testing.assert_array_equal(fp[i], naive_fingerprint(piece, N, 3), err_msg=piece)
  assert pj.hashed_strings("▁Bring") == ["Bri", "rin", "ing"]  # the paper's example
  np.testing.assert_array_equal(fp, pj.minhash_fingerprints(PIECES, N, seed=3))
  assert not np.array_equal(fp, pj.minhash_fingerprints(PIECES, N, seed=4))
  assert np.all((fp >= 0) & (fp < pj.PRIME))


def test_deterministic_across_processes():
  """A fresh interpreter with another PYTHONHASHSEED builds the same fingerprints."""
  code = (
    "import sys; from remixer_t5.model import projection as pj; "
    f"sys.stdout.write(str(pj.minhash_fingerprints({PIECES!r}, 8, 5).sum(axis=0).tolist()))"
  )
  env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    env=env,
    check=True,
    cwd=Path(__file__).resolve().parents[1],
  )
  assert out.stdout == str(pj.minhash_fingerprints(PIECES, 8, 5).sum(axis=0).tolist())


def test_continuations_are_hashed_whole():
  fp = pj.minhash_fingerprints(["ing", "▁ing", "able", "▁Bring"], N)
  np.testing.assert_array_equal(fp[0], string_hashes("##ing", N))  # one hash of the whole piece
  np.testing.assert_array_equal(fp[1], string_hashes("ing", N))  # the word "ing": its one trigram
  np.testing.assert_array_equal(fp[2], string_hashes("##able", N))
  assert not np.array_equal(fp[0], fp[1])
  # Trigram sharing is what makes similar words similar: "▁Bring" contains the trigram "ing".
  assert np.any(fp[3] == fp[1])
  assert pj.piece_kind("<extra_id_0>") == "special" and pj.piece_kind("▁") == "word"


def test_word_fingerprint_is_elementwise_min_over_its_pieces():
  ids = np.array([4, 5, 9, 10, 8, 6, 19, 1, 5, 30, 5, 0, 0])  # Bring|ing unbeliev|able|s the t </s> ing ...
  fp = table().fingerprints
  words = word_fingerprints(ids, fp, PIECES)
  expect = {
    (0, 2): [4, 5],
    (2, 5): [9, 10, 8],
    (5, 7): [6, 19],
    (7, 8): [1],
    (8, 9): [5],
    (9, 10): [30],
    (10, 11): [5],
    (11, 12): [0],
    (12, 13): [0],
  }
  for (lo, hi), members in expect.items():
    want = np.min(fp[members], axis=0)
    for i in range(lo, hi):
      np.testing.assert_array_equal(words[i], want, err_msg=f"position {i}")
  # The device code agrees with the host reference, and its Bloom filters sum to n.
  feats = jax.jit(lambda x: pj.projection_features(x, table(), M, "piece+word"))(ids[None])[0]
  real = (ids > 0)[:, None]
  np.testing.assert_array_equal(np.asarray(feats[:, M:]), counting_bloom_filter(words, M) * real)
  np.testing.assert_array_equal(np.asarray(feats[:, :M]), build_feature_table(PIECES, M, N)[ids] * real)
  np.testing.assert_array_equal(np.asarray(feats.sum(-1)), 2 * N * (ids > 0))


def test_words_stop_at_segment_boundaries():
  ids = np.array([[4, 5, 5, 8, 0]])
  seg = np.array([[1, 1, 2, 2, 0]])
  fp = table().fingerprints
  want = word_fingerprints(ids, fp, PIECES, seg)
  np.testing.assert_array_equal(want[0, 2], np.minimum(fp[5], fp[8]))  # 'ing' starts segment 2's word
  np.testing.assert_array_equal(want[0, 0], np.minimum(fp[4], fp[5]))
  got = jax.jit(lambda i, s: pj.projection_features(i, table(), M, "word", segment_ids=s))(ids, seg)
  np.testing.assert_array_equal(np.asarray(got), counting_bloom_filter(want, M) * (ids > 0)[..., None])


def test_counting_bloom_filter_counts_each_hash():
  fp = np.array([[3, 3 + M, 5, 7], [0, 1, 2, 2 * M + 2]])
  c = counting_bloom_filter(fp, M)
  assert c.shape == (2, M) and np.all(c.sum(-1) == 4)
  assert c[0, 3] == 2 and c[0, 5] == 1 and c[1, 2] == 2
  t = build_feature_table(PIECES, M, N)
  assert t.shape == (len(PIECES), M) and np.all(t.sum(-1) == N)


def ctx_for(mask, segment_ids=None, causal=False):
  mask = jnp.asarray(mask, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(mask.shape[1], dtype=jnp.int32)[None], mask.shape)
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return base.MixerContext(
    q_mask=mask, kv_mask=mask, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, causal=causal
  )


def make(**kw):
  return pj.ProjectionEmbed(config=CFG, table=table(), features=M, num_hashes=N, **kw)


# Compiled calls: much faster than op-by-op dispatch on a loaded machine.
@functools.partial(jax.jit, static_argnums=0)
def apply(module, variables, ids, ctx):
  return module.apply(variables, ids, ctx)


@functools.partial(jax.jit, static_argnums=0)
def init(module, ids, ctx):
  return module.init(jax.random.PRNGKey(0), ids, ctx)


def test_module_matches_numpy_bottleneck_and_has_axes():
  module = make(window=1)
  ids = jnp.array([[4, 5, 6, 19, 1, 0], [23, 24, 1, 0, 0, 0]])
  ctx = ctx_for(ids > 0)
  variables = init(module, ids, ctx)
  p = variables["params"]
  assert p["bottleneck"]["kernel"].shape == (3 * 2 * M, CFG.emb_dim)
  axes = variables["params_axes"]
  assert axes["bottleneck"]["kernel_axes"].names == ("projection", "embed")
  assert axes["bottleneck_bias_axes"].names == ("embed",)
  assert axes["bottleneck_norm"]["scale_axes"].names == ("embed",)
  assert sum(x.size for x in jax.tree_util.tree_leaves(p)) == 3 * 2 * M * CFG.emb_dim + 3 * CFG.emb_dim
  p = dict(p, bottleneck_bias=jax.random.normal(jax.random.PRNGKey(1), (CFG.emb_dim,)))
  got = np.asarray(apply(module, {"params": p}, ids, ctx))

  # numpy: features of i-1, i, i+1 (zeros outside the example), dense + bias, leaky relu, layer norm.
  ids_np = np.asarray(ids)
  fp = table().fingerprints
  for r in range(2):
    real = ids_np[r] > 0
    words = word_fingerprints(ids_np[r], fp, PIECES)
    f = np.concatenate([counting_bloom_filter(fp[ids_np[r]], M), counting_bloom_filter(words, M)], -1)
    f = f * real[:, None]
    for i in np.flatnonzero(real):
      ctx_f = [f[j] if 0 <= j < len(f) and real[j] else np.zeros_like(f[0]) for j in (i - 1, i, i + 1)]
      h = np.concatenate(ctx_f) @ np.asarray(p["bottleneck"]["kernel"], np.float64) + np.asarray(p["bottleneck_bias"])
      h = np.where(h > 0, h, 0.01 * h)
      h = (h - h.mean()) / np.sqrt(h.var() + CFG.layer_norm_epsilon)
      np.testing.assert_allclose(got[r, i], h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [0, 2])
def test_padding_and_packing_change_nothing(window):
  module = make(window=window)
  a, b = [4, 5, 6, 19], [23, 8, 1]
  variables = init(module, jnp.array([a + [0] * 6]), ctx_for(np.ones((1, 10))))
  alone = jnp.array([a + [0] * 6, b + [0] * 7])
  y_alone = apply(module, variables, alone, ctx_for(alone > 0))
  longer = jnp.array([a + [0] * 10, b + [0] * 11])  # more padding appended
  y_long = apply(module, variables, longer, ctx_for(longer > 0))
  np.testing.assert_allclose(np.asarray(y_long[0, :4]), np.asarray(y_alone[0, :4]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y_long[1, :3]), np.asarray(y_alone[1, :3]), rtol=1e-5, atol=1e-6)
  packed = jnp.array([a + b + [0] * 3, b + a + [0] * 3])
  seg = np.array([[1] * 4 + [2] * 3 + [0] * 3, [1] * 3 + [2] * 4 + [0] * 3])
  y = apply(module, variables, packed, ctx_for(seg > 0, seg))
  close = lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
  close(y[0, :4], y_alone[0, :4])
  close(y[0, 4:7], y_alone[1, :3])
  close(y[1, :3], y_alone[1, :3])
  close(y[1, 3:7], y_alone[0, :4])
  if window:  # the window does look at neighbours: without segment ids the packed rows differ
    y_leaky = apply(module, variables, packed, ctx_for(seg > 0))
    assert not np.allclose(np.asarray(y_leaky[0, :4]), np.asarray(y_alone[0, :4]))


def test_gradients_finite_and_refusals():
  module = make(window=1)
  ids = jnp.array([[4, 5, 6, 0], [9, 10, 8, 1]])
  ctx = ctx_for(ids > 0)
  variables = init(module, ids, ctx)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, ids, ctx) ** 2)))(variables["params"])
  leaves = jax.tree_util.tree_leaves(grads)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  assert float(jnp.sum(jnp.abs(grads["bottleneck"]["kernel"]))) > 0
  y = apply(module, variables, ids, ctx)
  assert y.shape == (2, 4, CFG.emb_dim)
  with pytest.raises(ValueError, match="causal"):
    module.apply(variables, ids, ctx_for(ids > 0, causal=True))
  with pytest.raises(ValueError, match="vocab_model"):
    pj.ProjectionEmbed(config=CFG).init(jax.random.PRNGKey(0), ids, ctx)
  with pytest.raises(ValueError, match="num_hashes"):
    pj.ProjectionEmbed(config=CFG, table=table(), num_hashes=N + 1).init(jax.random.PRNGKey(0), ids, ctx)
  with pytest.raises(ValueError, match="mode"):
    make(mode="chars").init(jax.random.PRNGKey(0), ids, ctx)


@pytest.mark.skipif(not T5_VOCAB.exists(), reason=f"T5 SentencePiece model not found at {T5_VOCAB}")
def test_real_t5_vocabulary(tmp_path):
  pieces = pj.pieces_from_sentencepiece(str(T5_VOCAB), vocab_size=32128, extra_ids=100)
  assert len(pieces) == 32128 and pieces[:3] == ["<pad>", "</s>", "<unk>"]
  assert pieces[32099] == "<extra_id_0>" and pieces[32000] == "<extra_id_99>"
  start = time.perf_counter()
  first = pieces[:1000]
  t1 = build_feature_table(first, 1024, 64, seed=0)
  assert time.perf_counter() - start < 10
  np.testing.assert_array_equal(t1, build_feature_table(first, 1024, 64, seed=0))
  assert t1.shape == (1000, 1024) and np.all(t1.sum(-1) == 64)
  fp = pj.minhash_fingerprints(first, 64)
  for i in (3, 8, 11, 500, 999):
    np.testing.assert_array_equal(fp[i], naive_fingerprint(first[i], 64, 0), err_msg=first[i])
  # The module builds the full table from the file on its own (cached per process).
  cfg = T5Config(vocab_size=32128, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24)
  module = pj.ProjectionEmbed(config=cfg, vocab_model=str(T5_VOCAB), features=128, num_hashes=8)
  ids = jnp.array([[8, 1000, 32099, 1, 0]])
  variables = init(module, ids, ctx_for(ids > 0))
  assert apply(module, variables, ids, ctx_for(ids > 0)).shape == (1, 5, 16)


def test_defaults_are_the_papers_and_base_configs_resolve_the_vocabulary_locally(monkeypatch):
  # §4 Training Details: "the projection of each token is a feature vector of dimension 512 filled with 256
  # hashes"; 'piece+word' concatenates two such filters, so the bottleneck reads 2 x 512 counts.
  module = pj.ProjectionEmbed(config=CFG, table=pj.FingerprintTable.from_pieces(PIECES, 256))
  assert (module.features, module.num_hashes) == (512, 256)
  ids = jnp.array([[4, 5, 6, 1, 0]])
  variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), ids, ctx_for(ids > 0))
  assert variables["params"]["bottleneck"]["kernel"].shape == (2 * 512, CFG.emb_dim)
  feats = pj.projection_features(ids, module.fingerprint_table(), 512, "piece")
  np.testing.assert_array_equal(np.asarray(feats).sum(-1)[0, :4], 256)  # each filter holds the 256 hashes
  # small/base read T5's vocabulary the way every other config does ($REMIXER_T5_VOCAB, else GCS), not a
  # hard-coded gs:// path.
  from remixer_t5.model import models

  monkeypatch.setenv("REMIXER_T5_VOCAB", "/somewhere/local/t5.model")
  for size in ("small", "base"):
    model = models.from_gin(f"models/pnlp_mixer/{size}.gin")
    layer = model.encoder_input_layer(config=model.config)
    assert (layer.vocab_model, layer.features, layer.num_hashes) == ("/somewhere/local/t5.model", 512, 256)
