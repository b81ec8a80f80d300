"""MLP-Mixer token MLP (global and windowed), FNet and linear attention: equations, masks, packing, decode; the
absolute position embeddings their configs add (sinusoidal, learned), under packing and cached decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.fnet import FourierMixing
from remixer_t5.model.mixers.linear_attention import LinearAttention
from remixer_t5.model.mixers.mlp_mixer import TokenMixingMlp
from remixer_t5.model.network import T5Config

CFG = T5Config(
  vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=1, num_decoder_layers=1
)
D = CFG.emb_dim
TOL = dict(rtol=1e-4, atol=1e-5)


def _x(seed, b, n, d=D):
  return np.random.RandomState(seed).randn(b, n, d).astype(np.float32)


def _ctx(mask, kv_mask=None, seg=None, kv_seg=None, pos=None, **kw):
  mask = jnp.asarray(mask, jnp.float32)
  kv_mask = mask if kv_mask is None else jnp.asarray(kv_mask, jnp.float32)
  pos = jnp.arange(mask.shape[1], dtype=jnp.int32)[None] if pos is None else jnp.asarray(pos, jnp.int32)
  kv_pos = pos if kv_mask.shape == mask.shape else jnp.arange(kv_mask.shape[1], dtype=jnp.int32)[None]
  seg = None if seg is None else jnp.asarray(seg, jnp.int32)
  kv_seg = seg if kv_seg is None else jnp.asarray(kv_seg, jnp.int32)
  return base.MixerContext(mask, kv_mask, pos, kv_pos, seg, kv_seg, **kw)


def _ones(b, n):
  return np.ones((b, n), np.float32)


def _init(module, x, ctx, kv=None):
  return jax.jit(module.init)(jax.random.PRNGKey(0), x, x if kv is None else kv, ctx)


def _perturbed(variables, seed=7):
  """Random non-zero biases as well, so the equations' bias terms are checked too."""
  rng = np.random.RandomState(seed)
  params = jax.tree_util.tree_map(lambda p: p + 0.3 * rng.randn(*p.shape).astype(np.float32), variables["params"])
  return {**variables, "params": params}


_JITTED = {}


def _apply(module, v, x, ctx, kv=None):
  # One compiled program per module and shape is much faster than op-by-op dispatch on a loaded machine.
  fn = _JITTED.setdefault(module, jax.jit(module.apply))
  return np.asarray(fn(v, x, x if kv is None else kv, ctx))


def _packed_and_alone(module, v, lens, causal, seed=40):
  """Outputs of segments of `lens` packed in one row (two pads at the end) and of each alone (as a padded
  batch; appended padding is tested separately), both [len(lens), max(lens), d], zeros beyond a segment."""
  parts = [_x(seed + i, 1, n)[0] for i, n in enumerate(lens)]
  row = np.concatenate(parts + [np.ones((2, D), np.float32)])[None]
  seg = np.array([sum(([i + 1] * n for i, n in enumerate(lens)), []) + [0, 0]])
  pos = [sum((list(range(n)) for n in lens), []) + [0, 0]]
  packed = _apply(module, v, row, _ctx((seg > 0).astype(np.float32), seg=seg, pos=pos, causal=causal))
  m = max(lens)
  batch = np.stack([np.pad(p, ((0, m - len(p)), (0, 0))) for p in parts])
  mask = (np.arange(m)[None] < np.array(lens)[:, None]).astype(np.float32)
  alone = _apply(module, v, batch, _ctx(mask, causal=causal)) * mask[:, :, None]
  starts = np.cumsum([0] + lens[:-1])
  packed = np.stack([np.pad(packed[0, s : s + n], ((0, m - n), (0, 0))) for s, n in zip(starts, lens)])
  return packed, alone


def _gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _axes(v):
  return traverse_util.flatten_dict(
    jax.tree_util.tree_map(lambda a: a.names, v["params_axes"], is_leaf=lambda x: hasattr(x, "names")), sep="/"
  )


def _params(v):
  return {k: np.asarray(p) for k, p in traverse_util.flatten_dict(v["params"], sep="/").items()}


# ---------------------------------------------------------------------------------------------------------
# MLP-Mixer token-mixing MLP, encoder form


def test_global_token_mlp_matches_numpy_and_ignores_appended_padding():
  mod = TokenMixingMlp(CFG, max_length=12, hidden_dim=6)
  mask = np.array([[1] * 7 + [0] * 2, [1] * 9], np.float32)
  x = _x(0, 2, 9)
  v = _perturbed(_init(mod, x, _ctx(mask)))
  p = _params(v)
  assert {k: a.shape for k, a in p.items()} == {"w1": (12, 6), "b1": (6,), "w2": (6, 12), "b2": (12,)}
  assert _axes(v) == {
    "w1_axes": ("mix_length", "mix_hidden"),
    "b1_axes": ("mix_hidden",),
    "w2_axes": ("mix_hidden", "mix_length"),
    "b2_axes": ("mix_length",),
  }
  y = _apply(mod, v, x, _ctx(mask))
  for b, n in enumerate([7, 9]):  # Y[:, c] = W2 gelu(W1 X[:, c] + b1) + b2 over the n real tokens only
    h = _gelu(p["w1"][:n].T @ x[b, :n] + p["b1"][:, None])
    np.testing.assert_allclose(y[b, :n], p["w2"][:, :n].T @ h + p["b2"][:n, None], **TOL)
  # Three more pads (and garbage under the pads) change no real output.
  x2 = np.concatenate([x, _x(1, 2, 3)], 1)
  x2[0, 7:9] = 5.0
  y2 = _apply(mod, v, x2, _ctx(np.concatenate([mask, np.zeros((2, 3), np.float32)], 1)))
  np.testing.assert_allclose(y2[0, :7], y[0, :7], **TOL)
  np.testing.assert_allclose(y2[1, :9], y[1], **TOL)


def test_token_mlp_default_widths_and_refusals():
  x = _x(0, 1, 8)
  shapes = lambda m: traverse_util.flatten_dict(
    jax.tree_util.tree_map(
      lambda a: a.shape, jax.eval_shape(m.init, jax.random.PRNGKey(0), x, x, _ctx(_ones(1, 8)))["params"]
    ),
    sep="/",
  )
  assert shapes(TokenMixingMlp(CFG, max_length=8))["w1"] == (8, 512)
  assert shapes(TokenMixingMlp(CFG, window=3))["w1"] == (3, 6)
  mod = TokenMixingMlp(CFG, max_length=8, hidden_dim=4)
  v = _init(mod, x, _ctx(_ones(1, 8)))
  with pytest.raises(ValueError, match=r"at most 8 positions.*length 9"):
    _apply(mod, v, _x(0, 1, 9), _ctx(_ones(1, 9)))
  with pytest.raises(ValueError, match="TokenMixingMlp.*packed"):
    _apply(mod, v, x, _ctx(_ones(1, 8), seg=[[1] * 4 + [2] * 4], pos=[[0, 1, 2, 3] * 2]))
  with pytest.raises(ValueError, match="TokenMixingMlp.*window"):
    _apply(mod, v, x, _ctx(_ones(1, 8), causal=True))


# ---------------------------------------------------------------------------------------------------------
# MLP-Mixer token-mixing MLP, windowed decoder form

WIN = TokenMixingMlp(CFG, hidden_dim=5, window=4)


def _window_numpy(p, x, seg=None):
  """out_i = w2 . gelu(W1^T (x_i, x_{i-1}, .., x_{i-w+1}) + b1), out-of-window/segment entries zero."""
  b, n, d = x.shape
  w = p["w1"].shape[0]
  out = np.zeros_like(x)
  for bb in range(b):
    for i in range(n):
      u = np.zeros((w, d), np.float32)
      for o in range(w):
        j = i - o
        if j >= 0 and (seg is None or seg[bb, j] == seg[bb, i]):
          u[o] = x[bb, j]
      out[bb, i] = p["w2"] @ _gelu(p["w1"].T @ u + p["b1"][:, None])
  return out


def test_windowed_token_mlp_matches_numpy_and_is_causal():
  x = _x(2, 2, 11)
  ctx = _ctx(_ones(2, 11), causal=True)
  v = _perturbed(_init(WIN, x, ctx))
  p = _params(v)
  assert {k: a.shape for k, a in p.items()} == {"w1": (4, 5), "b1": (5,), "w2": (5,)}
  assert _axes(v) == {"w1_axes": ("mix_length", "mix_hidden"), "b1_axes": ("mix_hidden",), "w2_axes": ("mix_hidden",)}
  y = _apply(WIN, v, x, ctx)
  np.testing.assert_allclose(y, _window_numpy(p, x), **TOL)
  x2 = x.copy()
  x2[:, 6:] += _x(3, 2, 5)
  y2 = _apply(WIN, v, x2, ctx)
  np.testing.assert_allclose(y2[:, :6], y[:, :6], **TOL)
  assert not np.allclose(y2[:, 6], y[:, 6])
  # Any length works (the window is relative) and padding inside the window contributes nothing.
  mask = _ones(2, 11)
  mask[0, 3] = 0
  x3 = x.copy()
  x3[0, 3] = 0
  np.testing.assert_allclose(_apply(WIN, v, x, _ctx(mask, causal=True))[0, 4:], _window_numpy(p, x3)[0, 4:], **TOL)


def test_windowed_token_mlp_packing_equals_alone():
  v = _perturbed(_init(WIN, _x(4, 1, 6), _ctx(_ones(1, 6), causal=True)))
  np.testing.assert_allclose(*_packed_and_alone(WIN, v, [6, 5, 3], causal=True), **TOL)


def test_windowed_token_mlp_gradients_equal_autodiff_of_the_equation():
  """The windowed token MLP's gradients (its windows gathered, then one product) against JAX's autodiff of the
  equation written per position, on packed rows with padding: every parameter and the input."""
  import jax.numpy as jnp

  seg = np.array([[1] * 6 + [2] * 5 + [0] * 2], np.int32)
  mask = (seg > 0).astype(np.float32)
  ctx = _ctx(mask, seg=seg, pos=[list(range(6)) + list(range(5)) + [0, 0]], causal=True)
  x = _x(7, 1, 13)
  v = _perturbed(_init(WIN, x, ctx))
  cot = _x(8, 1, 13) * mask[:, :, None]

  def equation(p, x):  # out_i = w2 . gelu(W1^T (x_i, .., x_{i-w+1}) + b1), other segments and padding zero
    w = p["w1"].shape[0]
    x = x * mask[:, :, None]
    rows = []
    for i in range(x.shape[1]):
      u = jnp.stack([x[0, i - o] * float(i - o >= 0 and seg[0, i - o] == seg[0, i]) for o in range(w)])
      rows.append(p["w2"] @ jax.nn.gelu(p["w1"].T @ u + p["b1"][:, None], approximate=True))
    return jnp.stack(rows)[None]

  def ours(p, x):
    return WIN.apply({**v, "params": p}, x, x, ctx)

  params = v["params"]
  got = jax.grad(lambda p, x: jnp.sum(ours(p, x) * cot), argnums=(0, 1))(params, jnp.asarray(x))
  want = jax.grad(lambda p, x: jnp.sum(equation(p, x) * cot), argnums=(0, 1))(params, jnp.asarray(x))
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert np.abs(np.asarray(r)).max() > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), **TOL)


def _decode_all(module, v, x):
  """Step-by-step decoding of x [b, n, d] with a jitted step; returns [b, n, d]."""
  n = x.shape[1]
  ctx_full = _ctx(_ones(x.shape[0], n), causal=True, decode=True, max_decode_length=n)
  _, mut = jax.jit(lambda x: module.apply(v, x, x, ctx_full, mutable=["cache"]))(x)
  ctx_step = _ctx(_ones(x.shape[0], 1), causal=True, decode=True, max_decode_length=n)

  @jax.jit
  def step(cache, xi):
    y, mut = module.apply({**v, "cache": cache}, xi, xi, ctx_step, mutable=["cache"])
    return mut["cache"], y

  cache, outs = mut["cache"], []
  for i in range(n):
    cache, y = step(cache, x[:, i : i + 1])
    outs.append(np.asarray(y))
  return np.concatenate(outs, 1)


def test_windowed_token_mlp_decode_equals_full_causal_forward():
  x = _x(6, 2, 19)
  ctx = _ctx(_ones(2, 19), causal=True)
  v = _perturbed(_init(WIN, x, ctx))
  np.testing.assert_allclose(_decode_all(WIN, v, x), _apply(WIN, v, x, ctx), **TOL)


# ---------------------------------------------------------------------------------------------------------
# FNet

FNET = FourierMixing(CFG)


def test_fnet_is_the_real_part_of_the_2d_dft_over_real_tokens_only():
  x = _x(8, 2, 10)
  mask = np.array([[1] * 7 + [0] * 3, [1] * 10], np.float32)
  v = _init(FNET, x, _ctx(mask))
  assert "params" not in v or not v["params"]
  y = _apply(FNET, v, x, _ctx(mask))
  for b, n in enumerate([7, 10]):
    np.testing.assert_allclose(y[b, :n], np.fft.fft2(x[b, :n]).real, rtol=1e-4, atol=1e-4)
  x2 = np.concatenate([x, _x(9, 2, 4)], 1)
  y2 = _apply(FNET, v, x2, _ctx(np.concatenate([mask, np.zeros((2, 4), np.float32)], 1)))
  np.testing.assert_allclose(y2[0, :7], y[0, :7], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(y2[1, :10], y[1, :10], rtol=1e-4, atol=1e-4)


def test_fnet_packing_equals_alone_and_causal_is_refused():
  a = _x(10, 1, 5)
  v = _init(FNET, a, _ctx(_ones(1, 5)))
  packed, alone = _packed_and_alone(FNET, v, [5, 6], causal=False)
  np.testing.assert_allclose(packed, alone, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(packed[1], np.fft.fft2(_x(41, 1, 6)[0]).real, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="FNet.*causal"):
    _apply(FNET, v, a, _ctx(_ones(1, 5), causal=True))


# ---------------------------------------------------------------------------------------------------------
# Linear attention

LIN = LinearAttention(CFG, chunk_size=4)


def _phi(x):
  return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _linear_numpy(p, xq, xkv, allowed):
  """out_i = sum_j allowed_ij phi(q_i).phi(k_j) v_j / sum_j allowed_ij phi(q_i).phi(k_j), then `out`."""
  h, dh = CFG.num_heads, CFG.head_dim
  q = _phi(xq @ p["query/kernel"]).reshape(xq.shape[0], xq.shape[1], h, dh)
  k = _phi(xkv @ p["key/kernel"]).reshape(xkv.shape[0], xkv.shape[1], h, dh)
  val = (xkv @ p["value/kernel"]).reshape(xkv.shape[0], xkv.shape[1], h, dh)
  out = np.zeros_like(q)
  for b in range(q.shape[0]):
    for i in range(q.shape[1]):
      for hh in range(h):
        w = np.array([q[b, i, hh] @ k[b, j, hh] if allowed[b, i, j] else 0.0 for j in range(k.shape[1])])
        out[b, i, hh] = w @ val[b, :, hh] / (w.sum() + 1e-6)
  return out.reshape(q.shape[0], q.shape[1], h * dh) @ p["out/kernel"]


def test_linear_attention_matches_numpy_noncausal_causal_and_cross():
  x = _x(12, 2, 18)
  mask = np.array([[1] * 14 + [0] * 4, [1] * 18], np.float32)
  v = _init(LIN, x, _ctx(mask))
  p = _params(v)
  inner = CFG.num_heads * CFG.head_dim
  assert {k: a.shape for k, a in p.items()} == {
    "query/kernel": (D, inner),
    "key/kernel": (D, inner),
    "value/kernel": (D, inner),
    "out/kernel": (inner, D),
  }
  assert _axes(v) == {
    "query/kernel_axes": ("embed", "joined_kv"),
    "key/kernel_axes": ("embed", "joined_kv"),
    "value/kernel_axes": ("embed", "joined_kv"),
    "out/kernel_axes": ("joined_kv", "embed"),
  }
  keys = np.broadcast_to(mask[:, None, :] > 0, (2, 18, 18))
  np.testing.assert_allclose(_apply(LIN, v, x, _ctx(mask))[0, :14], _linear_numpy(p, x, x, keys)[0, :14], **TOL)
  np.testing.assert_allclose(_apply(LIN, v, x, _ctx(mask))[1], _linear_numpy(p, x, x, keys)[1], **TOL)
  causal = keys & np.tril(np.ones((18, 18), bool))[None]
  y = _apply(LIN, v, x, _ctx(mask, causal=True))  # 18 = 4 full chunks of 4 and a partial one
  np.testing.assert_allclose(y[0, :14], _linear_numpy(p, x, x, causal)[0, :14], **TOL)
  np.testing.assert_allclose(y[1], _linear_numpy(p, x, x, causal)[1], **TOL)
  # Cross-mixing: 5 queries over a padded 18-long encoder output.
  xq = _x(13, 2, 5)
  y = _apply(LIN, v, xq, _ctx(_ones(2, 5), kv_mask=mask), kv=x)
  cross = np.broadcast_to(mask[:, None] > 0, (2, 5, 18))
  np.testing.assert_allclose(y, _linear_numpy(p, xq, x, cross), **TOL)


def test_linear_attention_causality_padding_and_decode():
  x = _x(14, 2, 19)
  ctx = _ctx(_ones(2, 19), causal=True)
  v = _init(LIN, x, ctx)
  y = _apply(LIN, v, x, ctx)
  x2 = x.copy()
  x2[:, 9:] = _x(15, 2, 10)
  y2 = _apply(LIN, v, x2, ctx)
  np.testing.assert_allclose(y2[:, :9], y[:, :9], **TOL)
  assert not np.allclose(y2[:, 9], y[:, 9])
  np.testing.assert_allclose(_decode_all(LIN, v, x), y, **TOL)
  # Appended padding leaves real outputs unchanged, causal and not.
  xp = np.concatenate([x, 3 * _x(16, 2, 6)], 1)
  mp = np.concatenate([_ones(2, 19), np.zeros((2, 6), np.float32)], 1)
  for causal in (False, True):
    np.testing.assert_allclose(
      _apply(LIN, v, xp, _ctx(mp, causal=causal))[:, :19], _apply(LIN, v, x, _ctx(_ones(2, 19), causal=causal)), **TOL
    )


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_packing_equals_alone(causal):
  # Segment boundaries inside and at the edges of the chunks of 4; padding at the end.
  v = _init(LIN, _x(0, 1, 3), _ctx(_ones(1, 3)))
  np.testing.assert_allclose(*_packed_and_alone(LIN, v, [3, 6, 4, 2], causal), **TOL)


# ---------------------------------------------------------------------------------------------------------
# All of them


@pytest.mark.parametrize("name", ["global", "window", "fnet", "linear", "linear_causal"])
def test_gradients_are_finite(name):
  module, causal = {
    "global": (TokenMixingMlp(CFG, max_length=12, hidden_dim=6), False),
    "window": (WIN, True),
    "fnet": (FNET, False),
    "linear": (LIN, False),
    "linear_causal": (LIN, True),
  }[name]
  x = _x(30, 2, 9)
  mask = np.array([[1] * 6 + [0] * 3, [1] * 9], np.float32)
  ctx = _ctx(mask, causal=causal)
  v = _init(module, x, ctx)

  def loss(params, x):
    return jnp.sum(module.apply({**v, "params": params}, x, x, ctx) * mask[:, :, None])

  gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(v.get("params", {}), jnp.asarray(x))
  leaves = jax.tree_util.tree_leaves(gp) + [gx]
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert np.abs(np.asarray(gx)[0, :6]).sum() > 0
  np.testing.assert_array_equal(np.asarray(gx)[0, 6:], 0.0)  # padded inputs have no influence


# ---------------------------------------------------------------------------------------------------------
# Absolute position embeddings (linear attention: sinusoidal, Katharopoulos et al.; FNet: learned, as BERT)


def _vaswani(positions, d):
  """Vaswani et al. (2017) §3.5 written out: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
  pe = np.zeros(positions.shape + (d,))
  for i in range(0, d, 2):
    pe[..., i] = np.sin(positions / 10000 ** (i / d))
    if i + 1 < d:
      pe[..., i + 1] = np.cos(positions / 10000 ** (i / d))
  return pe


def test_sinusoidal_features_are_vaswanis():
  from remixer_t5.model import layers

  pos = np.array([[0, 1, 2, 7, 100, 511]])
  for d in (16, 7):
    np.testing.assert_allclose(layers.sinusoidal_features(jnp.asarray(pos), d), _vaswani(pos, d), atol=1e-5)


def _pos_model(enc="none", dec="none", layers_=(0, 0), **kw):
  from remixer_t5.model import network

  cfg = T5Config(
    vocab_size=32,
    emb_dim=D,
    num_heads=2,
    head_dim=8,
    mlp_dim=24,
    num_encoder_layers=layers_[0],
    num_decoder_layers=layers_[1],
  )
  return network.Transformer(
    cfg, encoder_position_embeddings=enc, decoder_position_embeddings=dec, max_position_embeddings=12, **kw
  )


def _rms(x, scale):
  return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * scale


@pytest.mark.parametrize("kind", ["sinusoidal", "learned"])
def test_position_embeddings_are_added_to_the_token_embeddings_per_packed_segment(kind):
  # No layers: the encoder's output is its final norm of (token embedding + position embedding).
  model = _pos_model(enc=kind)
  tokens = np.array([[5, 6, 7, 8, 9, 3, 4, 0], [9, 8, 7, 0, 0, 0, 0, 0]], np.int32)
  v = jax.jit(model.init)(jax.random.PRNGKey(0), tokens, tokens[:, :3], tokens[:, :3])
  p = jax.tree_util.tree_map(np.asarray, v["params"])
  table = (
    p["encoder"]["position_embedder"]["embedding"] if kind == "learned" else _vaswani(np.arange(12)[:, None], D)[:, 0]
  )
  if kind == "learned":
    assert table.shape == (12, D)
    assert v["params_axes"]["encoder"]["position_embedder"]["embedding_axes"].names == ("abspos_buckets", "embed")
  else:
    assert "position_embedder" not in p["encoder"]  # no parameters
  encode = jax.jit(lambda t, s=None: model.apply(v, t, s, enable_dropout=False, method=model.encode))
  emb, scale = p["token_embedder"]["embedding"], p["encoder"]["encoder_norm"]["scale"]
  want = _rms(emb[tokens] + table[np.arange(8)][None], scale)
  np.testing.assert_allclose(encode(tokens), want, rtol=1e-4, atol=1e-5)
  # Packed: positions restart in each segment (0..4, then 0..2), so a packed row equals its examples alone.
  seg = np.array([[1, 1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0, 0, 0]], np.int32)
  want = _rms(emb[tokens] + table[np.array([0, 1, 2, 3, 4, 0, 1, 7])][None], scale)
  np.testing.assert_allclose(encode(tokens, seg)[0, :7], want[0, :7], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(encode(tokens, seg)[1, :3], want[1, :3], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(encode(tokens, seg)[0, 5:7], encode(tokens[:1, 5:7])[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sinusoidal", "learned"])
def test_decoder_position_embeddings_step_with_the_cache(kind):
  # One attention layer per stack: cached decoding, one position per call, equals the full forward pass only
  # if each step adds the embedding of its own position (the decoder counts steps in its cache).
  model = _pos_model(enc=kind, dec=kind, layers_=(1, 1))
  rng = np.random.RandomState(0)
  enc, tgt = rng.randint(2, 32, (2, 7)).astype(np.int32), rng.randint(2, 32, (2, 9)).astype(np.int32)
  dec_in = np.concatenate([np.zeros_like(tgt[:, :1]), tgt[:, :-1]], 1)
  v = jax.jit(model.init)(jax.random.PRNGKey(0), enc, dec_in, tgt)
  full = model.apply(v, enc, dec_in, tgt, enable_dropout=False)
  nopos = _pos_model(enc=kind, layers_=(1, 1))
  pv = {"params": {k: x for k, x in v["params"].items()}}
  pv["params"]["decoder"] = {k: x for k, x in v["params"]["decoder"].items() if k != "position_embedder"}
  assert np.abs(full - nopos.apply(pv, enc, dec_in, tgt, enable_dropout=False)).max() > 1e-3
  encoded = model.apply(v, enc, enable_dropout=False, method=model.encode)
  ones = jnp.ones((2, 9), jnp.int32)
  _, cache = model.apply(
    v, encoded, enc, ones, ones, enable_dropout=False, decode=True, mutable=["cache"], method=model.decode
  )
  step = jax.jit(
    lambda c, tok: model.apply(
      {**v, "cache": c},
      encoded,
      enc,
      tok,
      tok,
      enable_dropout=False,
      decode=True,
      max_decode_length=9,
      mutable=["cache"],
      method=model.decode,
    )
  )
  cache, outs = cache["cache"], []
  for i in range(9):
    logits, mut = step(cache, dec_in[:, i : i + 1])
    cache = mut["cache"]
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-4, atol=2e-5)


def test_linear_attention_needs_position_embeddings_to_see_token_order():
  # The failure the option fixes: without positions, a linear-attention model's logits do not depend on the
  # order of the encoder's tokens; with sinusoidal embeddings they do.
  rng = np.random.RandomState(1)
  enc, tgt = rng.randint(2, 32, (1, 8)).astype(np.int32), rng.randint(2, 32, (1, 5)).astype(np.int32)
  perm = enc[:, ::-1]
  diffs = {}
  for kind in ("none", "sinusoidal"):
    model = _pos_model(
      enc=kind,
      dec=kind,
      layers_=(1, 1),
      encoder_token_mixer=LinearAttention,
      decoder_token_mixer=LinearAttention,
      decoder_cross_mixer=LinearAttention,
    )
    v = jax.jit(model.init)(jax.random.PRNGKey(0), enc, tgt, tgt)
    run = jax.jit(lambda e: model.apply(v, e, tgt, tgt, enable_dropout=False))
    diffs[kind] = float(np.abs(run(enc) - run(perm)).max())
  assert diffs["none"] < 1e-4 < 1e-2 < diffs["sinusoidal"], diffs


def test_position_embedding_settings_are_checked():
  tokens = jnp.ones((1, 13), jnp.int32)
  with pytest.raises(ValueError, match="encoder_position_embeddings.*'rotary'"):
    _pos_model(enc="rotary").init(jax.random.PRNGKey(0), tokens, tokens, tokens)
  with pytest.raises(ValueError, match="cover 12 positions.*length 13.*max_position_embeddings"):
    _pos_model(enc="learned").init(jax.random.PRNGKey(0), tokens, tokens[:, :3], tokens[:, :3])
