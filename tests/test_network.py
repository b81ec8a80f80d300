"""T5.1.1 module properties: names and axes, causality, padding, packing, cache decoding, dtypes, dropout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jaxpr_util import eqns_in

from remixer_t5.model import models, network
from remixer_t5.training import partitioning

CFG = network.T5Config(
  vocab_size=40, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=2, num_decoder_layers=2
)


@pytest.fixture(scope="module")
def model_params():
  module = network.Transformer(CFG)
  # Jitted: op by op, init compiles every primitive alone.
  variables = jax.jit(
    lambda: module.init(
      jax.random.PRNGKey(0),
      jnp.ones((1, 8), jnp.int32),
      jnp.ones((1, 6), jnp.int32),
      jnp.ones((1, 6), jnp.int32),
      enable_dropout=False,
    )
  )()
  return module, variables


def _tokens(seed, shape, low=2):
  return np.random.RandomState(seed).randint(low, CFG.vocab_size, shape).astype(np.int32)


def _shift(targets):
  return np.concatenate([np.zeros_like(targets[:, :1]), targets[:, :-1]], 1)


def test_parameter_paths_follow_t5x_and_carry_logical_axes(model_params):
  _, variables = model_params
  flat = traverse_util.flatten_dict(variables["params"], sep="/")
  for path in [
    "token_embedder/embedding",
    "encoder/relpos_bias/rel_embedding",
    "encoder/layers_0/attention/query/kernel",
    "encoder/layers_1/mlp/wi_0/kernel",
    "encoder/layers_1/mlp/wo/kernel",
    "encoder/encoder_norm/scale",
    "decoder/layers_1/encoder_decoder_attention/out/kernel",
    "decoder/layers_0/pre_cross_attention_layer_norm/scale",
    "decoder/relpos_bias/rel_embedding",
    "decoder/decoder_norm/scale",
    "decoder/logits_dense/kernel",
  ]:
    assert path in flat, path
  assert all(v.dtype == jnp.float32 for v in flat.values())
  mesh = partitioning.make_mesh(1)
  shardings = traverse_util.flatten_dict(partitioning.param_shardings(variables["params_axes"], mesh), sep="/")
  assert set(shardings) == set(flat)
  axes = traverse_util.flatten_dict(
    jax.tree_util.tree_map(lambda a: a.names, variables["params_axes"], is_leaf=lambda x: hasattr(x, "names")), sep="/"
  )
  assert axes["token_embedder/embedding_axes"] == ("vocab", "embed")
  assert axes["encoder/layers_0/attention/query/kernel_axes"] == ("embed", "joined_kv")
  assert axes["decoder/logits_dense/kernel_axes"] == ("embed", "vocab")
  assert axes["encoder/relpos_bias/rel_embedding_axes"] == ("heads", "relpos_buckets")
  used = {a for names in axes.values() for a in names}
  assert used == {"vocab", "embed", "joined_kv", "mlp", "heads", "relpos_buckets"}


def test_future_decoder_tokens_do_not_change_earlier_logits(model_params):
  module, v = model_params
  enc, tgt = _tokens(1, (2, 8)), _tokens(2, (2, 6))
  tgt2 = tgt.copy()
  tgt2[:, 4:] = _tokens(3, (2, 2))
  f = lambda t: module.apply(v, enc, _shift(t), t, enable_dropout=False)
  a, b = f(tgt), f(tgt2)
  np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)  # position 4's input is still tgt[:, 3]
  assert np.abs(a[:, 5] - b[:, 5]).max() > 1e-4


def test_appended_encoder_padding_changes_nothing(model_params):
  module, v = model_params
  enc, tgt = _tokens(4, (2, 8)), _tokens(5, (2, 6))
  padded = np.concatenate([enc, np.zeros((2, 5), np.int32)], 1)
  enc_a = module.apply(v, enc, enable_dropout=False, method=module.encode)
  enc_b = module.apply(v, padded, enable_dropout=False, method=module.encode)
  np.testing.assert_allclose(enc_a, enc_b[:, :8], atol=1e-5)
  np.testing.assert_allclose(
    module.apply(v, enc, _shift(tgt), tgt, enable_dropout=False),
    module.apply(v, padded, _shift(tgt), tgt, enable_dropout=False),
    atol=1e-5,
  )


def test_packed_examples_equal_each_alone(model_params):
  module, v = model_params
  e1, e2, t1, t2 = _tokens(6, (1, 5)), _tokens(7, (1, 4)), _tokens(8, (1, 3)), _tokens(9, (1, 4))
  apply = jax.jit(lambda v, *args: module.apply(v, *args, enable_dropout=False))
  alone = [apply(v, e, _shift(t), t) for e, t in ((e1, t1), (e2, t2))]
  enc = np.concatenate([e1, e2, np.zeros((1, 2), np.int32)], 1)
  tgt = np.concatenate([t1, t2, np.zeros((1, 1), np.int32)], 1)
  dec_in = np.concatenate([_shift(t1), _shift(t2), np.zeros((1, 1), np.int32)], 1)
  seg = lambda *ns: np.concatenate([np.full((1, n), i + 1) for i, n in enumerate(ns)] + [np.zeros((1, 0))], 1)
  pos = lambda *ns: np.concatenate([np.arange(n)[None] for n in ns], 1)
  enc_seg, dec_seg = np.pad(seg(5, 4), ((0, 0), (0, 2))), np.pad(seg(3, 4), ((0, 0), (0, 1)))
  packed = apply(
    v,
    enc,
    dec_in,
    tgt,
    enc_seg.astype(np.int32),
    dec_seg.astype(np.int32),
    np.pad(pos(5, 4), ((0, 0), (0, 2))),
    np.pad(pos(3, 4), ((0, 0), (0, 1))),
  )
  np.testing.assert_allclose(packed[:, :3], alone[0], atol=1e-5)
  np.testing.assert_allclose(packed[:, 3:7], alone[1], atol=1e-5)


def test_packed_rows_take_the_position_bias_from_row_indices(model_params):
  """A packed batch's relative position bias is one [heads, q, k] bias per layer, as for unpacked rows (a
  segment's positions are consecutive, so key - query offsets equal the rows'), read from the table once per
  offset (a product with the q + k - 1 offsets' one-hot) and laid out as a Toeplitz matrix: the table's
  gradient is a [heads, q + k - 1] x [q + k - 1, buckets] product per layer, with no scatter-add into the table (a gather's scatter put 402M
  atomic adds into 384 addresses per layer for T5.1.1-base at batch 128 x 512 with per-example positions, and
  3.1M from row indices). Same outputs: test_packed_examples_..."""
  module, v = model_params
  batch, n, m = 4, 8, 6
  enc, tgt = _tokens(20, (batch, n)), _tokens(21, (batch, m))
  halves = lambda k: np.broadcast_to(np.repeat([1, 2], k // 2), (batch, k)).astype(np.int32)
  restart = lambda k: np.broadcast_to(np.tile(np.arange(k // 2), 2), (batch, k)).astype(np.int32)

  def loss(params):
    return jnp.sum(
      module.apply(
        {"params": params}, enc, _shift(tgt), tgt, halves(n), halves(m), restart(n), restart(m), enable_dropout=False
      )
    )

  jaxpr = jax.make_jaxpr(jax.grad(loss))(v["params"]).jaxpr
  table = tuple(v["params"]["encoder"]["relpos_bias"]["rel_embedding"].shape)
  eqns = list(eqns_in(jaxpr))
  assert not [e for e in eqns if e.primitive.name.startswith("scatter") and tuple(e.outvars[0].aval.shape) == table]
  products = [
    [tuple(x.aval.shape) for x in e.invars]
    for e in eqns
    if e.primitive.name == "dot_general" and tuple(e.outvars[0].aval.shape) == table
  ]
  assert len(products) >= CFG.num_encoder_layers, products  # the check sees the table's gradient
  assert all(np.prod(s) <= max(CFG.num_heads, CFG.relpos_num_buckets) * (2 * n - 1) for p in products for s in p), (
    products
  )


@pytest.mark.parametrize("fuse", [False, True], ids=["", "fused_projections"])
def test_cached_decoding_equals_full_forward(model_params, fuse):
  module, v = model_params
  module = network.Transformer(dataclasses.replace(CFG, fuse_projections=fuse))
  enc, tgt = _tokens(10, (2, 8)), _tokens(11, (2, 20))
  enc[1, 5:] = 0
  full = module.apply(v, enc, _shift(tgt), tgt, enable_dropout=False)
  encoded = module.apply(v, enc, enable_dropout=False, method=module.encode)
  ones = jnp.ones((2, 20), jnp.int32)
  _, cache = module.apply(
    v, encoded, enc, ones, ones, enable_dropout=False, decode=True, mutable=["cache"], method=module.decode
  )
  step = jax.jit(
    lambda c, tok: module.apply(
      {"params": v["params"], "cache": c},
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
  for i in range(20):  # longer than 16 steps, where decoder buckets become logarithmic
    logits, mut = step(cache, dec_in[:, i : i + 1])
    cache = mut["cache"]
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)


def test_bfloat16_activations_keep_float32_params_and_track_float32(model_params):
  _, v = model_params
  module16 = network.Transformer(network.T5Config(**{**CFG.__dict__, "dtype": "bfloat16"}))
  enc, tgt = _tokens(12, (2, 8)), _tokens(13, (2, 6))
  out16 = module16.apply(v, enc, _shift(tgt), tgt, enable_dropout=False)
  out32 = network.Transformer(CFG).apply(v, enc, _shift(tgt), tgt, enable_dropout=False)
  assert out16.dtype == jnp.float32  # logits are always float32
  assert np.abs(out16 - out32).max() < 0.1 * np.abs(out32).max()
  assert np.abs(out16 - out32).max() > 0  # really computed in bf16


def _dot_products(fn, *args) -> int:
  return sum(e.primitive.name == "dot_general" for e in eqns_in(jax.make_jaxpr(fn)(*args).jaxpr))


def test_fused_projections_keep_the_parameters_and_compute_the_same_function(model_params):
  """`fuse_projections`: self-attention's query/key/value, cross-attention's key/value and wi_0/wi_1 each as one
  product. The same initialised tree (t5x's names, shapes, logical axes, values), the same logits and gradients
  in float32 up to rounding, and 3 fewer products a forward encoder layer, 4 a decoder layer."""
  module, v = model_params
  fused = network.Transformer(dataclasses.replace(CFG, fuse_projections=True))
  ones = lambda n: jnp.ones((1, n), jnp.int32)
  init = jax.jit(lambda: fused.init(jax.random.PRNGKey(0), ones(8), ones(6), ones(6), enable_dropout=False))()
  assert jax.tree.structure(init) == jax.tree.structure(v)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(v)))
  enc, tgt = _tokens(20, (2, 8)), _tokens(21, (2, 6))
  enc[1, 6:] = 0
  loss = lambda m: lambda p: jnp.sum(jnp.sin(m.apply({"params": p}, enc, _shift(tgt), tgt, enable_dropout=False)))
  got, want = (jax.jit(jax.value_and_grad(loss(m)))(v["params"]) for m in (fused, module))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):  # to 1e-5 of each leaf's largest
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
  forward = lambda m: lambda p: m.apply({"params": p}, enc, _shift(tgt), tgt, enable_dropout=False)
  saved = _dot_products(forward(module), v["params"]) - _dot_products(forward(fused), v["params"])
  assert saved == 3 * CFG.num_encoder_layers + 4 * CFG.num_decoder_layers


def test_logits_in_the_activation_dtype_take_its_operands_and_give_float32():
  """`logits_in_activation_dtype` with bfloat16 activations: the logits product takes bfloat16 operands and
  returns float32; the logits and loss stay within bfloat16 rounding of the float32 product's."""
  cfg16 = dataclasses.replace(CFG, dtype="bfloat16")
  enc, tgt = _tokens(22, (2, 8)), _tokens(23, (2, 6))
  v = network.Transformer(cfg16).init(jax.random.PRNGKey(1), enc, _shift(tgt), tgt, enable_dropout=False)
  run = lambda cfg: network.Transformer(cfg).apply(v, enc, _shift(tgt), tgt, enable_dropout=False)
  low = dataclasses.replace(cfg16, logits_in_activation_dtype=True)
  out, ref = run(low), run(cfg16)
  assert out.dtype == jnp.float32 and 0 < np.abs(out - ref).max() < 2e-2 * np.abs(ref).max()
  nll = lambda x: float(-jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x), tgt[..., None], -1)))
  assert abs(nll(out) - nll(ref)) < 1e-2 * nll(ref)
  dots = [e for e in eqns_in(jax.make_jaxpr(lambda: run(low))().jaxpr) if e.primitive.name == "dot_general"]
  logits_dot = [e for e in dots if e.outvars[0].aval.shape[-1] == CFG.vocab_size]
  assert [(str(e.invars[0].aval.dtype), str(e.outvars[0].aval.dtype)) for e in logits_dot] == [("bfloat16", "float32")]


@pytest.mark.parametrize("mixers", ["attention", "hypermixing"])
def test_bfloat16_gradients_have_no_float32_by_bfloat16_product(mixers):
  """In bfloat16 (with the logits product in bfloat16 too), every product of the gradient takes operands of one
  dtype: the products with float32 results (attention logits, HyperMixing's sums, the logits) round their
  cotangent to bfloat16 (layers.accumulating_einsum) rather than multiply it, float32, by a bfloat16 operand."""
  from remixer_t5.model.mixers import hypermixer

  cfg = dataclasses.replace(CFG, dtype="bfloat16", logits_in_activation_dtype=True)
  hyper = {k: hypermixer.HyperMixing for k in ("encoder_token_mixer", "decoder_token_mixer", "decoder_cross_mixer")}
  module = network.Transformer(cfg, **(hyper if mixers == "hypermixing" else {}))
  enc, tgt = _tokens(24, (2, 8)), _tokens(25, (2, 6))
  v = module.init(jax.random.PRNGKey(0), enc, _shift(tgt), tgt, enable_dropout=False)
  loss = lambda p: jnp.sum(module.apply({"params": p}, enc, _shift(tgt), tgt, enable_dropout=False))
  dots = [
    tuple(str(x.aval.dtype) for x in e.invars)
    for e in eqns_in(jax.make_jaxpr(jax.grad(loss))(v["params"]).jaxpr)
    if e.primitive.name == "dot_general"
  ]
  assert len(dots) > 10 and ("bfloat16", "bfloat16") in dots
  assert [d for d in dots if len(set(d)) > 1] == []


def test_dropout_only_when_enabled():
  module = network.Transformer(network.T5Config(**{**CFG.__dict__, "dropout_rate": 0.3}))
  enc, tgt = _tokens(14, (2, 8)), _tokens(15, (2, 6))
  v = module.init(jax.random.PRNGKey(0), enc, _shift(tgt), tgt, enable_dropout=False)
  det = [module.apply(v, enc, _shift(tgt), tgt, enable_dropout=False) for _ in range(2)]
  np.testing.assert_array_equal(det[0], det[1])
  drop = [
    module.apply(v, enc, _shift(tgt), tgt, enable_dropout=True, rngs={"dropout": jax.random.PRNGKey(i)})
    for i in range(2)
  ]
  assert np.abs(drop[0] - drop[1]).max() > 1e-3


def test_loss_matches_numpy_cross_entropy_with_z_loss(model_params):
  module, v = model_params
  enc, tgt = _tokens(16, (2, 8)), _tokens(17, (2, 6))
  tgt[1, 4:] = 0
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": _shift(tgt), "decoder_target_tokens": tgt}
  model = models.EncoderDecoderModel(module, z_loss=1e-4)
  loss, m = model.loss_fn(v["params"], batch, None)
  logits = np.asarray(module.apply(v, enc, _shift(tgt), tgt, enable_dropout=False), np.float64)
  log_z = np.log(np.exp(logits).sum(-1))
  ce = log_z - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  w = tgt > 0
  expected = ((ce + 1e-4 * log_z**2) * w).sum() / w.sum()
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  assert float(m["weight_sum"]) == w.sum()
  acc = ((logits.argmax(-1) == tgt) * w).sum()
  assert float(m["correct_sum"]) == acc


@pytest.mark.parametrize("platform,want", [("cpu", "float32"), ("tpu", "bfloat16"), ("gpu", "bfloat16")])
def test_auto_activation_dtype_follows_the_platform_compiled_for(monkeypatch, platform, want):
  """ACTIVATION_DTYPE 'auto' (every model file's): the network computes in bfloat16 where the program is compiled
  for a TPU or a GPU and in float32 for a CPU; the parameters stay float32 either way. The platform is the one
  `kernels.target_device` gives at trace time (a mesh's devices under one), here stood in for."""
  import dataclasses
  from remixer_t5 import kernels

  monkeypatch.setattr(kernels, "target_device", lambda: type("Device", (), {"platform": platform})())
  module = network.Transformer(dataclasses.replace(CFG, dtype="auto", attention_impl="xla", dropout_impl="xla"))
  enc, dec = jnp.ones((1, 8), jnp.int32), jnp.ones((1, 6), jnp.int32)
  params = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), enc, dec, dec, enable_dropout=False))["params"]
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}
  jaxpr = jax.make_jaxpr(lambda p: module.apply({"params": p}, enc, dec, dec, enable_dropout=False))(params)
  dots = [e for e in eqns_in(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  kinds = [str(e.invars[0].aval.dtype) for e in dots]
  if want == "float32":
    assert dots and set(kinds) == {"float32"}
  else:  # the projections in bfloat16 (attention logits and the loss head keep float32 where T5 does)
    assert kinds.count("bfloat16") >= 0.75 * len(kinds), kinds
  with pytest.raises(ValueError, match="T5Config.dtype must be one of"):
    network.T5Config(dtype="bf16")
