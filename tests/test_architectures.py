"""Every architecture config through the full encoder-decoder: the properties each mixer must have.

Decoder: changing future tokens leaves earlier logits unchanged; step-by-step decoding with the cache equals
the full forward pass. Encoder: appended padding changes nothing; permuting its real tokens changes the logits
(the model knows their order). Packing: two examples in one row equal
each alone, or a clear refusal. Gradients are finite.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5 import gin_utils
from remixer_t5.model import models
from remixer_t5.training import partitioning

ARCHS = sorted(p.parent.name for p in gin_utils.gin_dir().glob("models/*/tiny.gin"))
SHRINK = [
  "network.T5Config.vocab_size=40",
  "network.T5Config.emb_dim=16",
  "network.T5Config.num_heads=2",
  "network.T5Config.head_dim=8",
  "network.T5Config.mlp_dim=24",
  "network.T5Config.num_encoder_layers=1",
  "network.T5Config.num_decoder_layers=2",
]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, embedded_cache):
  shrink = SHRINK
  if request.param == "pnlp_mixer":  # its projection table covers the embedded vocabulary's 2,100 ids
    shrink = [b for b in SHRINK if "vocab_size" not in b]
  with pytest.MonkeyPatch.context() as mp:  # the embedded vocabulary of this test session, not ~/.cache
    mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
    module = models.from_gin(f"models/{request.param}/tiny.gin", *shrink)
    yield from _prepared(request.param, module)


def _prepared(name, module):
  # Jitted: run op by op, a model's init compiles every primitive alone.
  variables = jax.jit(
    lambda: module.init(
      jax.random.PRNGKey(0),
      jnp.ones((1, 8), jnp.int32),
      jnp.ones((1, 6), jnp.int32),
      jnp.ones((1, 6), jnp.int32),
      enable_dropout=False,
    )
  )()
  params = variables["params"]
  # Every parameter has logical axes that the mesh rules can place (as the trainer will).
  shardings = partitioning.param_shardings(variables["params_axes"], partitioning.make_mesh(1))
  assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(params), name
  # Perturb every parameter so no mixer sits at a special initial point (e.g. gMLP's near-zero W).
  # (numpy's normals: jax.random op by op compiles its sampler for every distinct shape.)
  rng = np.random.RandomState(1)
  params = jax.tree_util.tree_map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), params)
  forward = jax.jit(lambda p, e, d, t, *packing: module.apply({"params": p}, e, d, t, *packing, enable_dropout=False))
  yield name, module, params, forward


def _tokens(seed, shape):
  return np.random.RandomState(seed).randint(2, 40, shape).astype(np.int32)


def _shift(t):
  return np.concatenate([np.zeros_like(t[:, :1]), t[:, :-1]], 1)


def test_decoder_is_causal(arch):
  _, _, params, forward = arch
  enc, tgt = _tokens(1, (2, 10)), _tokens(2, (2, 12))
  changed = tgt.copy()
  changed[:, 7:] = _tokens(3, (2, 5))
  a = forward(params, enc, _shift(tgt), tgt)
  b = forward(params, enc, _shift(changed), changed)
  np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-5)  # input of position 7 is still tgt[:, 6]
  assert np.abs(a[:, 8:] - b[:, 8:]).max() > 1e-5


def test_cached_decoding_equals_full_forward(arch):
  _, module, params, forward = arch
  enc, tgt = _tokens(4, (2, 10)), _tokens(5, (2, 20))
  enc[1, 7:] = 0
  full = forward(params, enc, _shift(tgt), tgt)
  encoded = jax.jit(lambda p: module.apply({"params": p}, enc, enable_dropout=False, method=module.encode))(params)
  ones = jnp.ones((2, 20), jnp.int32)
  _, cache = jax.jit(
    lambda p, e: module.apply(
      {"params": p}, e, enc, ones, ones, enable_dropout=False, decode=True, mutable=["cache"], method=module.decode
    )
  )(params, encoded)
  step = jax.jit(
    lambda c, tok: module.apply(
      {"params": params, "cache": c},
      encoded,
      enc,
      tok,
      tok,
      enable_dropout=False,
      decode=True,
      max_decode_length=20,
      mutable=["cache"],
      method=module.decode,
    )
  )
  cache, dec_in, outs = cache["cache"], _shift(tgt), []
  for i in range(20):
    logits, mut = step(cache, dec_in[:, i : i + 1])
    cache = mut["cache"]
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5, rtol=1e-4)


def test_appended_encoder_padding_changes_nothing(arch):
  _, _, params, forward = arch
  enc, tgt = _tokens(6, (2, 9)), _tokens(7, (2, 6))
  enc[1, 6:] = 0
  padded = np.concatenate([enc, np.zeros((2, 7), np.int32)], 1)
  np.testing.assert_allclose(
    forward(params, enc, _shift(tgt), tgt), forward(params, padded, _shift(tgt), tgt), atol=2e-5, rtol=1e-4
  )


def test_packed_examples_equal_each_alone_or_are_refused(arch):
  name, module, params, forward = arch
  e1, e2, t1, t2 = _tokens(8, (1, 5)), _tokens(9, (1, 4)), _tokens(10, (1, 3)), _tokens(11, (1, 4))
  alone = [forward(params, e, _shift(t), t) for e, t in ((e1, t1), (e2, t2))]
  enc = np.concatenate([e1, e2, np.zeros((1, 2), np.int32)], 1)
  tgt = np.concatenate([t1, t2, np.zeros((1, 1), np.int32)], 1)
  dec_in = np.concatenate([_shift(t1), _shift(t2), np.zeros((1, 1), np.int32)], 1)
  enc_seg = np.array([[1] * 5 + [2] * 4 + [0] * 2], np.int32)
  dec_seg = np.array([[1] * 3 + [2] * 4 + [0]], np.int32)
  enc_pos = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0]], np.int32)
  dec_pos = np.array([[0, 1, 2, 0, 1, 2, 3, 0]], np.int32)
  try:
    packed = forward(params, enc, dec_in, tgt, enc_seg, dec_seg, enc_pos, dec_pos)
  except ValueError as e:
    assert "pack" in str(e).lower(), f"{name}: refusal must say it is about packing: {e}"
    return
  np.testing.assert_allclose(packed[:, :3], alone[0], atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(packed[:, 3:7], alone[1], atol=2e-5, rtol=1e-4)


def test_permuting_encoder_tokens_changes_the_logits(arch):
  # An encoder that cannot see token order (no position information anywhere) gives the same logits for any
  # order of its real tokens (linear attention without position embeddings: max |diff| ~ 2e-6).
  name, _, params, forward = arch
  enc, tgt = _tokens(14, (2, 9)), _tokens(15, (2, 6))
  enc[1, 6:] = 0
  permuted = enc.copy()
  permuted[0] = enc[0, ::-1]
  permuted[1, :6] = enc[1, [3, 0, 5, 1, 4, 2]]
  assert (permuted != enc).any(axis=1).all()
  diff = np.abs(forward(params, enc, _shift(tgt), tgt) - forward(params, permuted, _shift(tgt), tgt))
  assert diff.reshape(2, -1).max(axis=1).min() > 1e-3, f"{name}: logits ignore the encoder's token order"


def test_gradients_are_finite(arch):
  _, module, params, _ = arch
  enc, tgt = _tokens(12, (2, 9)), _tokens(13, (2, 6))
  enc[0, 5:] = 0
  tgt[1, 4:] = 0
  model = models.EncoderDecoderModel(module)
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": _shift(tgt), "decoder_target_tokens": tgt}
  grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, None)[0]))(params)
  leaves = jax.tree_util.tree_leaves(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
