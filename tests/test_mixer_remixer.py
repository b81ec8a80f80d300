"""RemixerBlock (Remixers paper §2.1) against an independent numpy reference, and the mixer contract."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.remixer import RemixerBlock
from remixer_t5.model.network import T5Config

CFG = T5Config(
  vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=1, num_decoder_layers=1
)
D, F = CFG.emb_dim, CFG.mlp_dim


def make_ctx(mask, positions=None, segments=None, causal=False, decode=False, max_decode_length=None):
  mask = jnp.asarray(mask, jnp.float32)
  if positions is None:
    positions = jnp.arange(mask.shape[1], dtype=jnp.int32)[None]
  positions = jnp.asarray(positions, jnp.int32)
  segments = None if segments is None else jnp.asarray(segments, jnp.int32)
  return base.MixerContext(
    q_mask=mask,
    kv_mask=mask,
    q_positions=positions,
    kv_positions=positions,
    q_segment_ids=segments,
    kv_segment_ids=segments,
    causal=causal,
    decode=decode,
    max_decode_length=max_decode_length,
  )


def run(block, variables, x, ctx, **kwargs):
  # Eager on purpose: at these sizes compiling whole programs costs more than op-by-op dispatch.
  return block.apply(variables, x, ctx, **kwargs)


def randomized(block, x, ctx, seed=0):
  """Init, then replace every parameter by random values so softmax(H) and α are far from uniform/0.5."""
  variables = block.init(jax.random.PRNGKey(seed), x, ctx)
  rng = np.random.default_rng(seed)
  scale = lambda name: 1.5 if name in ("remix", "alpha") else 0.4
  params = jax.tree_util.tree_map_with_path(
    lambda path, p: jnp.asarray(rng.normal(0, scale(path[-1].key), p.shape), jnp.float32), variables["params"]
  )
  return {**variables, "params": params}


# ---- Independent numpy reference of §2.1 ------------------------------------------------------------------


def np_gelu(z):
  return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def np_sigmoid(z):
  return 1 / (1 + np.exp(-z))


def reference(params, x, mask, positions, segments, causal, width, alpha, compositional):
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  batch, length, _ = x.shape
  positions = np.broadcast_to(np.asarray(positions), (batch, length))
  out = []
  for b in range(batch):
    xb = x[b]
    xp = np_gelu(xb @ p["wi_0"]["kernel"]) * (xb @ p["wi_1"]["kernel"])
    xs = np.zeros_like(xp)
    for i in range(length):
      vis = [
        j
        for j in range(length)
        if mask[b][i]
        and mask[b][j]
        and (segments is None or segments[b][i] == segments[b][j])
        and (not causal or j <= i)
      ]
      if vis:
        logits = np.array([p["remix"][positions[b, i], positions[b, j]] for j in vis])
        w = np.exp(logits - logits.max())
        w /= w.sum()
        xs[i] = w @ xp[vis]
    if not compositional:
      xc = xs
    else:
      if isinstance(alpha, float):
        a = alpha
      elif alpha == "gated":
        a = np_sigmoid(xb @ p["alpha_gate"]["kernel"])
      else:
        a = np_sigmoid(p["alpha"])
      xc = a * (xs * xp) + (1 - a) * (xp - xs)
    if width == "model":
      y = xc @ p["wo"]["kernel"] + xp
    else:
      y = (xc + xp) @ p["wo"]["kernel"]
    out.append(y)
  return np.stack(out)


def inputs(batch=2, length=9, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, length, D)), jnp.float32)


# ---- The equations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", ["mlp", "model"])
@pytest.mark.parametrize("alpha", [0.3, "learned_scalar", "learned_vector", "gated"])
def test_matches_numpy_reference(width, alpha):
  block = RemixerBlock(config=CFG, width=width, alpha=alpha, max_length=12)
  x = inputs()
  mask = np.ones((2, 9))
  mask[1, 6:] = 0  # padding: masked keys drop out of the softmax
  ctx = make_ctx(mask)
  variables = randomized(block, x, ctx)
  got = run(block, variables, x, ctx)
  want = reference(variables["params"], x, mask, ctx.q_positions, None, False, width, alpha, True)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_param_shapes_axes_and_count():
  x, ctx = inputs(1, 5), make_ctx(np.ones((1, 5)))
  expected = {
    ("mlp", 0.5): ({}, 0),
    ("mlp", "learned_scalar"): ({"alpha": ()}, 1),
    ("mlp", "learned_vector"): ({"alpha": (F,)}, F),
    ("mlp", "gated"): ({"alpha_gate": (D, F)}, D * F),
    ("model", "learned_vector"): ({"alpha": (D,)}, D),
    ("model", "gated"): ({"alpha_gate": (D, D)}, D * D),
  }
  for (width, alpha), (extra, extra_count) in expected.items():
    block = RemixerBlock(config=CFG, width=width, alpha=alpha, max_length=7)
    variables = jax.eval_shape(block.init, jax.random.PRNGKey(0), x, ctx)
    params, axes = variables["params"], variables["params_axes"]
    w = F if width == "mlp" else D
    assert params["wi_0"]["kernel"].shape == params["wi_1"]["kernel"].shape == (D, w)
    assert params["wo"]["kernel"].shape == (w, D)
    assert params["remix"].shape == (7, 7)
    for name, shape in extra.items():
      leaf = params[name]["kernel"] if name == "alpha_gate" else params[name]
      assert leaf.shape == shape
    count = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    assert count == 3 * D * w + 7 * 7 + extra_count, (width, alpha)
    # every parameter has its logical axes recorded
    flat_params = {"/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    flat_axes = {
      "/".join(str(k.key) for k in path)[: -len("_axes")]
      for path, _ in jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda a: hasattr(a, "names"))[0]
    }
    assert flat_params == flat_axes
  assert axes["remix_axes"].names == ("mix_length", "mix_source")
  assert axes["wi_0"]["kernel_axes"].names == ("embed", "mlp")
  assert axes["wo"]["kernel_axes"].names == ("mlp", "embed")


def test_not_compositional_is_plain_remixing():
  block = RemixerBlock(config=CFG, compositional=False, max_length=9)
  x, mask = inputs(), np.ones((2, 9))
  ctx = make_ctx(mask)
  variables = randomized(block, x, ctx)
  assert "alpha" not in variables["params"]
  got = run(block, variables, x, ctx)
  want = reference(variables["params"], x, mask, ctx.q_positions, None, False, "mlp", None, False)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_causal_matches_reference_and_ignores_future():
  block = RemixerBlock(config=CFG, alpha="learned_vector", max_length=10)
  x, mask = inputs(), np.ones((2, 9))
  ctx = make_ctx(mask, causal=True)
  variables = randomized(block, x, ctx)
  got = np.asarray(run(block, variables, x, ctx))
  want = reference(variables["params"], x, mask, ctx.q_positions, None, True, "mlp", "learned_vector", True)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  changed = np.asarray(run(block, variables, x.at[:, 5:].add(1.0), ctx))
  np.testing.assert_allclose(changed[:, :5], got[:, :5], atol=1e-6)
  assert np.abs(changed[:, 5:] - got[:, 5:]).max() > 1e-3


# ---- Contract: decode, padding, packing, length, gradients, dropout ------------------------------


def test_decode_steps_equal_full_causal_pass():
  length, batch = 20, 2
  block = RemixerBlock(config=CFG, alpha="gated", max_length=24)
  x = inputs(batch, length, seed=3)
  full_ctx = make_ctx(np.ones((batch, length)), causal=True)
  variables = randomized(block, x, full_ctx, seed=2)
  full = np.asarray(run(block, variables, x, full_ctx))

  init_ctx = make_ctx(np.ones((batch, length)), causal=True, decode=True, max_decode_length=length)
  _, state = run(block, variables, jnp.zeros_like(x), init_ctx, mutable=["cache"])
  cache = state["cache"]
  assert cache["cached_glu"].shape == (batch, length, F)

  @jax.jit
  def step(cache, xi, i):
    ctx = make_ctx(
      jnp.ones((batch, 1)), positions=jnp.full((1, 1), i), causal=True, decode=True, max_decode_length=length
    )
    y, state = block.apply({"params": variables["params"], "cache": cache}, xi, ctx, mutable=["cache"])
    return y, state["cache"]

  outs = []
  for i in range(length):
    y, cache = step(cache, x[:, i : i + 1], i)
    outs.append(np.asarray(y))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-4)
  assert int(cache["cache_index"]) == length


def test_decode_longer_than_h_refused():
  block = RemixerBlock(config=CFG, max_length=8)
  ctx = make_ctx(np.ones((1, 12)), causal=True, decode=True, max_decode_length=12)
  with pytest.raises(ValueError, match="at most 8 positions .* length 12"):
    block.init(jax.random.PRNGKey(0), inputs(1, 12), ctx)


@pytest.mark.parametrize("causal", [False, True])
def test_appended_padding_changes_nothing_and_padding_rows_are_finite(causal):
  block = RemixerBlock(config=CFG, max_length=16)
  x = inputs(2, 10)
  ctx = make_ctx(np.ones((2, 10)), causal=causal)
  variables = randomized(block, x, ctx)
  short = np.asarray(run(block, variables, x, ctx))
  junk = jnp.asarray(np.random.default_rng(5).normal(size=(2, 5, D)) * 10, jnp.float32)
  mask = np.concatenate([np.ones((2, 10)), np.zeros((2, 5))], axis=1)
  mask[1] = 0  # a fully padded row: every query has no visible key
  padded = jnp.concatenate([x, junk], axis=1)
  long = np.asarray(run(block, variables, padded, make_ctx(mask, causal=causal)))
  np.testing.assert_allclose(long[0, :10], short[0], rtol=1e-5, atol=1e-5)
  assert np.isfinite(long).all()


@pytest.mark.parametrize("causal", [False, True])
def test_packed_examples_equal_each_alone(causal):
  block = RemixerBlock(config=CFG, alpha="learned_scalar", max_length=16)
  a, b = inputs(1, 5, seed=7), inputs(1, 7, seed=8)
  pad = inputs(1, 2, seed=9)
  variables = randomized(block, a, make_ctx(np.ones((1, 5))))
  alone_a = np.asarray(run(block, variables, a, make_ctx(np.ones((1, 5)), causal=causal)))
  alone_b = np.asarray(run(block, variables, b, make_ctx(np.ones((1, 7)), causal=causal)))
  packed_x = jnp.concatenate([a, b, pad], axis=1)
  mask = np.array([[1] * 12 + [0] * 2])
  segments = np.array([[1] * 5 + [2] * 7 + [0] * 2])
  positions = np.array([list(range(5)) + list(range(7)) + [0, 0]])
  packed_ctx = make_ctx(mask, positions, segments, causal=causal)
  packed = np.asarray(run(block, variables, packed_x, packed_ctx))
  np.testing.assert_allclose(packed[:, :5], alone_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[:, 5:12], alone_b, rtol=1e-5, atol=1e-5)


def test_too_long_is_a_clear_error():
  block = RemixerBlock(config=CFG, max_length=8)
  with pytest.raises(ValueError, match="RemixerBlock mixes at most 8 positions but got a sequence of length 10"):
    block.init(jax.random.PRNGKey(0), inputs(1, 10), make_ctx(np.ones((1, 10))))


def test_bad_fields_are_clear_errors():
  x, ctx = inputs(1, 4), make_ctx(np.ones((1, 4)))
  with pytest.raises(ValueError, match="width must be 'mlp' or 'model'"):
    RemixerBlock(config=CFG, width="ffn", max_length=4).init(jax.random.PRNGKey(0), x, ctx)
  with pytest.raises(ValueError, match="'learned_scalar'"):
    RemixerBlock(config=CFG, alpha="learned", max_length=4).init(jax.random.PRNGKey(0), x, ctx)
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    RemixerBlock(config=CFG, alpha=1.5, max_length=4).init(jax.random.PRNGKey(0), x, ctx)


@pytest.mark.parametrize("width,alpha", [("mlp", "learned_scalar"), ("model", "gated")])
def test_gradients_finite(width, alpha):
  block = RemixerBlock(config=CFG, width=width, alpha=alpha, max_length=10, remix_dropout=0.1)
  x = inputs(2, 8)
  mask = np.ones((2, 8))
  mask[1] = 0  # fully masked row
  mask[0, 6:] = 0
  ctx = make_ctx(mask, causal=True)
  variables = randomized(block, x, ctx)

  def loss(params, x):
    y = block.apply({"params": params}, x, ctx, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    return jnp.sum(y)

  g_params, g_x = jax.grad(loss, argnums=(0, 1))(variables["params"], x)
  for g in jax.tree_util.tree_leaves(g_params) + [g_x]:
    assert np.isfinite(np.asarray(g)).all()
  assert np.abs(np.asarray(g_params["remix"])).sum() > 0
  assert np.abs(np.asarray(g_params["remix"])[8:]).sum() == 0  # rows beyond the sequence are unused


def test_remix_dropout_only_when_not_deterministic():
  x, ctx = inputs(2, 9), make_ctx(np.ones((2, 9)))
  plain = RemixerBlock(config=CFG, max_length=9)
  dropped = RemixerBlock(config=CFG, max_length=9, remix_dropout=0.5)
  variables = randomized(plain, x, ctx)
  rngs = {"dropout": jax.random.PRNGKey(3)}
  reference_out = np.asarray(run(plain, variables, x, ctx))
  # cfg.dropout_rate is 0, so without remix dropout a stochastic pass is the deterministic one
  np.testing.assert_allclose(
    np.asarray(run(plain, variables, x, ctx, deterministic=False, rngs=rngs)), reference_out, atol=1e-6
  )
  np.testing.assert_allclose(np.asarray(run(dropped, variables, x, ctx, deterministic=True)), reference_out, atol=1e-6)
  noisy = np.asarray(run(dropped, variables, x, ctx, deterministic=False, rngs=rngs))
  assert np.abs(noisy - reference_out).max() > 1e-2


# ---- The exact fast forms -----------------------------------------------------------------------------
# Unpacked rows share one [L, L] P = exp(H - rowmax) applied as X_S = P(m ⊙ X') / (P m); packed rows and
# per-example positions take the per-example matrix from row/column slice gathers of P. Both against the numpy
# reference (softmax over each query's visible keys, written independently of either form).


def _holes_mask(batch, length):
  mask = np.ones((batch, length))
  mask[0, [2, 5]] = 0  # holes inside the row, not only trailing padding
  mask[1, length - 3 :] = 0
  return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["shared_positions", "packed", "per_example_positions"])
def test_every_path_matches_reference(layout, causal):
  length = 11
  block = RemixerBlock(config=CFG, alpha="learned_vector", max_length=13)
  x = inputs(2, length, seed=11)
  mask, positions, segments = _holes_mask(2, length), None, None
  if layout == "packed":  # three segments in row 0 (the last one short), two and padding in row 1
    segments = np.array([[1] * 4 + [2] * 5 + [3] * 2, [1] * 3 + [2] * 5 + [0] * 3])
    positions = np.array([list(range(4)) + list(range(5)) + list(range(2)), list(range(3)) + list(range(5)) + [0] * 3])
    mask = (segments > 0).astype(float)
    mask[0, 6] = 0
  elif layout == "per_example_positions":
    positions = np.stack([np.arange(length), np.arange(length) + 2])
  ctx = make_ctx(mask, positions, segments, causal=causal)
  variables = randomized(block, x, ctx, seed=4)
  got = np.asarray(run(block, variables, x, ctx))
  want = reference(variables["params"], x, mask, ctx.q_positions, segments, causal, "mlp", "learned_vector", True)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def _eqns_in_jaxpr(fn, *args):
  """Every equation of fn's jaxpr, those of the sub-jaxprs (jit, scan, custom_vjp, ...) included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      found.append(eqn)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _shapes_in_jaxpr(fn, *args):
  return {tuple(v.aval.shape) for eqn in _eqns_in_jaxpr(fn, *args) for v in eqn.outvars if hasattr(v.aval, "shape")}


@pytest.mark.parametrize("causal", [False, True])
def test_unpacked_rows_build_no_batch_by_length_squared_tensor(causal):
  batch, length = 3, 7
  block = RemixerBlock(config=CFG, max_length=length)
  x = inputs(batch, length)
  mask = np.ones((batch, length))
  mask[1, 5:] = 0
  unpacked = make_ctx(mask, causal=causal)
  variables = randomized(block, x, unpacked)

  def grads(ctx):
    return lambda params, x: jax.grad(lambda p, x: jnp.sum(block.apply({"params": p}, x, ctx)), argnums=(0, 1))(
      params, x
    )

  shapes = _shapes_in_jaxpr(grads(unpacked), variables["params"], x)
  assert (length, length) in shapes  # softmax(H) once per layer
  assert not any(s[-2:] == (length, length) and np.prod(s[:-2]) > 1 for s in shapes), sorted(shapes)
  # the check can fail: packed rows do build the per-example [batch, L, L] matrix
  segments = np.ones((batch, length), np.int32)
  packed = make_ctx(mask, np.broadcast_to(np.arange(length), (batch, length)), segments, causal=causal)
  assert (batch, length, length) in _shapes_in_jaxpr(grads(packed), variables["params"], x)


def _old_block_output(params, x, ctx):
  """The block as it was before the fast forms: a [batch, L, L] gather of H and a masked softmax per example
  (width 'mlp', α a learned scalar). For gradients, which the numpy reference does not give."""
  xp = jax.nn.gelu(x @ params["wi_0"]["kernel"], approximate=True) * (x @ params["wi_1"]["kernel"])
  pos = jnp.broadcast_to(ctx.q_positions, ctx.q_mask.shape)
  logits = params["remix"][pos[:, :, None], pos[:, None, :]]
  mask = (ctx.q_mask[:, :, None] > 0) & (ctx.q_mask[:, None, :] > 0)
  if ctx.q_segment_ids is not None:
    mask &= ctx.q_segment_ids[:, :, None] == ctx.q_segment_ids[:, None, :]
  if ctx.causal:
    mask &= jnp.tril(jnp.ones(mask.shape[-2:], bool))
  weights = jax.nn.softmax(jnp.where(mask, logits, -1e10), axis=-1) * mask
  xs = weights @ xp
  a = jax.nn.sigmoid(params["alpha"])
  return (a * (xs * xp) + (1 - a) * (xp - xs) + xp) @ params["wo"]["kernel"]


@pytest.mark.parametrize("packed,causal", [(False, False), (False, True), (True, False), (True, True)])
def test_gradients_equal_the_old_formula(packed, causal):
  block = RemixerBlock(config=CFG, max_length=10)
  x = inputs(2, 9, seed=6)
  mask = _holes_mask(2, 9)
  positions = segments = None
  if packed:
    segments = np.array([[1] * 4 + [2] * 5, [1] * 6 + [0] * 3])
    positions = np.array([list(range(4)) + list(range(5)), list(range(6)) + [0] * 3])
    mask = (segments > 0).astype(float)
  ctx = make_ctx(mask, positions, segments, causal=causal)
  variables = randomized(block, x, ctx, seed=8)
  weights = jnp.cos(jnp.arange(9 * D, dtype=jnp.float32)).reshape(9, D)  # a loss that weighs every output
  new = jax.grad(lambda p, x: jnp.sum(block.apply({"params": p}, x, ctx) * weights), argnums=(0, 1))
  old = jax.grad(lambda p, x: jnp.sum(_old_block_output(p, x, ctx) * weights), argnums=(0, 1))
  got, want = new(variables["params"], x), old(variables["params"], x)
  for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
    w = dict(jax.tree_util.tree_flatten_with_path(want)[0])[path]
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5, err_msg=str(path))
  assert np.abs(np.asarray(got[0]["remix"])).max() > 1e-3


def test_bfloat16_activations_stay_close_to_the_float32_reference():
  cfg = dataclasses.replace(CFG, dtype="bfloat16")
  x, mask = inputs(2, 9), _holes_mask(2, 9)
  for causal in (False, True):
    ctx = make_ctx(mask, causal=causal)
    variables = randomized(RemixerBlock(config=CFG, max_length=9), x, ctx)
    got = np.asarray(run(RemixerBlock(config=cfg, max_length=9), variables, x, ctx), np.float32)
    want = reference(variables["params"], x, mask, ctx.q_positions, None, causal, "mlp", "learned_scalar", True)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())


def test_huge_logits_on_hidden_keys_give_finite_rows():
  """P = exp(H - rowmax) takes the max over the row, hidden keys included: a visible row lying > ~87 below it
  underflows and mixes nothing (X_S = 0) instead of NaN; within that range the result is exact."""
  block = RemixerBlock(config=CFG, compositional=False, max_length=6)
  x, mask = inputs(1, 6), np.array([[1, 1, 1, 1, 0, 0]], float)
  ctx = make_ctx(mask)
  variables = randomized(block, x, ctx)
  for spread, exact in ((60.0, True), (200.0, False)):
    h = np.asarray(variables["params"]["remix"]).copy()
    h[:, 4:] += spread  # hidden (padding) keys far above the visible ones
    params = {**variables["params"], "remix": jnp.asarray(h)}
    got = np.asarray(run(block, {"params": params}, x, ctx))
    assert np.isfinite(got).all()
    want = reference(params, x, mask, ctx.q_positions, None, False, "mlp", None, False)
    if exact:
      np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    else:  # X_S underflowed to 0 for the real rows: Y = X' W3 (the 'mlp' residual)
      xp = jax.nn.gelu(x @ params["wi_0"]["kernel"], approximate=True) * (x @ params["wi_1"]["kernel"])
      np.testing.assert_allclose(got[0, :4], np.asarray(xp @ params["wo"]["kernel"])[0, :4], rtol=1e-4, atol=1e-4)


def _scatters_in_jaxpr(fn, *args):
  return [
    (e.primitive.name, str(e.outvars[0].aval.dtype), tuple(e.outvars[0].aval.shape))
    for e in _eqns_in_jaxpr(fn, *args)
    if e.primitive.name.startswith("scatter")
  ]


def test_packed_rows_sum_hs_gradient_in_float32_under_bfloat16_activations():
  """Packed rows read H at each example's positions (base.slice_gather); the gathers' transposes add every
  example's [L, L] cotangent into H's gradient. With bfloat16 activations those sums run in float32 (H is
  gathered before the cast): in bfloat16 they doubled H's gradient error against the float32 block (1.1% vs
  0.57% relative at this batch of 64 packed rows; 1.9% vs 0.9% at 256)."""
  batch, length = 64, 16
  rng = np.random.default_rng(0)
  segments, positions = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
  for b in range(batch):  # two examples a row, cut at a random place
    cut = rng.integers(3, length - 3)
    segments[b, :cut], segments[b, cut:] = 1, 2
    positions[b, :cut], positions[b, cut:] = np.arange(cut), np.arange(length - cut)
  ctx = make_ctx(np.ones((batch, length)), positions, segments)
  x = jnp.asarray(rng.normal(size=(batch, length, D)), jnp.float32)
  variables = randomized(RemixerBlock(config=CFG, max_length=length), x, ctx, seed=3)
  weights = jnp.asarray(rng.normal(size=(batch, length, D)), jnp.float32)

  def grad_h(cfg):
    block = RemixerBlock(config=cfg, max_length=length)
    return lambda p: jax.grad(lambda p: jnp.sum(block.apply({"params": p}, x, ctx).astype(jnp.float32) * weights))(p)[
      "remix"
    ]

  bf16 = grad_h(dataclasses.replace(CFG, dtype="bfloat16"))
  scatters = _scatters_in_jaxpr(bf16, variables["params"])
  assert {(s[0], s[2]) for s in scatters} == {
    ("scatter-add", (batch, length, length)),
    ("scatter-add", (length, length)),
  }, scatters
  assert {s[1] for s in scatters} == {"float32"}, scatters
  want = grad_h(CFG)(variables["params"])
  got = bf16(variables["params"])
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.008
