"""Memory options: gradient accumulation, per-layer rematerialisation, scan over layers.

Each option must leave the numbers unchanged: accumulated gradients equal the full batch's, remat'd and scanned
stacks equal the unrolled one (scanned parameters converted back with `unstack_scanned_params`), and decoding
with a scanned stack equals the full forward pass. Remat must also lower XLA's temporary memory.
"""

import dataclasses
import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from remixer_t5.training import accumulate, optim, partitioning
from remixer_t5.model import models, network
from remixer_t5.model.mixers import linear_attention

CFG = network.T5Config(
  vocab_size=40, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=2, num_decoder_layers=2
)
ONES = (jnp.ones((1, 8), jnp.int32), jnp.ones((1, 6), jnp.int32), jnp.ones((1, 6), jnp.int32))


def _init(module, seed=0):
  """Variables of `module` (jitted: one compilation instead of many small eager ones)."""
  return jax.jit(lambda: module.init(jax.random.PRNGKey(seed), *ONES, enable_dropout=False))()


def _abstract_init(module):
  """The variables' tree, shapes and axis names without computing them."""
  return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *ONES, enable_dropout=False))


def _shapes(tree):
  return jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)


def _perturbed(params, seed=1):
  """Every parameter moved off its initial value, so no part of the model sits at a special point."""
  rs = np.random.RandomState(seed)
  return jax.tree_util.tree_map(lambda x: x + (0.05 * rs.randn(*x.shape)).astype(np.float32), params)


def _batch(rows=4, enc_len=8, dec_len=6, seed=0):
  """Rows padded to different lengths, so microbatches hold different numbers of target tokens."""
  rs = np.random.RandomState(seed)
  enc = rs.randint(2, CFG.vocab_size, (rows, enc_len)).astype(np.int32)
  tgt = rs.randint(2, CFG.vocab_size, (rows, dec_len)).astype(np.int32)
  for i in range(rows):
    enc[i, enc_len - i :] = 0
    tgt[i, dec_len - (dec_len * i) // rows :] = 0  # 6, 5, 3, 2 real tokens for 4 rows
  dec_in = np.concatenate([np.zeros_like(tgt[:, :1]), tgt[:, :-1]], 1) * (tgt > 0)
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec_in, "decoder_target_tokens": tgt}


def _max_rel_err(a, b):
  """max over leaves of max|a - b| / max|b| (the leaf's scale)."""
  return max(
    float(jnp.abs(x - y).max() / jnp.maximum(jnp.abs(y).max(), 1e-30))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )


@pytest.fixture(scope="module")
def t5():
  module = network.Transformer(CFG)
  return module, _perturbed(_init(module)["params"])


@pytest.fixture(scope="module")
def full_batch(t5):
  """The full batch's (loss, metrics), gradient of the model's loss (z-loss on)."""
  module, params = t5
  model = models.EncoderDecoderModel(module, z_loss=1e-3)
  return model, jax.jit(jax.value_and_grad(model.loss_fn, has_aux=True))(params, _batch(), None)


# Dropout keys for tests: XLA:CPU compiles threefry-based dropout masks several times slower.
CHEAP_RNG = "unsafe_rbg"

# Microbatches of one row run other XLA kernels than the batch of four: even the summed per-row gradients of
# the plain model differ from the batch's by up to ~1.3e-6 of a leaf's scale in float32 (deepest layers).
BATCH_SHAPE_RTOL = 3e-6


# --- gradient accumulation -----------------------------------------------------------------------------
@pytest.mark.parametrize("num_microbatches,lnf", [(2, None), (4, 7.0)])
def test_accumulated_gradient_equals_full_batch(t5, full_batch, num_microbatches, lnf):
  _, params = t5
  model, ((loss, metrics), grads) = full_batch
  scale = 1.0 if lnf is None else float(metrics["weight_sum"]) / lnf  # the reference divides by the tokens
  model = models.EncoderDecoderModel(model.module, z_loss=1e-3, loss_normalizing_factor=lnf)
  f = jax.jit(accumulate.value_and_grad(model.loss_fn, num_microbatches, loss_normalizing_factor=lnf))
  (acc_loss, acc_metrics), acc_grads = f(params, _batch(), None)
  assert _max_rel_err(acc_grads, jax.tree_util.tree_map(lambda g: g * scale, grads)) < BATCH_SHAPE_RTOL
  np.testing.assert_allclose(acc_loss, loss * scale, rtol=1e-6)
  assert set(acc_metrics) == set(metrics)
  for k in metrics:
    np.testing.assert_allclose(acc_metrics[k], metrics[k], rtol=1e-6, err_msg=k)


def test_accumulation_sums_microbatch_gradients_with_folded_dropout_rngs():
  module = network.Transformer(dataclasses.replace(CFG, dropout_rate=0.3, num_encoder_layers=1, num_decoder_layers=1))
  params, model = _perturbed(_init(module)["params"]), models.EncoderDecoderModel(module)
  batch, rng = _batch(), jax.random.key(7, impl=CHEAP_RNG)
  _, grads = jax.jit(accumulate.value_and_grad(model.loss_fn, 2))(params, batch, rng)
  # By hand: microbatch i = rows i, i + 2 with fold_in(rng, i); summed losses, one division by all tokens.
  sum_grad = jax.jit(jax.grad(lambda p, b, r: model.loss_fn(p, b, r)[1]["loss_sum"]))
  rows = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
  tokens = [float((b["decoder_target_tokens"] > 0).sum()) for b in rows]
  assert tokens[0] != tokens[1]
  per = [sum_grad(params, b, jax.random.fold_in(rng, i)) for i, b in enumerate(rows)]
  ref = jax.tree_util.tree_map(lambda a, b: (a + b) / sum(tokens), *per)
  assert _max_rel_err(grads, ref) < 1e-6
  # Teeth: averaging the microbatches' normalised gradients weighs tokens unequally; one rng for all
  # microbatches gives other dropout masks.
  naive = jax.tree_util.tree_map(lambda a, b: (a / tokens[0] + b / tokens[1]) / 2, *per)
  assert _max_rel_err(naive, ref) > 1e-3
  same_rng = jax.tree_util.tree_map(lambda a, b: (a + b) / sum(tokens), *[sum_grad(params, b, rng) for b in rows])
  assert _max_rel_err(same_rng, ref) > 1e-3


def test_accumulation_needs_a_divisor_of_the_batch_and_one_microbatch_is_plain_value_and_grad(t5, full_batch):
  _, params = t5
  model, ((loss, _), grads) = full_batch
  with pytest.raises(ValueError, match="num_microbatches=3 must be a positive divisor of the batch size 4"):
    accumulate.value_and_grad(model.loss_fn, 3)(params, _batch(), None)
  (one_loss, _), one_grads = jax.jit(accumulate.value_and_grad(model.loss_fn, 1))(params, _batch(), None)
  assert one_loss == loss
  jax.tree_util.tree_map(np.testing.assert_array_equal, one_grads, grads)


# --- rematerialisation ---------------------------------------------------------------------------------
def _loss(module, params, batch, dropout_rng=None):
  """A scalar that weighs every logit differently (so gradients are not special)."""
  logits = module.apply(
    {"params": params},
    batch["encoder_input_tokens"],
    batch["decoder_input_tokens"],
    batch["decoder_target_tokens"],
    enable_dropout=dropout_rng is not None,
    rngs=None if dropout_rng is None else {"dropout": dropout_rng},
  )
  w = jnp.sin(jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)
  return jnp.mean(jax.nn.log_softmax(logits) * w), logits


def _value_grad(module):
  return jax.jit(jax.value_and_grad(functools.partial(_loss, module), has_aux=True))


@pytest.fixture(scope="module")
def unrolled(t5):
  """Logits and gradients of the default (unrolled, no remat) stack."""
  module, params = t5
  (_, logits), grads = _value_grad(module)(params, _batch())
  return logits, grads


def test_remat_policies_keep_parameters_outputs_and_gradients(t5):
  module, params = t5
  # With dropout on: the recomputed forward pass must draw the same masks. One layer per stack (the first
  # layers' parameters) keeps the four compilations short.
  cfg = dataclasses.replace(CFG, dropout_rate=0.2, num_encoder_layers=1, num_decoder_layers=1)
  params = {k: {n: p for n, p in v.items() if n != "layers_1"} for k, v in params.items()}
  batch, rng = _batch(), jax.random.key(5, impl=CHEAP_RNG)
  (_, logits), grads = _value_grad(network.Transformer(cfg))(params, batch, rng)
  # Same parameter names and shapes (remat changes what the backward pass keeps, nothing else).
  assert _shapes(_abstract_init(network.Transformer(dataclasses.replace(CFG, remat_policy="full")))) == _shapes(
    _abstract_init(module)
  )
  for policy in ("full", "dots", "minimal"):
    remat = network.Transformer(dataclasses.replace(cfg, remat_policy=policy))
    (_, r_logits), r_grads = _value_grad(remat)(params, batch, rng)
    np.testing.assert_allclose(r_logits, logits, atol=1e-6, err_msg=policy)
    jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, atol=1e-6, err_msg=policy), r_grads, grads)


def test_unknown_remat_policy_is_refused():
  with pytest.raises(ValueError, match="remat_policy must be one of"):
    network.T5Config(remat_policy="everything")


def _temp_bytes(cfg, batch=2, length=128):
  """XLA's temporary-buffer bytes of the compiled forward + backward pass."""
  module = network.Transformer(cfg)
  params = _abstract_init(module)["params"]
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  grad = jax.grad(lambda p, e, t: jnp.sum(module.apply({"params": p}, e, t, t, enable_dropout=False)))
  return jax.jit(grad).lower(params, tokens, tokens).compile().memory_analysis().temp_size_in_bytes


def test_remat_lowers_temporary_memory_of_a_scanned_stack():
  none = _temp_bytes(dataclasses.replace(CFG, scan_layers=True))
  full = _temp_bytes(dataclasses.replace(CFG, scan_layers=True, remat_policy="full"))
  assert full < 0.5 * none, (full, none)


# XLA:CPU's default concurrency-optimised scheduler hoists the recomputation of unrolled remat'd layers into the
# forward pass, which undoes the saving; its memory-minimising scheduler (as on accelerators) keeps it. XLA
# flags are read once per process, hence the subprocess.
UNROLLED_MEMORY = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    import dataclasses, sys
    sys.path.insert(0, os.path.dirname({test_file!r}))
    import test_memory_options as t
    none = t._temp_bytes(t.CFG)
    full = t._temp_bytes(dataclasses.replace(t.CFG, remat_policy="full"))
    print("TEMP", none, full)
    assert full < 0.9 * none, (full, none)
""")


def test_remat_lowers_temporary_memory_of_unrolled_layers():
  out = subprocess.run(
    [sys.executable, "-c", UNROLLED_MEMORY.format(test_file=__file__)], capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


# --- scan over layers ----------------------------------------------------------------------------------
SCAN_CFG = dataclasses.replace(CFG, scan_layers=True)


def test_scanned_parameters_are_the_unrolled_ones_stacked_on_a_layers_axis(t5):
  module, params = t5
  v = _abstract_init(network.Transformer(SCAN_CFG))
  flat = traverse_util.flatten_dict(v["params"], sep="/")
  assert flat["encoder/layers/attention/query/kernel"].shape == (2, 16, 16)
  assert flat["decoder/layers/mlp/wi_0/kernel"].shape == (2, 16, 24)
  assert flat["encoder/relpos_bias/rel_embedding"].shape == (2, 32)  # still one table per stack
  stacked = network.stack_params(params)
  assert _shapes(stacked) == _shapes(v["params"])
  jax.tree_util.tree_map(np.testing.assert_array_equal, network.unstack_scanned_params(stacked), params)
  jax.tree_util.tree_map(
    np.testing.assert_array_equal, network.stack_params(network.unstack_scanned_params(stacked)), stacked
  )
  np.testing.assert_array_equal(
    stacked["decoder"]["layers"]["mlp"]["wo"]["kernel"][1], params["decoder"]["layers_1"]["mlp"]["wo"]["kernel"]
  )
  axes = traverse_util.flatten_dict(
    jax.tree_util.tree_map(lambda a: a.names, v["params_axes"], is_leaf=lambda x: hasattr(x, "names")), sep="/"
  )
  assert axes["encoder/layers/attention/query/kernel_axes"] == ("layers", "embed", "joined_kv")
  assert axes["encoder/relpos_bias/rel_embedding_axes"] == ("heads", "relpos_buckets")
  shardings = partitioning.param_shardings(v["params_axes"], partitioning.make_mesh(1))
  assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(v["params"])


def test_stacking_refuses_layers_of_different_structure(t5):
  _, params = t5
  broken = jax.tree_util.tree_map(lambda x: x, params)
  del broken["encoder"]["layers_1"]["mlp"]
  with pytest.raises(ValueError, match="differ in structure"):
    network.stack_params(broken)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_scan_equals_unrolled_outputs_and_gradients(t5, unrolled, policy):
  module, params = t5
  batch, (logits, grads) = _batch(), unrolled
  scanned = network.Transformer(dataclasses.replace(SCAN_CFG, remat_policy=policy))
  (_, s_logits), s_grads = _value_grad(scanned)(network.stack_params(params), batch)
  np.testing.assert_allclose(s_logits, logits, atol=1e-6)
  s_grads = network.unstack_scanned_params(s_grads)
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, atol=1e-6), s_grads, grads)
  if policy == "none":
    return
  # Dropout: each scanned layer draws its own mask; gradients stay finite.
  (_, _), d_grads = jax.jit(
    jax.value_and_grad(
      functools.partial(
        _loss, network.Transformer(dataclasses.replace(SCAN_CFG, remat_policy=policy, dropout_rate=0.2))
      ),
      has_aux=True,
    )
  )(network.stack_params(params), batch, jax.random.key(3, impl=CHEAP_RNG))
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree_util.tree_leaves(d_grads))


def _adafactor_steps(module, params, tx, steps=3):
  """`steps` Adafactor updates on different batches; the final parameters."""
  grad = jax.jit(jax.grad(lambda p, b: _loss(module, p, b)[0]))
  update = jax.jit(tx.update)
  state = tx.init(params)
  for i in range(steps):
    updates, state = update(grad(params, _batch(seed=i)), state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("min_dim_size_to_factor", [8, 128])  # factored moments (16×24 kernels) or full ones
def test_scanned_stack_trains_like_the_unrolled_one_with_layerwise_adafactor(t5, min_dim_size_to_factor):
  module, params = t5
  tx = lambda: optim.adafactor(optim.constant_schedule(0.05), min_dim_size_to_factor=min_dim_size_to_factor)
  scanned, stacked = network.Transformer(SCAN_CFG), network.stack_params(params)
  reference = _adafactor_steps(module, params, tx())
  layerwise = network.unstack_scanned_params(_adafactor_steps(scanned, stacked, optim.layerwise(tx())))
  assert _max_rel_err(layerwise, reference) < 1e-5
  # Adafactor on the stacked arrays as they are mixes the layers' statistics (parameter scale, clipping).
  whole = network.unstack_scanned_params(_adafactor_steps(scanned, stacked, tx()))
  assert _max_rel_err(whole, reference) > 1e-3


def test_training_a_scanned_model_uses_layerwise_adafactor():
  from remixer_t5.training import programs

  tx = programs.make_tx(models.EncoderDecoderModel(network.Transformer(SCAN_CFG)), optim.adafactor, 1e-2)
  state = jax.eval_shape(tx.init, _abstract_init(network.Transformer(SCAN_CFG))["params"])
  assert set(state.inner_states) == {"layers", "rest"}
  counts = [x.shape for x in jax.tree_util.tree_leaves(state.inner_states["layers"]) if x.dtype == jnp.int32]
  assert counts and all(c == (2,) for c in counts)  # one step count per layer slice: vmapped over 'layers'
  plain = programs.make_tx(models.EncoderDecoderModel(network.Transformer(CFG)), optim.adafactor, 1e-2)
  assert not hasattr(jax.eval_shape(plain.init, _abstract_init(network.Transformer(CFG))["params"]), "inner_states")


def _step_decode(module, params, enc, dec_in, length):
  """Logits of decoding one position at a time with the cache."""
  encoded = jax.jit(lambda p, e: module.apply({"params": p}, e, enable_dropout=False, method=module.encode))(
    params, enc
  )
  ones = jnp.ones((enc.shape[0], length), jnp.int32)
  cache = jax.jit(
    lambda p, x: module.apply(
      {"params": p}, x, enc, ones, ones, enable_dropout=False, decode=True, mutable=["cache"], method=module.decode
    )[1]
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
      max_decode_length=length,
      mutable=["cache"],
      method=module.decode,
    )
  )
  cache, outs = cache["cache"], []
  for i in range(length):
    logits, variables = step(cache, dec_in[:, i : i + 1])
    cache, outs = variables["cache"], outs + [logits[:, 0]]
  return jnp.stack(outs, 1), cache


def _unpadded_targets(batch):
  """Targets without padding, so the full pass masks nothing a decode step sees."""
  tgt = np.where(batch["decoder_target_tokens"] > 0, batch["decoder_target_tokens"], 3)
  return dict(
    batch, decoder_target_tokens=tgt, decoder_input_tokens=np.concatenate([np.zeros_like(tgt[:, :1]), tgt[:, :-1]], 1)
  )


def _forward(module, params, batch):
  return jax.jit(functools.partial(_loss, module))(params, batch)[1]


def test_scanned_decoder_decodes_with_its_cache(t5):
  module, params = t5
  batch = _unpadded_targets(_batch(rows=2, dec_len=6))
  full = _forward(module, params, batch)
  scanned, s_params = network.Transformer(SCAN_CFG), network.stack_params(params)
  steps, cache = _step_decode(scanned, s_params, batch["encoder_input_tokens"], batch["decoder_input_tokens"], 6)
  np.testing.assert_allclose(steps, full, atol=1e-5)
  # Batch-major cache ([batch, layers, heads, head_dim, length]) with one shared position, as decoding's beam
  # gathering expects.
  kv = cache["decoder"]["layers"]["self_attention"]
  assert kv["cached_key"].shape == (2, 2, 2, 6, 8) and kv["cache_index"].shape == ()
  # Beam search reorders the cache rows (greedy decoding is the step loop above).
  beam = lambda m, p: jax.jit(
    functools.partial(models.EncoderDecoderModel(m).predict_batch, beam_size=2, return_scores=True)
  )(p, batch)
  ref, got = beam(module, params), beam(scanned, s_params)
  np.testing.assert_array_equal(got[0], ref[0])
  np.testing.assert_allclose(got[1], ref[1], atol=1e-5)


def test_scan_over_an_attention_free_stack():
  """Linear attention everywhere: no relative-position table, caches without a position counter."""
  arch = dict(
    encoder_token_mixer=linear_attention.LinearAttention,
    decoder_token_mixer=linear_attention.LinearAttention,
    decoder_cross_mixer=linear_attention.LinearAttention,
  )
  module = network.Transformer(CFG, **arch)
  params = _perturbed(_init(module)["params"])
  scanned = network.Transformer(dataclasses.replace(SCAN_CFG, remat_policy="full"), **arch)
  v = _abstract_init(scanned)
  assert "relpos_bias" not in v["params"]["encoder"] and "relpos_bias" not in v["params"]["decoder"]
  s_params = network.stack_params(params)
  assert _shapes(s_params) == _shapes(v["params"])
  batch = _unpadded_targets(_batch())
  full = _forward(module, params, batch)
  np.testing.assert_allclose(_forward(scanned, s_params, batch), full, atol=1e-6)
  dec_in = batch["decoder_input_tokens"]
  steps, _ = _step_decode(scanned, s_params, batch["encoder_input_tokens"], dec_in, dec_in.shape[1])
  np.testing.assert_allclose(steps, full, atol=1e-5)
