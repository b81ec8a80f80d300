"""MFU: peak table lookups, XLA's FLOP count of a compiled step, and the arithmetic."""
import types

import jax
import jax.numpy as jnp
import pytest

from remixer_t5 import mfu


@pytest.mark.parametrize("kind,peak", [("TPU v3", 61.5e12), ("TPU v4", 275e12), ("TPU v5 lite", 197e12),
                                       ("TPU v5p", 459e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12)])
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
  from remixer_t5 import models, network
  cfg = network.T5Config(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_encoder_layers=2,
                         num_decoder_layers=2, mlp_dim=64)
  return models.EncoderDecoderModel(network.Transformer(dataclasses.replace(cfg, **overrides)))


def test_model_flops_are_the_same_whether_the_stack_is_scanned_or_rematerialised():
  from remixer_t5 import optim, partitioning, trainer
  batch = trainer.batch_shapes({"inputs": 16, "targets": 8}, 4, pack=True)
  plain = mfu.model_flops_per_step(_tiny(), batch)
  for overrides in ({"scan_layers": True}, {"remat_policy": "full"}, {"remat_policy": "dots"},
                    {"scan_layers": True, "remat_policy": "full"}):
    assert mfu.model_flops_per_step(_tiny(**overrides), batch) == pytest.approx(plain, rel=0.01), overrides

  # What the compiled steps count instead: a scanned stack's body once, rematerialised layers twice.
  def compiled(model):
    mesh = partitioning.make_mesh(1, devices=jax.devices()[:1])
    prog = trainer.program(model, trainer._optimizer(model, optim.adafactor, 1e-2), None,
                           {"inputs": 16, "targets": 8}, mesh)
    b = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=prog.batch_sharding) for k, v in batch.items()}
    return mfu.compiled_flops(prog.compile(prog.train_step, prog.state, b))
  unrolled = compiled(_tiny())
  # The model count is the unscanned step's fwd+bwd: XLA's count of that compiled step adds only the optimizer.
  assert 1.0 < unrolled / plain < 1.15
  assert compiled(_tiny(remat_policy="full")) > 1.1 * unrolled
  assert compiled(_tiny(scan_layers=True)) < 0.9 * unrolled


def test_model_flops_match_a_hand_count_of_the_matmuls():
  # Independent check: a T5 step's FLOPs are its matmuls' multiply-adds (MACs) x 2 (forward) x 3 (forward +
  # backward), plus a little elementwise work (norms, softmax, loss). Hand count for the tiny config, per example:
  from remixer_t5 import trainer
  d, hd, f, v, L, T, n, layers = 32, 2 * 16, 64, 64, 16, 8, 4, 2
  enc_layer = 4 * d * hd * L + 3 * d * f * L + 2 * L * L * hd  # q,k,v,o; gated MLP (wi_0, wi_1, wo); QK^T, AV
  dec_layer = (4 * d * hd * T + 2 * T * T * hd  # self-attention
               + 2 * d * hd * T + 2 * d * hd * L + 2 * T * L * hd  # cross: q,o on targets, k,v on inputs
               + 3 * d * f * T)
  macs = layers * (enc_layer + dec_layer) + d * v * T  # + the (untied) logits layer
  expected = 6 * macs * n
  got = mfu.model_flops_per_step(_tiny(), trainer.batch_shapes({"inputs": L, "targets": T}, n, pack=False))
  assert expected < got < 1.08 * expected
