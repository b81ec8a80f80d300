"""T5's schedules and Adafactor settings; nanoT5's AdamW with RMS scaling and its schedules."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from remixer_t5.training import optim


def test_rsqrt_schedule_is_0_01_for_10k_steps_then_inverse_sqrt():
  s = optim.rsqrt_schedule()
  np.testing.assert_allclose([float(s(t)) for t in (0, 1, 5000, 10_000)], 0.01, rtol=1e-6)
  np.testing.assert_allclose(float(s(40_000)), 1 / np.sqrt(40_000), rtol=1e-6)
  assert float(s(10_001)) < 0.01


def test_constant_schedule():
  s = optim.constant_schedule(1e-3)
  assert float(s(0)) == float(s(123_456)) == np.float32(1e-3)


def test_adafactor_factors_large_matrices_and_clips_gradients():
  params = {"big": jnp.ones((256, 128)), "small": jnp.ones((4,))}
  tx = optim.adafactor(optim.constant_schedule(1e-2))
  state = tx.init(params)
  shapes = sorted(x.shape for x in jax.tree_util.tree_leaves(state))
  assert (256,) in shapes and (128,) in shapes  # factored row/column statistics
  assert (256, 128) not in shapes  # no full second-moment matrix
  grads = {"big": jnp.full((256, 128), 100.0), "small": jnp.full((4,), 100.0)}
  clipped = optim.adafactor(optim.constant_schedule(1e-2), clip_gradient_norm=1.0)
  plain = optax.clip_by_global_norm(1.0)
  g, _ = plain.update(grads, plain.init(params))
  assert abs(float(optax.tree.norm(g)) - 1.0) < 1e-5
  u_clip, _ = clipped.update(grads, clipped.init(params), params)
  u_plain, _ = tx.update(g, state, params)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), u_clip, u_plain)


def test_rsqrt_cooldown_is_t5s_schedule_then_a_linear_decay_to_zero():
  plain, cool = optim.rsqrt_schedule(1.0, 300), optim.rsqrt_schedule(1.0, 300, cooldown_steps=1000, total_steps=4000)
  for t in (0, 299, 300, 1234, 3000):
    assert float(cool(t)) == float(plain(t))
  for t in (3001, 3500, 3999, 4000, 4100):
    np.testing.assert_allclose(float(cool(t)), float(plain(t)) * max(0.0, (4000 - t) / 1000), rtol=1e-6, atol=0)
  # the trainer's last update uses step 3,999: 1/1000 of the rate; none is taken at 4,000
  np.testing.assert_allclose(float(cool(3999)), float(plain(3999)) / 1000, rtol=1e-5)
  assert float(cool(4000)) == 0.0


def test_rsqrt_cooldown_refuses_without_the_run_length():
  import pytest

  with pytest.raises(ValueError, match="total_steps"):
    optim.rsqrt_schedule(1.0, 300, cooldown_steps=1000)
  with pytest.raises(ValueError, match="total_steps"):
    optim.rsqrt_schedule(1.0, 300, cooldown_steps=5000, total_steps=4000)
  for bad in (-1, 1):
    with pytest.raises(ValueError, match="cooldown_steps must be 0 or >= 2"):
      optim.rsqrt_schedule(1.0, 300, cooldown_steps=bad, total_steps=4000)


# --- nanoT5: AdamW with RMS scaling and its schedules (Nawrot 2023) --------------------------------------------------
# The references below are independent of optim.py: PyTorch's schedulers stepped as nanoT5 steps them (their
# recursive, chainable forms, with the closed form only where SequentialLR asks for it at the milestone), and a
# float64 numpy loop of AdamWScale.step with torch's clip_grad_norm_ before it.


def _torch_warmup_then(peak, warmup, total, final, decay, start_factor=0.5):
  """The rate of each scheduler epoch 0..total (nanoT5's update n uses epoch n - 1): SequentialLR of
  LinearLR(start_factor, 1, total_iters=warmup) then, from epoch `warmup`, CosineAnnealingLR(T_max=total -
  warmup, eta_min=final) ('cosine') or LinearLR(1, final / peak, total_iters=total - warmup) ('linear')."""
  span, lrs, lr = total - warmup, [], None
  for e in range(total + 1):
    if e == 0:
      lr = peak * start_factor  # LinearLR's initial step
    elif e < warmup:
      lr *= 1 + (1 - start_factor) / (warmup * start_factor + (e - 1) * (1 - start_factor))
    elif e == warmup:  # the milestone: SequentialLR steps the second scheduler to epoch 0 in its closed form
      lr = peak
    elif decay == "cosine":
      k = e - warmup
      lr = (1 + math.cos(math.pi * k / span)) / (1 + math.cos(math.pi * (k - 1) / span)) * (lr - final) + final
    else:
      k, end = e - warmup, final / peak
      lr *= 1 + (end - 1) / (span * 1 + (k - 1) * (end - 1))
    lrs.append(lr)
  return np.array(lrs)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_warmup_then_decay_schedules_give_nanot5s_rate_at_every_step(kind):
  make = optim.cosine_schedule if kind == "cosine" else optim.linear_schedule
  # nanoT5's configs/default.yaml: 2e-2, 10,000 warmup steps, 2^16 steps, 1e-5 at the end
  s = make()
  steps = np.arange(65_537)
  ref = _torch_warmup_then(2e-2, 10_000, 65_536, 1e-5, kind)
  np.testing.assert_allclose(np.asarray(s(steps)), ref, rtol=2e-5, atol=1e-11)
  middle = 10_000 + (65_536 - 10_000) // 2
  by_hand = {
    0: 1e-2,
    5_000: 1.5e-2,
    9_999: 1e-2 * (1 + 9_999 / 10_000),
    10_000: 2e-2,
    middle: (2e-2 + 1e-5) / 2,
    65_536: 1e-5,
  }
  for step, want in by_hand.items():
    np.testing.assert_allclose(float(s(step)), want, rtol=1e-5, err_msg=f"step {step}")
  # the trainer's last update (step 2^16 - 1) is one step of the decay above the final rate
  last = (
    1e-5 + (2e-2 - 1e-5) * (1 + math.cos(math.pi * 55_535 / 55_536)) / 2
    if kind == "cosine"
    else 1e-5 + (2e-2 - 1e-5) / 55_536
  )
  np.testing.assert_allclose(float(s(65_535)), last, rtol=1e-4)
  assert float(s(65_535)) > 1e-5 and float(s(70_000)) == pytest.approx(1e-5)
  # a short one with another start factor: every step
  short = make(1.0, 7, 30, 0.1, warmup_start_factor=0.25)
  np.testing.assert_allclose(
    np.asarray(short(np.arange(31))), _torch_warmup_then(1.0, 7, 30, 0.1, kind, 0.25), rtol=1e-5
  )


@pytest.mark.parametrize("make", [optim.cosine_schedule, optim.linear_schedule])
def test_schedules_refuse_bad_arguments_by_name(make):
  name = make.__name__
  for kwargs, argument in [
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(warmup_steps=10.5), "warmup_steps"),
    (dict(warmup_steps=100, total_steps=100), "total_steps"),
    (dict(warmup_steps=100, total_steps=50), "total_steps"),
    (dict(total_steps=-5, warmup_steps=0), "total_steps"),
    (dict(peak_learning_rate=0.0), "peak_learning_rate"),
    (dict(peak_learning_rate=1e-3, final_learning_rate=1e-2), "final_learning_rate"),
    (dict(final_learning_rate=-1e-5), "final_learning_rate"),
    (dict(warmup_start_factor=1.5), "warmup_start_factor"),
  ]:
    with pytest.raises(ValueError, match=rf"{name}: {argument} must be"):
      make(**kwargs)
  no_warmup = make(1.0, 0, 10, 0.0)  # no warmup: the decay starts at step 0
  assert float(no_warmup(0)) == pytest.approx(1.0) and float(no_warmup(10)) == pytest.approx(0.0, abs=1e-7)


def test_adamw_scaled_refuses_bad_arguments_by_name():
  for kwargs, argument in [
    (dict(b1=1.0), "b1"),
    (dict(b1=-0.1), "b1"),
    (dict(b2=1.5), "b2"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(clip_gradient_norm=-1.0), "clip_gradient_norm"),
    (dict(min_param_rms=-1.0), "min_param_rms"),
    (dict(learning_rate=-1e-3), "learning_rate"),
    (dict(no_decay="bias"), "no_decay"),
  ]:
    with pytest.raises(ValueError, match=rf"adamw_scaled: {argument} must be"):
      optim.adamw_scaled(**kwargs)


def _rms(x):
  return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _adamw_scale_reference(
  params, grads, lrs, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0, clip=None, decays=lambda name: True, floor=1e-3
):
  """nanoT5's AdamWScale.step in float64 numpy over {name: array}, after torch's clip_grad_norm_ when `clip`."""
  p = {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    g = {k: np.asarray(x, np.float64) for k, x in g.items()}
    if clip:
      norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
      g = {k: x * min(1.0, clip / (norm + 1e-6)) for k, x in g.items()}
    for k in p:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]
      denom = np.sqrt(v[k]) + eps
      step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
      step_size *= max(floor, float(np.linalg.norm(p[k].ravel())) / math.sqrt(p[k].size))
      p[k] = p[k] - step_size * m[k] / denom
      if weight_decay > 0 and decays(k):
        p[k] = p[k] + p[k] * (-lr * weight_decay)
  return p


def _flat(tree):
  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _run(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _problem(seed=0, steps=6):
  """Parameters at several scales (one under the 1e-3 RMS floor), a norm scale and a bias (no weight decay), and
  gradients of which one parameter's are tiny (where the placement of eps shows)."""
  rng = np.random.default_rng(seed)
  params = {
    "dense": {"kernel": rng.normal(0, 0.5, (8, 6))},
    "big": {"kernel": rng.normal(0, 3.0, (4, 5))},
    "small": {"kernel": rng.normal(0, 1e-5, (3, 4))},
    "pre_mlp_layer_norm": {"scale": 1 + rng.normal(0, 0.1, 6)},
    "out": {"bias": rng.normal(0, 0.2, 5)},
  }
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  grads = []
  for _ in range(steps):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 1.0, x.shape), jnp.float32), params)
    g["big"]["kernel"] = g["big"]["kernel"] * 1e-6
    grads.append(g)
  return params, grads


@pytest.mark.parametrize("weight_decay, clip", [(0.0, None), (0.1, 1.0), (0.3, 0.5)])
def test_adamw_scaled_is_nanot5s_adamwscale(weight_decay, clip):
  params, grads = _problem()
  schedule = optim.cosine_schedule(0.05, 2, 6, 1e-3)
  lrs = _torch_warmup_then(0.05, 2, 6, 1e-3, "cosine")[: len(grads)]
  got = _flat(_run(optim.adamw_scaled(schedule, weight_decay=weight_decay, clip_gradient_norm=clip), params, grads))
  flat_params = _flat(params)
  want = _adamw_scale_reference(
    flat_params,
    [_flat(g) for g in grads],
    lrs,
    weight_decay=weight_decay,
    clip=clip,
    decays=lambda k: "bias" not in k and "norm" not in k,
  )
  for k in want:
    moved = np.asarray(got[k], np.float64) - np.asarray(flat_params[k], np.float64)
    want_moved = want[k] - flat_params[k]
    # float32 parameters: a difference of two of them is exact to a few of their ulps
    ulps = 4 * np.finfo(np.float32).eps * float(np.max(np.abs(flat_params[k])))
    np.testing.assert_allclose(moved, want_moved, rtol=2e-4, atol=ulps, err_msg=k)


def test_adamw_scaled_scales_each_parameters_step_by_its_rms():
  """One step, constant rate 1, no clipping: identical gradients give steps in the ratio of the parameters' RMS,
  and a parameter under the floor steps as if its RMS were 1e-3."""
  g = jnp.asarray(np.random.default_rng(1).normal(size=(4, 5)), jnp.float32)
  params = {"a": jnp.full((4, 5), 0.2), "b": jnp.full((4, 5), -3.0), "tiny": jnp.full((4, 5), 1e-6)}
  tx = optim.adamw_scaled(1.0, clip_gradient_norm=None)
  updates, _ = tx.update({k: g for k in params}, tx.init(params), params)
  # t = 1: m = 0.1 g, sqrt(v) = sqrt(0.001) |g|, step = sqrt(0.001) / 0.1
  adam = np.sqrt(0.001) / 0.1 * (0.1 * np.asarray(g)) / (np.sqrt(0.001) * np.abs(np.asarray(g)) + 1e-6)
  for k, rms in (("a", 0.2), ("b", 3.0), ("tiny", 1e-3)):
    np.testing.assert_allclose(np.asarray(updates[k]), -rms * adam, rtol=1e-5, err_msg=k)
  # optax.scale_by_adam puts eps inside the bias correction: not nanoT5's rule, and the tiny gradients show it
  params, grads = _problem()
  ours = _run(optim.adamw_scaled(1e-2, clip_gradient_norm=None), params, grads)
  optax_adam = optax.chain(
    optax.scale_by_adam(eps=1e-6), optax.scale_by_param_block_rms(1e-3), optax.scale_by_learning_rate(1e-2)
  )
  theirs = _run(optax_adam, params, grads)
  moved = lambda p: np.asarray(p["big"]["kernel"]) - np.asarray(params["big"]["kernel"])
  assert not np.allclose(moved(ours), moved(theirs), rtol=1e-2)


def test_adamw_scaled_weight_decay_scales_the_stepped_parameter_and_spares_norms_and_biases():
  params = {
    "dense": {"kernel": jnp.full((3, 4), 2.0)},
    "layer_norm": {"scale": jnp.ones(4)},
    "dense_b": {"bias": jnp.full((4,), 0.5)},
  }
  grads = jax.tree.map(jnp.ones_like, params)
  lr, wd = 0.5, 0.2
  plain = optim.adamw_scaled(lr, clip_gradient_norm=None)
  decayed = optim.adamw_scaled(lr, weight_decay=wd, clip_gradient_norm=None)
  step_plain = optax.apply_updates(params, plain.update(grads, plain.init(params), params)[0])
  step_decayed = optax.apply_updates(params, decayed.update(grads, decayed.init(params), params)[0])
  # p <- (p + u) (1 - lr wd): the parameter after its Adam step is decayed, not the one before it
  np.testing.assert_allclose(step_decayed["dense"]["kernel"], step_plain["dense"]["kernel"] * (1 - lr * wd), rtol=1e-6)
  for name in ("layer_norm", "dense_b"):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), step_decayed[name], step_plain[name])


def test_layerwise_adamw_scaled_steps_each_layer_slice_as_its_own_parameter():
  """A scanned stack's [layers, ...] parameter under `layerwise` moves each slice as the unrolled model's layer
  moves, RMS per slice and gradients clipped over the whole model."""
  rng = np.random.default_rng(2)
  scales = (0.1, 2.0, 1e-5)  # the last layer under the RMS floor
  stacked = {
    "encoder": {
      "layers": {"mlp": {"kernel": np.stack([rng.normal(0, s, (4, 5)) for s in scales])}},
      "encoder_norm": {"scale": np.ones(5)},
    },
    "token_embedder": {"embedding": rng.normal(0, 1, (7, 5))},
  }
  stacked = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), stacked)
  grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 3.0, x.shape), jnp.float32), stacked) for _ in range(4)]

  def unroll(tree):
    enc = dict(tree["encoder"])
    layers = enc.pop("layers")
    enc.update({f"layers_{i}": jax.tree.map(lambda x: x[i], layers) for i in range(len(scales))})
    return {"encoder": enc, "token_embedder": tree["token_embedder"]}

  make = lambda: optim.adamw_scaled(optim.cosine_schedule(0.05, 1, 4, 1e-3), weight_decay=0.1, clip_gradient_norm=1.0)
  scanned = _run(optim.layerwise(make()), stacked, grads)
  unrolled = _run(make(), unroll(stacked), [unroll(g) for g in grads])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9), unroll(scanned), unrolled)
  # without `layerwise` the stack's RMS would mix the layers
  mixed = _run(make(), stacked, grads)
  assert not np.allclose(
    unroll(mixed)["encoder"]["layers_0"]["mlp"]["kernel"], unrolled["encoder"]["layers_0"]["mlp"]["kernel"], rtol=1e-3
  )


@pytest.mark.parametrize("scan", [False, True])
def test_adamw_scaled_moments_shard_like_their_parameters(scan):
  """partitioning.opt_state_shardings: Adam's m and v take their parameter's sharding (per layer slice of a
  scanned stack too), the counts are replicated."""
  from jax.sharding import PartitionSpec as P
  from remixer_t5.model import models, network
  from remixer_t5.training import partitioning

  model = models.EncoderDecoderModel(
    network.Transformer(
      network.T5Config(
        vocab_size=64,
        emb_dim=16,
        num_heads=4,
        head_dim=8,
        mlp_dim=32,
        num_encoder_layers=2,
        num_decoder_layers=2,
        scan_layers=scan,
      )
    )
  )
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 4), "decoder_target_tokens": (1, 4)}
  v = jax.eval_shape(lambda: model.init_variables(jax.random.PRNGKey(0), shapes))
  part = partitioning.partitioner((2, 4), rules="fsdp", abstract=True)
  sh = part.param_shardings(v["params_axes"], params=v["params"])
  tx = optim.for_model(optim.adamw_scaled(optim.cosine_schedule(1e-2, 2, 10, 0.0), weight_decay=0.1), model.module)
  state = jax.eval_shape(tx.init, v["params"])
  opt = part.opt_state_shardings(state, v["params"], sh)
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  adams = [x for x in jax.tree_util.tree_leaves(opt, is_leaf=is_adam) if is_adam(x)]
  assert len(adams) == (2 if scan else 1)  # layerwise: one for the stacks, one for the rest
  for adam in adams:
    assert adam.count.spec == P()
    for moment in (adam.mu, adam.nu):
      both = jax.tree_util.tree_leaves(
        jax.tree.map(lambda m, s: (m, s), moment, sh, is_leaf=lambda x: isinstance(x, optax.MaskedNode)),
        is_leaf=lambda x: isinstance(x, tuple),
      )
      placed = [(m, s) for m, s in both if not isinstance(m, optax.MaskedNode)]
      assert placed and all(m.spec == s.spec for m, s in placed)
  wi = ("encoder", "layers" if scan else "layers_0", "mlp", "wi_0", "kernel")
  assert functools.reduce(lambda t, k: t[k], wi, sh).spec != P()  # fsdp does split it


def test_pretrain_nanot5_gin_trains_a_tiny_model(tmp_path, monkeypatch, embedded_cache):
  """runs/pretrain_nanot5.gin on the embedded corpus (a tiny model, short sequences, 40 steps): the loss falls and
  the logged rate is the cosine schedule's."""
  import json
  from remixer_t5 import cli

  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  steps, warmup, log = 40, 4, 5
  code = cli.main(
    [
      "train",
      "--gin_file=models/t5_1_1/tiny.gin",
      "--gin_file=runs/pretrain_nanot5.gin",
      "--gin.MIXTURE_OR_TASK_NAME='embedded_span_corruption'",
      "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
      "--gin.BATCH_SIZE=8",
      f"--gin.TRAIN_STEPS={steps}",
      f"--gin.LOG_PERIOD={log}",
      "--gin.EVAL_PERIOD=0",
      f"--gin.CHECKPOINT_PERIOD={steps}",
      "--gin.EVAL_STEPS=1",
      f"--gin.optim.cosine_schedule.warmup_steps={warmup}",
      "--gin.network.T5Config.emb_dim=32",
      "--gin.network.T5Config.mlp_dim=48",
      f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
    ]
  )
  assert code == 0
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if r["split"] == "train"]
  assert [r["step"] for r in train] == list(range(log, steps + 1, log))
  assert all(np.isfinite(r["loss"]) for r in train)
  assert train[-1]["loss"] < 0.8 * train[0]["loss"], [r["loss"] for r in train]
  lrs = _torch_warmup_then(2e-2, warmup, steps, 1e-5, "cosine")
  for r in train:  # each row: the mean rate of its window's updates
    np.testing.assert_allclose(r["learning_rate"], lrs[r["step"] - log : r["step"]].mean(), rtol=1e-4)


def test_adafactor_clips_a_scanned_stack_by_the_whole_models_norm():
  """`layerwise(adafactor(clip_gradient_norm=c))`: the gradients are clipped by their global norm over every
  layer slice and the other parameters together (as the unrolled model is), not each slice by its own. Two
  steps, a clipped one then an unclipped one: Adafactor's first step is scale-free, its second is not."""
  rng = np.random.default_rng(0)
  stacked = {"layers": jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32), "out": jnp.ones((5,), jnp.float32)}
  scales = np.array([1.0, 10.0, 0.1])[:, None, None]  # per layer: the slices' own norms differ
  grads = [
    {
      "layers": jnp.asarray(rng.normal(size=(3, 4, 5)) * s * scales, jnp.float32),
      "out": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
    }
    for s in (1.0, 0.01)
  ]
  unroll = lambda t: {**{f"l{i}": t["layers"][i] for i in range(3)}, "out": t["out"]}
  make = lambda: optim.adafactor(optim.constant_schedule(1e-2), clip_gradient_norm=1.0)
  got = _run(optim.layerwise(make(), stacked=lambda path: getattr(path[0], "key", None) == "layers"), stacked, grads)
  want = _run(make(), unroll(stacked), [unroll(g) for g in grads])
  for i in range(3):
    np.testing.assert_allclose(got["layers"][i], want[f"l{i}"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-7)
