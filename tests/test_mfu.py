"""MFU: peak table lookups, XLA's FLOP count of a compiled step, and the arithmetic."""

import types

import jax
import jax.numpy as jnp
import pytest

from remixer_t5.training import mfu


@pytest.mark.parametrize(
  "kind,peak",
  [
    ("TPU v3", 61.5e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5p", 459e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H200", 989e12),
  ],
)
def test_peak_flops_by_device_kind(kind, peak):
  assert mfu.peak_flops_per_device(types.SimpleNamespace(device_kind=kind)) == pytest.approx(peak)


def test_unknown_devices_have_no_peak_unless_overridden():
  cpu = types.SimpleNamespace(device_kind="cpu")
  assert mfu.peak_flops_per_device(cpu) is None
  assert mfu.peak_flops_per_device(cpu, override=5e11) == 5e11
  assert mfu.mfu(1e9, 10.0, None) is None and mfu.mfu(None, 10.0, 1e12) is None


def test_compiled_flops_count_a_matmul_and_mfu_divides_by_the_peak():
  m, n, k = 64, 32, 128
  compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
  flops = mfu.compiled_flops(compiled)
  assert flops == pytest.approx(2 * m * n * k, rel=0.05)
  assert mfu.mfu(flops, 100.0, 1e9) == pytest.approx(flops * 100.0 / 1e9)


def _tiny(**overrides):
  import dataclasses
  from remixer_t5.model import models, network

  cfg = network.T5Config(
    vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=64
  )
  return models.EncoderDecoderModel(network.Transformer(dataclasses.replace(cfg, **overrides)))


def test_model_flops_are_counted_on_the_host_when_the_backend_counts_none(monkeypatch):
  """On an H200 (jax 0.11.2, scripts/gpu_measure.py) a lowered step's cost analysis had no FLOPs, and `train`
  stopped at its start computing MFU: the count falls back to the same math lowered for the host."""
  from remixer_t5.training import programs

  batch = programs.batch_shapes({"inputs": 16, "targets": 8}, 4, pack=False)
  expected = mfu.model_flops_per_step(_tiny(), batch)
  real, calls = jax.stages.Lowered.cost_analysis, []

  def gpu_like(self):  # counts only where the host is the default device, as the H200's backend did
    calls.append(jax.config.jax_default_device)
    return real(self) if calls[-1] is not None else None

  monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", gpu_like)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert mfu.model_flops_per_step(_tiny(), batch) == pytest.approx(expected)
  assert len(calls) == 2 and calls[0] is None and calls[1].platform == "cpu"


@pytest.mark.integration
def test_model_flops_are_the_same_whether_the_stack_is_scanned_or_rematerialised():
  from remixer_t5.training import optim, partitioning, programs

  batch = programs.batch_shapes({"inputs": 16, "targets": 8}, 4, pack=True)
  plain = mfu.model_flops_per_step(_tiny(), batch)
  for overrides in (
    {"scan_layers": True},
    {"remat_policy": "full"},
    {"remat_policy": "dots"},
    {"scan_layers": True, "remat_policy": "full"},
  ):
    assert mfu.model_flops_per_step(_tiny(**overrides), batch) == pytest.approx(plain, rel=0.01), overrides

  # What the compiled steps count instead: a scanned stack's body once, rematerialised layers twice.
  def compiled(model):
    part = partitioning.partitioner(None, jax.devices()[:1])
    prog = programs.build(model, programs.make_tx(model, optim.adafactor, 1e-2), {"inputs": 16, "targets": 8}, part)
    return mfu.compiled_flops(prog.compile(prog.train_step, prog.state, prog.batch(4, pack=True)))

  unrolled = compiled(_tiny())
  # The model count is the unscanned step's fwd+bwd: XLA's count of that compiled step adds only the optimizer.
  assert 1.0 < unrolled / plain < 1.15
  assert compiled(_tiny(remat_policy="full")) > 1.1 * unrolled
  assert compiled(_tiny(scan_layers=True)) < 0.9 * unrolled


def _hand_count(d, hd, f, v, L, T, n, encoder_layers, decoder_layers, remix_width=0):
  """A T5 step's FLOPs by hand: its matmuls' multiply-adds (MACs) x 2 (forward) x 3 (forward + backward), for
  n examples of L inputs and T targets; `remix_width` adds a Remixer block's X_S = softmax(H) X' (§2.1.1) of that
  width to every layer: L x L (decoder T x T) x width MACs per example."""
  enc_layer = (
    4 * d * hd * L
    + 3 * d * f * L
    + 2 * L * L * hd  # q,k,v,o; gated MLP (wi_0, wi_1, wo); QK^T, AV
    + remix_width * L * L
  )
  dec_layer = (
    4 * d * hd * T
    + 2 * T * T * hd  # self-attention
    + 2 * d * hd * T
    + 2 * d * hd * L
    + 2 * T * L * hd  # cross: q,o on targets, k,v on inputs
    + 3 * d * f * T
    + remix_width * T * T
  )
  macs = encoder_layers * enc_layer + decoder_layers * dec_layer + d * v * T  # + the (untied) logits layer
  return 6 * macs * n


def test_model_flops_match_a_hand_count_of_the_matmuls():
  # Independent check: the count is the hand count plus a little elementwise work (norms, softmax, loss).
  from remixer_t5.training import programs

  L, T, n = 16, 8, 4
  expected = _hand_count(32, 2 * 16, 64, 64, L, T, n, 2, 2)
  got = mfu.model_flops_per_step(_tiny(), programs.batch_shapes({"inputs": L, "targets": T}, n, pack=False))
  assert expected < got < 1.08 * expected


@pytest.mark.parametrize(
  "config,encoder_layers,decoder_layers,remix",
  [
    ("models/t5_1_1/base.gin", 12, 12, False),
    ("models/remixer/base.gin", 12, 12, True),
    ("models/remixer/sbase.gin", 18, 3, True),
    ("models/t5_1_1/sbase_layout.gin", 18, 3, False),
  ],
)
def test_base_model_flops_match_a_hand_count(config, encoder_layers, decoder_layers, remix):
  # The shipped base configs at the pretraining shapes (batch 128, 512/114), hand-counted as above; the Remixer
  # block (§2.1, width d_ff) is T5.1.1's gated MLP plus the remix. These counts put Remixer_SBase (18 + 3
  # layers, §2) at 1.27x T5.1.1-base's model FLOPs per step, the floor under its step-time ratio, and T5.1.1's
  # blocks at those depths at 1.13x (docs/architectures.md, "Remixer speed").
  from remixer_t5.model import models
  from remixer_t5.training import programs

  L, T, n, f = 512, 114, 128, 2048
  expected = _hand_count(768, 12 * 64, f, 32128, L, T, n, encoder_layers, decoder_layers, f if remix else 0)
  model = models.EncoderDecoderModel(models.from_gin(config))
  got = mfu.model_flops_per_step(model, programs.batch_shapes({"inputs": L, "targets": T}, n, pack=True))
  assert expected < got < 1.02 * expected


def _dot_flops(jaxpr) -> float:
  """An independent count: 2 x the multiply-adds of every dot_general in a jaxpr, a scan's body times its
  length, walking into every sub-jaxpr (pjit, custom derivatives, checkpoints)."""
  import math

  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lhs_contract)
    times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          total += times * _dot_flops(sub)
  return total


def _looping(mixer):
  from remixer_t5.model import models, network

  cfg = network.T5Config(
    vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_encoder_layers=1, num_decoder_layers=2, mlp_dim=64
  )
  return models.EncoderDecoderModel(
    network.Transformer(cfg, encoder_token_mixer=mixer, decoder_token_mixer=mixer, decoder_cross_mixer=mixer)
  )


def test_mixers_that_loop_are_counted_every_chunk():
  # Causal linear attention scans its decoder in chunks (4 positions, 32 targets: 8 chunks). XLA's cost analysis
  # counts a loop's body once, so the count unrolls the chunks; checked against a walk of the jaxpr's matmuls.
  import functools
  from remixer_t5.training import programs
  from remixer_t5.model.mixers.linear_attention import LinearAttention

  model = _looping(functools.partial(LinearAttention, chunk_size=4))
  batch = programs.batch_shapes({"inputs": 16, "targets": 32}, 2, pack=False)
  flops, loops = mfu.model_flops_and_loops(model, batch)
  assert loops == 0
  params = jax.eval_shape(
    lambda r: model.init_variables(r, {k: (1,) + v.shape[1:] for k, v in batch.items()}), jax.random.PRNGKey(0)
  )["params"]
  grad = jax.grad(lambda p, b: model.loss_fn(p, b, None)[0])
  matmuls = _dot_flops(jax.make_jaxpr(grad)(params, batch).jaxpr)
  assert matmuls < flops < 1.25 * matmuls  # + elementwise work (feature maps, norms, softmax of the loss)
  once = jax.jit(grad).lower(params, batch).cost_analysis()["flops"]  # what a loop's body counted once gives
  assert once < 0.97 * flops


def test_hypermixer_is_counted_unpacked_and_without_its_loops():
  # Packed HyperMixing scans segment ids a block at a time (implementation work, not the model's math) and its
  # causal form scans chunks: the count is the unpacked step's, with no loop left.
  import functools
  from remixer_t5.training import programs
  from remixer_t5.model.mixers.hypermixer import HyperMixing

  model = _looping(functools.partial(HyperMixing, chunk_size=4))
  lengths = {"inputs": 16, "targets": 32}
  packed, loops = mfu.model_flops_and_loops(model, programs.batch_shapes(lengths, 2, pack=True))
  assert loops == 0
  assert packed == mfu.model_flops_per_step(model, programs.batch_shapes(lengths, 2, pack=False))
