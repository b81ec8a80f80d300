"""gMLP / aMLP token mixer (Liu et al. 2021): the paper's equations, masks, packing, decoding, errors."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.gmlp import GatedMlpBlock
from remixer_t5.model.network import T5Config

from jaxpr_util import eqns_in

CFG = T5Config(
  vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=1, num_decoder_layers=1
)
MAX_LEN = 24
ATTN = 8  # aMLP's tiny attention size in these tests
B, LEN = 2, 18  # one shape for most tests, so compiled calls are reused across tests


def ctx_for(mask, segment_ids=None, causal=False, positions=None, decode=False):
  mask = jnp.asarray(mask, jnp.float32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(mask.shape[1], dtype=jnp.int32)[None], mask.shape)
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return base.MixerContext(
    q_mask=mask,
    kv_mask=mask,
    q_positions=jnp.asarray(positions, jnp.int32),
    kv_positions=jnp.asarray(positions, jnp.int32),
    q_segment_ids=seg,
    kv_segment_ids=seg,
    causal=causal,
    decode=decode,
    max_decode_length=mask.shape[1] if decode else None,
  )


def make(attn=0, **kw):
  return GatedMlpBlock(config=CFG, max_length=MAX_LEN, tiny_attention_dim=attn, **kw)


def init(module):
  """Parameters do not depend on the length (W is max_length square): initialise on a fixed dummy."""
  x = jnp.zeros((1, 4, CFG.emb_dim))
  variables = init_variables(module, x, ctx_for(np.ones((1, 4))))
  # Training moves W away from its near-zero start; test with a W that matters.
  params = jax.tree_util.tree_map(lambda p: p, variables["params"])
  params["spatial_kernel"] = jax.random.normal(jax.random.PRNGKey(7), params["spatial_kernel"].shape) * 0.3
  params["spatial_bias"] = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(8), (MAX_LEN,))
  params["sgu_norm"]["bias"] = 0.1 * jax.random.normal(jax.random.PRNGKey(9), params["sgu_norm"]["bias"].shape)
  return {"params": params}


def ones(batch=B, length=LEN):
  return np.ones((batch, length), np.float32)


# Compiled calls: much faster than op-by-op dispatch on a loaded machine.
@functools.partial(jax.jit, static_argnums=0)
def apply(module, variables, x, ctx):
  return module.apply(variables, x, x, ctx)


@functools.partial(jax.jit, static_argnums=0)
def init_variables(module, x, ctx):
  return module.init(jax.random.PRNGKey(0), x, x, ctx)


def flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def inputs(batch, length, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, CFG.emb_dim))


def reference(p, x, mask, causal, attn, w_full=None):
  """The paper's block written out per example in numpy (one unpacked example, positions 0..L-1).

  `w_full`: the L x L W to use (default: the 'full' parameter spatial_kernel)."""
  x = np.asarray(x, np.float64)
  length = x.shape[0]
  erf = np.vectorize(math.erf)
  z = x @ np.asarray(p["proj_in"]["kernel"])
  z = 0.5 * z * (1 + erf(z / math.sqrt(2)))  # exact GELU
  half = z.shape[1] // 2
  z1, z2 = z[:, :half], z[:, half:]
  mu, var = z2.mean(-1, keepdims=True), z2.var(-1, keepdims=True)
  n2 = (z2 - mu) / np.sqrt(var + CFG.layer_norm_epsilon) * np.asarray(p["sgu_norm"]["scale"]) + np.asarray(
    p["sgu_norm"]["bias"]
  )
  w = np.asarray(p["spatial_kernel"] if w_full is None else w_full, np.float64)[:length, :length].copy()
  allowed = np.outer(mask, mask) > 0
  if causal:
    allowed &= np.tril(np.ones((length, length), bool))
  w[~allowed] = 0.0
  gate = w @ n2 + np.asarray(p["spatial_bias"])[:length, None]
  if attn:
    qkv = x @ np.asarray(p["tiny_attn_qkv"]["kernel"])
    q, k, v = qkv[:, :attn], qkv[:, attn : 2 * attn], qkv[:, 2 * attn :]
    out = np.zeros((length, attn))
    for i in range(length):
      js = [j for j in range(length) if allowed[i, j]] or list(range(length))
      s = np.array([q[i] @ k[j] for j in js]) / math.sqrt(attn)
      a = np.exp(s - s.max())
      a /= a.sum()
      out[i] = sum(a_j * v[j] for a_j, j in zip(a, js))
    gate = gate + out @ np.asarray(p["tiny_attn_out"]["kernel"])
  return (z1 * gate) @ np.asarray(p["proj_out"]["kernel"])


@pytest.mark.parametrize("attn", [0, ATTN])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy_reference(attn, causal):
  x = inputs(B, LEN)
  mask = ones()
  mask[1, 11:] = 0
  module = make(attn)
  variables = init(module)
  got = np.asarray(apply(module, variables, x, ctx_for(mask, causal=causal)))
  for b in range(B):
    want = reference(variables["params"], x[b], mask[b], causal, attn)
    real = mask[b] > 0
    np.testing.assert_allclose(got[b][real], want[real], rtol=1e-4, atol=1e-5)


def test_starts_as_an_ffn():
  """W near zero and b = 1 (§2.1): at initialisation s(Z) ≈ Z1, so Y ≈ Z1 V, a plain (GELU) FFN."""
  x = inputs(B, LEN)
  module = make()
  variables = init_variables(module, jnp.zeros((1, 4, CFG.emb_dim)), ctx_for(np.ones((1, 4))))
  p = variables["params"]
  assert float(jnp.max(jnp.abs(p["spatial_kernel"]))) <= 1e-3 / MAX_LEN
  np.testing.assert_array_equal(np.asarray(p["spatial_bias"]), 1.0)
  z = jax.nn.gelu(x @ p["proj_in"]["kernel"], approximate=False)
  ffn = z[..., : CFG.mlp_dim // 2] @ p["proj_out"]["kernel"]
  got = apply(module, variables, x, ctx_for(ones()))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ffn), rtol=0, atol=2e-3)
  # ...but positions do mix: changing one position moves another through W.
  x2 = x.at[:, 0].add(1.0)
  assert not np.allclose(
    np.asarray(apply(module, variables, x2, ctx_for(ones())))[:, 5], np.asarray(got)[:, 5], rtol=0, atol=1e-9
  )


@pytest.mark.parametrize("attn", [0, ATTN])
def test_causal(attn):
  x = inputs(B, LEN)
  module = make(attn)
  variables = init(module)
  y = apply(module, variables, x, ctx_for(ones(), causal=True))
  x2 = x.at[:, 7:].set(inputs(B, LEN - 7, seed=3))
  y2 = apply(module, variables, x2, ctx_for(ones(), causal=True))
  np.testing.assert_allclose(np.asarray(y2[:, :7]), np.asarray(y[:, :7]), rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(y2[:, 7:]), np.asarray(y[:, 7:]))
  # Not causal: the future leaks (the check above can fail).
  assert not np.allclose(
    np.asarray(apply(module, variables, x2, ctx_for(ones()))[:, :7]),
    np.asarray(apply(module, variables, x, ctx_for(ones()))[:, :7]),
  )


@pytest.mark.parametrize("attn", [0, ATTN])
def test_decode_matches_full_causal_forward(attn):
  x = inputs(B, LEN)
  module = make(attn)
  variables = init(module)
  full = apply(module, variables, x, ctx_for(ones(), causal=True))

  dctx = ctx_for(ones(), causal=True, decode=True)
  _, state = jax.jit(lambda v, x: module.apply(v, x, x, dctx, mutable=["cache"]))(variables, x)
  cache = state["cache"]
  assert set(cache) == ({"cached_norm_z2", "cache_index"} | ({"cached_key", "cached_value"} if attn else set()))
  step_ctx = ctx_for(ones(B, 1), causal=True, decode=True).replace(max_decode_length=LEN)

  @jax.jit
  def step(cache, xi):
    y, new = module.apply({**variables, "cache": cache}, xi, xi, step_ctx, mutable=["cache"])
    return y, new["cache"]

  outs = []
  for i in range(LEN):
    y, cache = step(cache, x[:, i : i + 1])
    outs.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)
  assert int(cache["cache_index"]) == LEN


@pytest.mark.parametrize("attn", [0, ATTN])
@pytest.mark.parametrize("causal", [False, True])
def test_appended_padding_changes_nothing(attn, causal):
  x = inputs(B, LEN)
  module = make(attn)
  variables = init(module)
  y = apply(module, variables, x, ctx_for(ones(), causal=causal))
  padded = jnp.concatenate([x, 5.0 * inputs(B, 4, seed=4)], axis=1)  # garbage in the padding
  mask = np.concatenate([ones(), np.zeros((B, 4))], axis=1)
  y2 = apply(module, variables, padded, ctx_for(mask, causal=causal))
  np.testing.assert_allclose(np.asarray(y2[:, :LEN]), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn", [0, ATTN])
@pytest.mark.parametrize("causal", [False, True])
def test_packing_equals_each_alone(attn, causal):
  """Row 0 packs a|b, row 1 packs b|a; each example alone is a padded row of its own."""
  a, b, junk = inputs(1, 5, seed=5)[0], inputs(1, 7, seed=6)[0], inputs(1, LEN, seed=7)[0]
  module = make(attn)
  variables = init(module)
  alone = jnp.stack([jnp.concatenate([a, junk[5:]]), jnp.concatenate([b, junk[7:]])])
  alone_mask = np.array([[1] * 5 + [0] * (LEN - 5), [1] * 7 + [0] * (LEN - 7)], np.float32)
  y_alone = apply(module, variables, alone, ctx_for(alone_mask, causal=causal))
  packed = jnp.stack([jnp.concatenate([a, b, junk[12:]]), jnp.concatenate([b, a, junk[12:]])])
  seg = np.array([[1] * 5 + [2] * 7 + [0] * 6, [1] * 7 + [2] * 5 + [0] * 6])
  pos = np.array([list(range(5)) + list(range(7)) + [0] * 6, list(range(7)) + list(range(5)) + [0] * 6])
  y = apply(module, variables, packed, ctx_for(seg > 0, segment_ids=seg, causal=causal, positions=pos))
  close = lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
  close(y[0, :5], y_alone[0, :5])
  close(y[0, 5:12], y_alone[1, :7])
  close(y[1, :7], y_alone[1, :7])
  close(y[1, 7:12], y_alone[0, :5])


def test_too_long_and_cross_mixing_are_refused():
  module = make()
  x = inputs(1, MAX_LEN + 1)
  with pytest.raises(ValueError, match=rf"{MAX_LEN}.*{MAX_LEN + 1}"):
    module.init(jax.random.PRNGKey(0), x, x, ctx_for(np.ones((1, MAX_LEN + 1))))
  y = inputs(1, 4)
  with pytest.raises(ValueError, match="cross"):
    module.init(jax.random.PRNGKey(0), y, y + 0.0, ctx_for(np.ones((1, 4))))
  with pytest.raises(ValueError, match="even"):
    GatedMlpBlock(config=CFG, hidden_dim=7).init(jax.random.PRNGKey(0), y, y, ctx_for(np.ones((1, 4))))


@pytest.mark.parametrize("attn", [0, ATTN])
def test_param_axes_shapes_and_finite_gradients(attn):
  x = inputs(B, LEN)
  ctx = ctx_for(ones(), causal=True)
  module = make(attn)
  variables = init_variables(module, jnp.zeros((1, 4, CFG.emb_dim)), ctx_for(np.ones((1, 4))))
  params = variables["params"]
  d, h, L = CFG.emb_dim, CFG.mlp_dim, MAX_LEN
  shapes = {k: v.shape for k, v in flat(params).items()}
  want = {
    "proj_in/kernel": (d, h),
    "sgu_norm/scale": (h // 2,),
    "sgu_norm/bias": (h // 2,),
    "spatial_kernel": (L, L),
    "spatial_bias": (L,),
    "proj_out/kernel": (h // 2, d),
  }
  if attn:
    want |= {"tiny_attn_qkv/kernel": (d, 3 * attn), "tiny_attn_out/kernel": (attn, h // 2)}
  assert shapes == want
  count = sum(int(np.prod(s)) for s in shapes.values())
  assert count == 1.5 * d * h + h + L * L + L + (3 * d * attn + attn * h // 2 if attn else 0)
  axes = {k: v.names for k, v in flat(variables["params_axes"]).items()}
  assert {k.removesuffix("_axes") for k in axes} == set(want)
  assert axes["spatial_kernel_axes"] == ("mix_length", "mix_source")
  assert axes["sgu_norm/scale_axes"] == ("mlp",)

  grads = jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x, x, ctx))))(params)
  for g in jax.tree_util.tree_leaves(grads):
    assert np.all(np.isfinite(np.asarray(g)))
  assert float(jnp.sum(jnp.abs(grads["spatial_kernel"]))) > 0
  # Causal: the gradient never reaches W's upper triangle.
  assert float(jnp.sum(jnp.abs(jnp.triu(grads["spatial_kernel"], 1)))) == 0.0


def test_bfloat16_activations_run():
  cfg = T5Config(vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, dtype="bfloat16")
  module = GatedMlpBlock(config=cfg, max_length=MAX_LEN, tiny_attention_dim=ATTN)
  x = inputs(B, LEN).astype(jnp.bfloat16)
  variables = init_variables(module, x, ctx_for(ones()))
  y = apply(module, variables, x, ctx_for(ones(), causal=True))
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(variables["params"]))
  assert np.all(np.isfinite(np.asarray(y, np.float32)))


# --- the Toeplitz spatial matrix of the paper's language models (§4) ---


def toeplitz_numpy(past, future, L):
  """W[i, j] = w[i - j] written out entry by entry (future is None in a causal block: upper triangle 0)."""
  w = np.zeros((L, L))
  for i in range(L):
    for j in range(L):
      if i >= j:
        w[i, j] = past[i - j]
      elif future is not None:
        w[i, j] = future[j - i - 1]
  return w


def init_toeplitz(module, causal, attn=0):
  variables = init_variables(module, jnp.zeros((1, 4, CFG.emb_dim)), ctx_for(np.ones((1, 4)), causal=causal))
  params = dict(variables["params"])
  params["spatial_past"] = 0.3 * jax.random.normal(jax.random.PRNGKey(11), (MAX_LEN,))
  if not causal:
    params["spatial_future"] = 0.3 * jax.random.normal(jax.random.PRNGKey(12), (MAX_LEN - 1,))
  params["spatial_bias"] = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(8), (MAX_LEN,))
  return {"params": params}, variables["params_axes"]


@pytest.mark.parametrize("causal", [False, True])
def test_toeplitz_matches_numpy_reference_and_counts_2L_minus_1(causal):
  module = make(ATTN, spatial="toeplitz")
  variables, axes = init_toeplitz(module, causal, ATTN)
  p = variables["params"]
  shapes = {k: v.shape for k, v in flat(p).items() if k.startswith("spatial")}
  assert shapes == (
    {"spatial_past": (MAX_LEN,), "spatial_bias": (MAX_LEN,)}
    if causal
    else {"spatial_past": (MAX_LEN,), "spatial_future": (MAX_LEN - 1,), "spatial_bias": (MAX_LEN,)}
  )
  assert flat(axes)["spatial_past_axes"].names == ("mix_length",)
  w = toeplitz_numpy(np.asarray(p["spatial_past"]), None if causal else np.asarray(p["spatial_future"]), MAX_LEN)
  x = inputs(B, LEN)
  mask = ones()
  mask[1, 11:] = 0
  got = np.asarray(apply(module, variables, x, ctx_for(mask, causal=causal)))
  for b in range(B):
    want = reference(p, x[b], mask[b], causal, ATTN, w_full=w)
    real = mask[b] > 0
    np.testing.assert_allclose(got[b][real], want[real], rtol=1e-4, atol=1e-5)


def test_toeplitz_decode_padding_and_packing():
  module = make(spatial="toeplitz")
  variables, _ = init_toeplitz(module, causal=True)
  x = inputs(B, LEN)
  full = apply(module, variables, x, ctx_for(ones(), causal=True))
  dctx = ctx_for(ones(), causal=True, decode=True)
  _, state = jax.jit(lambda v, x: module.apply(v, x, x, dctx, mutable=["cache"]))(variables, x)
  cache = state["cache"]
  step_ctx = ctx_for(ones(B, 1), causal=True, decode=True).replace(max_decode_length=LEN)
  step = jax.jit(lambda c, xi: module.apply({**variables, "cache": c}, xi, xi, step_ctx, mutable=["cache"]))
  outs = []
  for i in range(LEN):
    y, new = step(cache, x[:, i : i + 1])
    cache = new["cache"]
    outs.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)

  enc = make(spatial="toeplitz")
  evars, _ = init_toeplitz(enc, causal=False)
  a, b, junk = inputs(1, 5, seed=5)[0], inputs(1, 7, seed=6)[0], inputs(1, LEN, seed=7)[0]
  alone = jnp.stack([jnp.concatenate([a, junk[5:]]), jnp.concatenate([b, junk[7:]])])
  alone_mask = np.array([[1] * 5 + [0] * (LEN - 5), [1] * 7 + [0] * (LEN - 7)], np.float32)
  y_alone = apply(enc, evars, alone, ctx_for(alone_mask))
  packed = jnp.stack([jnp.concatenate([a, b, junk[12:]]), jnp.concatenate([b, a, junk[12:]])])
  seg = np.array([[1] * 5 + [2] * 7 + [0] * 6, [1] * 7 + [2] * 5 + [0] * 6])
  pos = np.array([list(range(5)) + list(range(7)) + [0] * 6, list(range(7)) + list(range(5)) + [0] * 6])
  y = apply(enc, evars, packed, ctx_for(seg > 0, segment_ids=seg, positions=pos))
  close = lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
  close(y[0, :5], y_alone[0, :5])
  close(y[0, 5:12], y_alone[1, :7])
  close(y[1, 7:12], y_alone[0, :5])
  with pytest.raises(ValueError, match="spatial.*'full' or 'toeplitz'.*'banded'"):
    make(spatial="banded").init(jax.random.PRNGKey(0), x, x, ctx_for(ones()))


@pytest.mark.parametrize(
  "spatial,causal,packed", [("toeplitz", False, False), ("toeplitz", True, True), ("full", False, True)]
)
def test_spatial_w_and_its_gradient_use_no_element_gathers(spatial, causal, packed):
  # TPUs serialise element-wise gathers and their scatter-add gradients: a Toeplitz W built by indexing its
  # 2L - 1 weights with an [n, n] offset matrix cost gMLP-base a fixed ~30 GB of memory traffic per step on
  # every core (docs/benchmarks.md's TPU cost table has the step with the tiled form). Gathers of whole rows and
  # columns (the packed 'full' W, base.slice_gather) are fine.
  module = make(spatial=spatial)
  variables = init_toeplitz(module, causal)[0] if spatial == "toeplitz" else init(module)
  x = inputs(B, LEN)
  seg = np.array([[1] * 8 + [2] * (LEN - 8)] * B) if packed else None
  pos = np.array([list(range(8)) + list(range(LEN - 8))] * B) if packed else None
  ctx = ctx_for(ones(), causal=causal, segment_ids=seg, positions=pos)
  jaxpr = jax.make_jaxpr(jax.grad(lambda v: module.apply(v, x, x, ctx).sum()))(variables)
  element_wise = []
  for e in eqns_in(jaxpr.jaxpr):
    if e.primitive.name == "gather" and all(s == 1 for s in e.params["slice_sizes"]):
      element_wise.append(("gather", e.outvars[0].aval.shape))
    elif e.primitive.name.startswith("scatter") and not e.params["dimension_numbers"].update_window_dims:
      element_wise.append((e.primitive.name, e.invars[2].aval.shape))
  # b[pos] (the spatial bias at each token's position) gathers batch x length scalars; nothing n x n.
  assert all(math.prod(shape) <= B * LEN for _, shape in element_wise), element_wise


@pytest.mark.parametrize(
  "platform,impl,kernel",
  [
    ("cuda", "auto", "__gpu$xla.gpu.triton"),
    ("cuda", "xla", None),
    ("tpu", "auto", "tpu_custom_call"),
    ("cpu", "auto", None),
  ],
)
def test_tiny_attention_is_the_attention_operation(platform, impl, kernel):
  """aMLP's tiny attention runs through the attention operation's implementation (`T5Config.attention_impl`):
  lowered for a GPU or a TPU v4, the forward and gradient call the fused kernels; `xla`, and a CPU, do not."""
  import dataclasses

  from jaxpr_util import lowered_for

  module = GatedMlpBlock(
    config=dataclasses.replace(CFG, attention_impl=impl, dtype=jnp.bfloat16),
    max_length=MAX_LEN,
    tiny_attention_dim=ATTN,
  )
  variables = init(module)
  ctx = ctx_for(ones(), causal=True)
  loss = lambda p, x: jnp.sum(module.apply({"params": p}, x, x, ctx).astype(jnp.float32) ** 2)
  text = lowered_for(platform, jax.grad(loss, argnums=(0, 1)), variables["params"], inputs(B, LEN))
  if kernel is None:
    assert "triton" not in text and "tpu_custom_call" not in text
  else:
    assert text.count(kernel) >= 2, text.count(kernel)  # the forward and the gradient's
