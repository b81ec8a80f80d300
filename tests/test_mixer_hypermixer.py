"""HyperMixing (Mai et al. 2023, §2.3, Algorithm 1): the paper's equation, masks, packing, causal form, decoding;
the official code's options; the layer layouts of App. F (T5Config.layer_layout).

Compilation dominates the run time, so the tests share a few module variants and shapes (jit caches them).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from remixer_t5.model import network
from remixer_t5.model.config import LAYER_LAYOUTS
from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.hypermixer import HyperMixing
from remixer_t5.model.network import T5Config

from jaxpr_util import eqns_in

CFG = T5Config(
  vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=1, num_decoder_layers=1
)
D, H = CFG.emb_dim, CFG.mlp_dim  # d and d' (hidden_dim = 0 means mlp_dim)
CHUNK = 8

# Between them the variants take every option both ways.
VARIANTS = {
  "tied_ln": dict(tied=True, layer_norm=True, length_normalize=False, position_features="sinusoidal"),
  "untied_lennorm": dict(tied=False, layer_norm=False, length_normalize=True, position_features="sinusoidal"),
  "untied_ln_lennorm_nopos": dict(tied=False, layer_norm=True, length_normalize=True, position_features="none"),
}


@functools.cache
def module(name, **kw):
  return HyperMixing(config=CFG, **{"chunk_size": CHUNK, "segment_block": 2, **VARIANTS[name], **kw})


@functools.cache
def params(name):
  """Every entry random (biases and LayerNorm too, which start at 0 and 1), so each of them is exercised."""
  x = np.zeros((1, 3, D), np.float32)
  shapes = jax.eval_shape(module(name).init, jax.random.PRNGKey(0), x, x, ctx_for(np.ones((1, 3))))["params"]
  rng = np.random.default_rng(3)

  def rand(path, s):
    z = rng.normal(size=s.shape).astype(np.float32)
    if len(s.shape) == 2:  # kernels, fan-in scaled
      return z / math.sqrt(s.shape[0])
    return 0.3 * z + (path[-1].key == "scale")

  return {"params": jax.tree_util.tree_map_with_path(rand, shapes)}


@functools.cache
def _jitted_apply(mod):
  return jax.jit(mod.apply)


def apply(name, q, kv, ctx, **kw):
  return np.asarray(_jitted_apply(module(name, **kw))(params(name), q, kv, ctx))


def positions_of(seg):
  """Positions restarting at 0 in each segment (unpacked rows: one segment)."""
  seg = np.asarray(seg)
  pos = np.zeros(seg.shape, np.int32)
  for i in range(1, seg.shape[1]):
    pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
  return pos


def ctx_for(q_mask, kv_mask=None, q_seg=None, kv_seg=None, causal=False, decode=False):
  self_mixing = kv_mask is None and kv_seg is None
  q_mask = np.asarray(q_mask, np.float32)
  kv_mask = q_mask if kv_mask is None else np.asarray(kv_mask, np.float32)
  kv_seg = q_seg if kv_seg is None else kv_seg
  as_ids = lambda s: None if s is None else np.asarray(s, np.int32)
  q_pos = positions_of(np.ones(q_mask.shape) if q_seg is None else q_seg)
  # Self-mixing shares one positions array, as the stacks do.
  kv_pos = q_pos if self_mixing else positions_of(np.ones(kv_mask.shape) if kv_seg is None else kv_seg)
  return base.MixerContext(
    q_mask=q_mask,
    kv_mask=kv_mask,
    q_positions=q_pos,
    kv_positions=kv_pos,
    q_segment_ids=as_ids(q_seg),
    kv_segment_ids=as_ids(kv_seg),
    causal=causal,
    decode=decode,
    max_decode_length=q_mask.shape[1] if decode else None,
  )


def inputs(batch, length, seed=1):
  return np.random.default_rng(seed).normal(size=(batch, length, D)).astype(np.float32)


# ----- an independent numpy reference: Algorithm 1 for one unpacked example -----

_erf = np.vectorize(math.erf)


def np_gelu(z):
  return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def np_sinusoid(length, d):
  """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (Vaswani et al. §3.5)."""
  k = np.arange(d)
  angle = np.arange(length)[:, None] / 10000.0 ** (2 * (k // 2) / d)[None, :]
  return np.where(k % 2 == 0, np.sin(angle), np.cos(angle))


def np_mlp(p, z):
  return np_gelu(z @ p["wi"]["kernel"] + p["wi_bias"]) @ p["wo"]["kernel"] + p["wo_bias"]


def reference(name, queries, keys, query_positions=True):
  """LN(W2 GELU(W1^T X)), W1 = MLP_in(keys + p), W2 = MLP_out(queries + p), over the real keys given."""
  v = VARIANTS[name]
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params(name)["params"])
  q, k = np.asarray(queries, np.float64), np.asarray(keys, np.float64)
  add = (lambda z: z + np_sinusoid(len(z), D)) if v["position_features"] == "sinusoidal" else (lambda z: z)
  w1 = np_mlp(p["hypernetwork_in"], add(k))
  w2 = np_mlp(p["hypernetwork_in" if v["tied"] else "hypernetwork_out"], add(q) if query_positions else q)
  if v["length_normalize"]:
    w1 = w1 / len(k)
  out = w2 @ np_gelu(w1.T @ k)
  if v["layer_norm"]:
    mu, var = out.mean(-1, keepdims=True), out.var(-1, keepdims=True)
    out = (out - mu) / np.sqrt(var + CFG.layer_norm_epsilon) * p["layer_norm"]["scale"] + p["layer_norm"]["bias"]
  return out


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# ----- tests -----


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_numpy_reference(name):
  x = inputs(2, 7)
  mask = np.ones((2, 7))
  mask[1, 5:] = 0  # row 1 has two padded tokens
  y = apply(name, x, x, ctx_for(mask))
  for r, n in ((0, 7), (1, 5)):
    close(y[r, :n], reference(name, x[r, :n], x[r, :n]), 1e-4)


def test_permutation_equivariant_without_position_information():
  x = inputs(2, 7)
  perm = np.random.default_rng(0).permutation(7)
  ctx = ctx_for(np.ones((2, 7)))
  for name, equivariant in (("untied_ln_lennorm_nopos", True), ("untied_lennorm", False)):
    y, y_perm = apply(name, x, x, ctx), apply(name, x[:, perm], x[:, perm], ctx)
    assert np.allclose(y_perm, y[:, perm], rtol=1e-5, atol=1e-5) == equivariant, name


def test_cost_is_linear_in_length_and_causal_memory_is_bounded_by_the_chunk():
  # XLA's forms (impl='xla'; tests/test_cpu_hypermixing.py and test_gpu_hypermixing.py check the kernels)
  batch, length = 2, 64
  x = inputs(batch, length)
  mod = module("tied_ln", impl="xla")
  for causal in (False, True):
    fn = lambda v, x: mod.apply(v, x, x, ctx_for(np.ones((batch, length)), causal=causal))
    eqns = list(eqns_in(jax.make_jaxpr(fn)(params("tied_ln"), x).jaxpr))
    shapes = [tuple(getattr(v.aval, "shape", ())) for e in eqns for v in e.outvars]
    if not causal:  # tied self-mixing runs its hypernetwork (2 matmuls) once, then W1^T X and W2 act
      assert sum(e.primitive.name == "dot_general" for e in eqns) == 4
    assert not [s for s in shapes if s.count(length) >= 2], "a length x length intermediate"
    # The biggest intermediate is one chunk of d×d' hidden states (and the carried one), not the whole length's.
    assert max(int(np.prod(s)) for s in shapes) <= batch * (CHUNK + 1) * H * D
    assert ((batch, CHUNK, D, H) in shapes) == causal


def test_causal_gradient_moves_no_state_sized_array_by_transpose_or_sum():
  """The causal form's backward touches each chunk's d×d' states only with matmuls and elementwise ops: a
  transpose of them (the W2 read's gradient in a [d', d] layout) or a sum over them (the carried sum added as a
  broadcast product, the outer products' gradients) was XLA:CPU's slowest part of the layer at COGS's
  shapes."""
  # XLA's forms (impl='xla'): the kernels' own buffers are checked in test_cpu/gpu_hypermixing.py
  batch, length = 2, 32
  x = inputs(batch, length)
  seg = np.repeat(np.arange(1, 5), length // 4)[None].repeat(batch, 0)
  mod = module("untied_lennorm", impl="xla")
  ctx = ctx_for(np.ones((batch, length)), q_seg=seg, causal=True)
  grad = jax.make_jaxpr(jax.grad(lambda v, x: jnp.sum(mod.apply(v, x, x, ctx) ** 2), argnums=(0, 1)))
  eqns = list(eqns_in(grad(params("untied_lennorm"), x).jaxpr))
  state = batch * CHUNK * H * D
  # The states as [batch, chunk, d, d'] (rank 4); the chunk matmul's own operand transposes (rank 3) are XLA's
  # to fold into the dot.
  big = [
    (e.primitive.name, tuple(v.aval.shape))
    for e in eqns
    if e.primitive.name in ("transpose", "reduce_sum")
    for v in e.invars
    if len(getattr(getattr(v, "aval", None), "shape", ())) == 4 and int(np.prod(v.aval.shape)) >= state
  ]
  assert not big, big
  assert sum(e.primitive.name == "dot_general" for e in eqns) >= 6  # forward and gradient matmuls are there


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_keeps_inputs_once_not_per_scan_step(causal):
  """What the backward pass saves from the forward does not grow with the number of scan steps: the packed form
  scans over segment ids (length / segment_block steps) and the causal form over chunks; a checkpoint inside the
  packed form's cond once made the scan keep W1, W2 and X for every step (35x the inputs here)."""
  batch, length = 2, 64
  x = inputs(batch, length)
  seg = np.repeat(np.arange(1, 5), length // 4)[None].repeat(batch, 0)  # 4 packed segments per row
  ctx = ctx_for(np.ones((batch, length)), q_seg=seg, causal=causal)
  mod, p = module("tied_ln"), params("tied_ln")
  _, backward = jax.vjp(lambda v, x: mod.apply(v, x, x, ctx), p, x)  # its leaves are what the forward saved
  saved_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(backward))
  # What any implementation keeps: the hypernetwork's activations, W1 (= W2, tied), X and the output, a few
  # [batch, length, d or d'] arrays; per-step copies would be length / 2 = 32 times W1 + W2 + X.
  per_token = batch * length * (D + H) * 4
  assert saved_bytes <= 8 * per_token, (saved_bytes, per_token)


@pytest.mark.parametrize("name,length", [("untied_lennorm", 40), ("tied_ln", 37)])
def test_causal_equals_the_formula_on_every_prefix(name, length):
  # Chunks of 8: several are crossed, and 37 leaves a ragged last one.
  x = inputs(2, length)
  mask = np.ones((2, length))
  mask[1, length - 3 :] = 0
  y = apply(name, x, x, ctx_for(mask, causal=True))
  for r in range(2):
    want = [reference(name, x[r, : i + 1], x[r, : i + 1])[-1] for i in range(int(mask[r].sum()))]
    close(y[r, : len(want)], np.stack(want), 1e-4)


def test_causal_outputs_ignore_the_future():
  x = inputs(2, 40)
  ctx = ctx_for(np.ones((2, 40)), causal=True)
  y = apply("untied_lennorm", x, x, ctx)
  x2 = x.copy()
  x2[:, 11:] = inputs(2, 29, seed=5)
  y2 = apply("untied_lennorm", x2, x2, ctx)
  close(y2[:, :11], y[:, :11])
  assert not np.allclose(y2[:, 11:], y[:, 11:], atol=1e-3)


def test_decode_matches_full_causal_forward():
  batch, length, name = 2, 40, "untied_lennorm"
  x = inputs(batch, length)
  full = apply(name, x, x, ctx_for(np.ones((batch, length)), causal=True))
  mod, variables = module(name), params(name)
  _, state = mod.apply(variables, x, x, ctx_for(np.ones((batch, length)), causal=True, decode=True), mutable=["cache"])
  cache = state["cache"]
  assert set(cache) == {"hidden_sum", "cache_index"} and cache["hidden_sum"].shape == (batch, H, D)
  step_ctx = ctx_for(np.ones((batch, 1)), causal=True, decode=True).replace(max_decode_length=length)

  @jax.jit
  def step(cache, xi):
    y, new = mod.apply({**variables, "cache": cache}, xi, xi, step_ctx, mutable=["cache"])
    return y, new["cache"]

  outs = []
  for i in range(length):
    y, cache = step(cache, x[:, i : i + 1])
    outs.append(y)
  close(jnp.concatenate(outs, 1), full, 1e-4)
  assert int(cache["cache_index"]) == length


@pytest.mark.parametrize("causal", [False, True])
def test_appended_padding_changes_nothing(causal):
  x = inputs(2, 7)
  y = apply("untied_lennorm", x, x, ctx_for(np.ones((2, 7)), causal=causal))
  padded = np.concatenate([x, 5.0 * inputs(2, 33, seed=4)], axis=1)  # garbage in the padding
  mask = np.concatenate([np.ones((2, 7)), np.zeros((2, 33))], axis=1)
  y2 = apply("untied_lennorm", padded, padded, ctx_for(mask, causal=causal))
  close(y2[:, :7], y)


@pytest.mark.parametrize("causal", [False, True])
def test_packing_equals_each_alone(causal):
  # segment_block 2: id 3 lies in the second block; chunks of 8 split segments 2 and 3.
  lengths = (5, 7, 4)
  x = inputs(3, 7, seed=5)
  alone = apply("untied_lennorm", x, x, ctx_for(np.arange(7)[None] < np.array(lengths)[:, None], causal=causal))
  packed = np.concatenate([x[i : i + 1, :n] for i, n in enumerate(lengths)] + [inputs(1, 3, seed=9)], axis=1)
  seg = np.array([[1] * 5 + [2] * 7 + [3] * 4 + [0] * 3])
  y = apply("untied_lennorm", packed, packed, ctx_for(seg > 0, q_seg=seg, causal=causal))
  start = 0
  for i, n in enumerate(lengths):
    close(y[0, start : start + n], alone[i, :n])
    start += n


def test_cross_mixing_reads_the_real_encoder_tokens_only():
  name = "untied_lennorm"
  dec, enc = inputs(2, 5, seed=2), inputs(2, 9, seed=3)
  enc_mask = np.ones((2, 9))
  enc_mask[1, 6:] = 0
  y = apply(name, dec, enc, ctx_for(np.ones((2, 5)), kv_mask=enc_mask))
  for r, n in ((0, 9), (1, 6)):
    close(y[r], reference(name, dec[r], enc[r, :n]), 1e-4)
  # More (garbage) encoder padding changes nothing.
  enc2 = np.concatenate([enc, 3.0 * inputs(2, 4, seed=8)], axis=1)
  y2 = apply(name, dec, enc2, ctx_for(np.ones((2, 5)), kv_mask=np.pad(enc_mask, ((0, 0), (0, 4)))))
  close(y2, y)
  # The cross slot's setting: positions on the encoder keys only.
  y3 = apply(name, dec, enc, ctx_for(np.ones((2, 5)), kv_mask=enc_mask), query_positions=False)
  for r, n in ((0, 9), (1, 6)):
    close(y3[r], reference(name, dec[r], enc[r, :n], query_positions=False), 1e-4)
  # A decode step in the cross slot sees positions for max_decode_length queries: refused unless disabled.
  step_ctx = ctx_for(np.ones((2, 5)), kv_mask=enc_mask).replace(q_mask=np.ones((2, 1), np.float32))
  with pytest.raises(ValueError, match="query_positions=False"):
    jax.eval_shape(module(name).apply, params(name), dec[:, :1], enc, step_ctx)
  assert jax.eval_shape(module(name, query_positions=False).apply, params(name), dec[:, :1], enc, step_ctx).shape == (
    2,
    1,
    D,
  )


def test_packed_cross_mixing_equals_each_alone():
  name = "untied_lennorm"
  dec, enc = inputs(2, 5, seed=11), inputs(2, 9, seed=12)
  dec_len, enc_len = (3, 2), (2, 4)
  alone = apply(name, dec, enc, ctx_for(np.ones((2, 5)), kv_mask=np.arange(9)[None] < np.array(enc_len)[:, None]))
  dec_p = np.concatenate([dec[0, : dec_len[0]], dec[1, : dec_len[1]], dec[0, 3:4]])[None]
  enc_p = np.concatenate([enc[0, : enc_len[0]], enc[1, : enc_len[1]], enc[0, 5:8]])[None]
  q_seg, kv_seg = np.array([[1, 1, 1, 2, 2, 0]]), np.array([[1, 1, 2, 2, 2, 2, 0, 0, 0]])
  y = apply(name, dec_p, enc_p, ctx_for(q_seg > 0, kv_seg > 0, q_seg=q_seg, kv_seg=kv_seg))
  close(y[0, :3], alone[0, :3])
  close(y[0, 3:5], alone[1, :2])


@pytest.mark.parametrize("segment_block", [1, 3])
def test_packed_cross_mixing_reads_every_segment_up_to_the_shorter_length(segment_block):
  """As many segments as the shorter side has positions (4 one-token queries, 4 x 3 keys): the last id, 4 =
  min(q_len, kv_len), is the last the segmented form looks for, and each segment reads its own keys only."""
  name = "untied_lennorm"
  dec, enc = inputs(4, 1, seed=13), inputs(4, 3, seed=14)
  alone = apply(name, dec, enc, ctx_for(np.ones((4, 1)), kv_mask=np.ones((4, 3))), segment_block=segment_block)
  q_seg, kv_seg = np.arange(1, 5)[None], np.repeat(np.arange(1, 5), 3)[None]
  y = apply(
    name,
    dec.reshape(1, 4, D),
    enc.reshape(1, 12, D),
    ctx_for(np.ones((1, 4)), np.ones((1, 12)), q_seg=q_seg, kv_seg=kv_seg),
    segment_block=segment_block,
  )
  close(y[0], alone[:, 0])


def _axes_of(tree, prefix=""):
  for key, v in tree.items():
    if hasattr(v, "names"):  # flax.linen.partitioning.AxisMetadata
      yield prefix + key.removesuffix("_axes"), v.names
    else:
      yield from _axes_of(v, f"{prefix}{key}/")


@pytest.mark.parametrize("tied", [True, False])
def test_param_axes_and_count(tied):
  x = inputs(2, 6)
  variables = jax.eval_shape(
    HyperMixing(config=CFG, tied=tied).init, jax.random.PRNGKey(0), x, x, ctx_for(np.ones((2, 6)))
  )
  shapes = {
    "/".join(k.key for k in path): v.shape for path, v in jax.tree_util.tree_leaves_with_path(variables["params"])
  }
  nets = ["hypernetwork_in"] + ([] if tied else ["hypernetwork_out"])
  want = {"layer_norm/scale": (D,), "layer_norm/bias": (D,)}
  for n in nets:
    want |= {f"{n}/wi/kernel": (D, D), f"{n}/wi_bias": (D,), f"{n}/wo/kernel": (D, H), f"{n}/wo_bias": (H,)}
  assert shapes == want
  assert sum(int(np.prod(s)) for s in shapes.values()) == len(nets) * (D * D + D * H + D + H) + 2 * D
  axes = dict(_axes_of(variables["params_axes"]))
  assert set(axes) == set(want)
  assert axes["hypernetwork_in/wi/kernel"] == ("embed", "mlp")
  assert axes["hypernetwork_in/wi_bias"] == ("mlp",)
  assert axes["hypernetwork_in/wo/kernel"] == ("mlp", "mix_hidden")
  assert axes["hypernetwork_in/wo_bias"] == ("mix_hidden",)
  assert axes["layer_norm/scale"] == axes["layer_norm/bias"] == ("embed",)


@pytest.mark.parametrize("mode", ["plain", "causal_packed", "packed"])
def test_gradients_are_finite(mode):
  name = "untied_ln_lennorm_nopos"
  x = inputs(2, 11)
  seg = np.array([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2])
  packed = mode != "plain"
  ctx = ctx_for(seg > 0 if packed else np.ones((2, 11)), q_seg=seg if packed else None, causal=mode == "causal_packed")
  loss = lambda p, x: jnp.sum(jnp.sin(module(name).apply({"params": p}, x, x, ctx)))
  grads, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params(name)["params"], x)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(np.asarray(g))) and float(jnp.abs(g).sum()) > 0, path
  assert np.all(np.isfinite(np.asarray(gx))) and float(jnp.abs(gx).sum()) > 0


def test_bad_settings_are_refused():
  x = inputs(1, 4)
  ctx = ctx_for(np.ones((1, 4)))
  init = lambda mod, ctx: jax.eval_shape(mod.init, jax.random.PRNGKey(0), x, x, ctx)
  with pytest.raises(ValueError, match="position_features"):
    init(HyperMixing(config=CFG, position_features="learned"), ctx)
  with pytest.raises(ValueError, match="segment ids"):
    init(HyperMixing(config=CFG), ctx.replace(q_segment_ids=np.ones((1, 4), np.int32)))
  with pytest.raises(ValueError, match="query length 4 and key length 3"):
    jax.eval_shape(
      HyperMixing(config=CFG).init,
      jax.random.PRNGKey(0),
      x,
      x[:, :3],
      ctx_for(np.ones((1, 4)), kv_mask=np.ones((1, 3)), causal=True),
    )


def test_bfloat16_activations_run():
  cfg = T5Config(vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, dtype="bfloat16")
  x = jnp.asarray(inputs(2, 6), jnp.bfloat16)
  seg = np.array([[1] * 3 + [2] * 3, [1] * 6])
  for causal in (False, True):
    mod = HyperMixing(config=cfg, chunk_size=4)
    ctx = ctx_for(np.ones((2, 6)), q_seg=seg, causal=causal)
    y = jax.jit(mod.apply)(params("tied_ln"), x, x, ctx)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))


def test_official_code_options_no_bias_and_scaled_inputs_match_numpy():
  # github.com/idiap/hypermixing: hypernetworks without biases, and sqrt(d) * x_j + p_j as their input.
  mod = HyperMixing(config=CFG, use_bias=False, scale_inputs=True)
  x = inputs(1, 7, seed=5)
  ctx = ctx_for(np.ones((1, 7)))
  shapes = jax.eval_shape(mod.init, jax.random.PRNGKey(0), x, x, ctx)["params"]
  assert set(shapes["hypernetwork_in"]) == {"wi", "wo"}  # no wi_bias / wo_bias
  rng = np.random.default_rng(4)
  p = jax.tree_util.tree_map(
    lambda s: (
      (rng.normal(size=s.shape) / math.sqrt(s.shape[0])).astype(np.float32)
      if len(s.shape) == 2
      else (1 + 0.3 * rng.normal(size=s.shape)).astype(np.float32)
    ),
    shapes,
  )
  got = jax.jit(mod.apply)({"params": p}, x, x, ctx)
  q = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
  xs = np.asarray(x[0], np.float64)
  w = np_gelu((math.sqrt(D) * xs + np_sinusoid(7, D)) @ q["hypernetwork_in"]["wi"]["kernel"])
  w = w @ q["hypernetwork_in"]["wo"]["kernel"]
  out = w @ np_gelu(w.T @ xs)
  out = (out - out.mean(-1, keepdims=True)) / np.sqrt(out.var(-1, keepdims=True) + CFG.layer_norm_epsilon)
  out = out * q["layer_norm"]["scale"] + q["layer_norm"]["bias"]
  close(got[0], out, tol=1e-4)
  # The scaling changes the result (the test can fail).
  plain = jax.jit(HyperMixing(config=CFG, use_bias=False).apply)({"params": p}, x, x, ctx)
  assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 1e-2


# ----- layer layouts (T5Config.layer_layout; HyperMixer paper App. F) -----


class _StubTokenMixer(nn.Module):
  """tanh(q W) + mean_j(kv_j) V: mixes tokens (and reads the cross slot's encoder output) with two weights."""

  config: T5Config

  @nn.compact
  def __call__(self, q, kv, ctx, *, deterministic=True):
    w = self.param("w", nn.initializers.normal(0.5), (q.shape[-1], q.shape[-1]))
    v = self.param("v", nn.initializers.normal(0.5), (q.shape[-1], q.shape[-1]))
    return jnp.tanh(q @ w) + jnp.mean(kv, axis=1, keepdims=True) @ v


class _StubFeatureMixer(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x, ctx, *, deterministic=True):
    return jnp.sin(x @ self.param("w", nn.initializers.normal(0.5), (x.shape[-1], x.shape[-1])))


def _np_layer(layout, p, x, slots):
  """App. F's equations with the stack's RMSNorm: `slots` are (name, fn) in order, the last the feature slot."""

  def norm(z, name):
    return z / np.sqrt(np.mean(z**2, -1, keepdims=True) + CFG.layer_norm_epsilon) * p[name]["scale"]

  layer_input = x
  for i, (name, fn) in enumerate(slots):
    last = i == len(slots) - 1
    if layout == "post_norm":
      x = norm(x + fn(x), f"post_{name}_layer_norm")
    else:
      y = fn(norm(x, f"pre_{name}_layer_norm"))
      x = (layer_input if layout == "serialized" and last else x) + y
  return x


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_layer_layouts_match_app_f(stack):
  x = inputs(2, 5, seed=7)
  enc = inputs(2, 4, seed=8)
  ctx = ctx_for(np.ones((2, 5)))
  outs = {}
  for layout in LAYER_LAYOUTS:
    cfg = dataclasses.replace(CFG, layer_layout=layout)
    if stack == "encoder":
      layer = network.EncoderLayer(cfg, token_mixer=_StubTokenMixer, feature_mixer=_StubFeatureMixer)
      args = (x, ctx, True)
    else:
      layer = network.DecoderLayer(
        cfg, token_mixer=_StubTokenMixer, cross_mixer=_StubTokenMixer, feature_mixer=_StubFeatureMixer
      )
      args = (x, enc, ctx, ctx_for(np.ones((2, 5)), kv_mask=np.ones((2, 4))), True)
    shapes = jax.eval_shape(layer.init, jax.random.PRNGKey(0), *args)["params"]
    rng = np.random.default_rng(9)
    p = jax.tree_util.tree_map(
      lambda s: (rng.normal(size=s.shape) * (0.5 if len(s.shape) == 2 else 0.2) + (len(s.shape) == 1)).astype(
        np.float32
      ),
      shapes,
    )
    got = np.asarray(jax.jit(layer.apply)({"params": p}, *args))
    q = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    mix = lambda name, kv=None: (
      lambda z: np.tanh(z @ q[name]["w"]) + np.mean(z if kv is None else kv, axis=1, keepdims=True) @ q[name]["v"]
    )
    feature = ("feature_mixer", lambda z: np.sin(z @ q["feature_mixer"]["w"]))
    slots = (
      [("token_mixer", mix("token_mixer"))]
      if stack == "encoder"
      else [("token_mixer", mix("token_mixer")), ("cross_mixer", mix("cross_mixer", enc.astype(np.float64)))]
    )
    want = _np_layer(layout, q, x.astype(np.float64), slots + [feature])
    close(got, want, tol=1e-4)
    outs[layout] = got
  # The three layouts are different functions of the same parameters.
  assert (
    min(
      np.abs(outs[a] - outs[b]).max()
      for a, b in [("pre_norm", "post_norm"), ("pre_norm", "serialized"), ("post_norm", "serialized")]
    )
    > 1e-2
  )


def test_unknown_layer_layout_is_refused():
  with pytest.raises(ValueError, match="layer_layout must be one of .*'pre_norm'.*got 'sandwich'"):
    T5Config(layer_layout="sandwich")


def test_packed_form_loops_only_over_the_blocks_that_hold_ids():
  """The XLA packed form's forward and gradient are loops whose trip count comes from the batch's largest id
  (a fixed-length scan whose unused steps sat in a cond cost 180x the unpacked layer on a GPU): no cond, and
  the loops' bounds are computed from a max over the ids. (impl='xla': with 'auto' the jaxpr also holds the
  platform choice, a cond between XLA's form and the CPU kernel.)"""
  batch, length = 2, 32
  x = inputs(batch, length)
  seg = np.repeat(np.arange(1, 5), length // 4)[None].repeat(batch, 0)
  mod, p = module("tied_ln", impl="xla"), params("tied_ln")
  ctx = ctx_for(np.ones((batch, length)), q_seg=seg)
  grad = jax.make_jaxpr(jax.grad(lambda v, x: jnp.sum(mod.apply(v, x, x, ctx) ** 2), argnums=(0, 1)))
  eqns = list(eqns_in(grad(p, x).jaxpr))
  names = [e.primitive.name for e in eqns]
  assert "cond" not in names and "scan" not in names
  assert names.count("while") == 2 and "reduce_max" in names  # forward and gradient; the bound from max(ids)
