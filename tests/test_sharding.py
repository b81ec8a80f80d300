"""The train step on a (data, model) mesh of 8 CPU devices: params really sharded, same losses as 1 device."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from remixer_t5.model import models, network
    from remixer_t5.training import optim, partitioning, programs
    from remixer_t5.training import batches as batch_io

    cfg = network.T5Config(vocab_size=64, emb_dim=16, num_heads=4, head_dim=8, mlp_dim=32,
                           num_encoder_layers=1, num_decoder_layers=1)
    model = models.EncoderDecoderModel(network.Transformer(cfg))
    tx = optim.adafactor(optim.constant_schedule(1e-2))
    rng = np.random.RandomState(0)
    batches = []
    for _ in range(3):
      tgt = rng.randint(1, 64, (8, 6)).astype(np.int32)
      batches.append({"encoder_input_tokens": rng.randint(1, 64, (8, 12)).astype(np.int32),
                      "decoder_input_tokens": np.concatenate([np.zeros((8, 1), np.int32), tgt[:, :-1]], 1),
                      "decoder_target_tokens": tgt})

    def run(part):
      prog = programs.build(model, tx, {"inputs": 12, "targets": 6}, part)
      state, bsh, step = prog.init_state(0), prog.batch_sharding, prog.train_step
      losses = []
      for b in batches:
        state, m = step(state, batch_io.global_batch(b, bsh))
        losses.append(float(m["loss_sum"] / m["weight_sum"]))
      return state, losses

    _, ref = run(partitioning.partitioner(None, jax.devices()[:1]))
    for shape in [(8, 1), (4, 2), (2, 4)]:
      state, losses = run(partitioning.partitioner(shape))
      np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-5)
      wi = state.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
      assert wi.sharding.spec == jax.sharding.PartitionSpec(None, 'model'), wi.sharding.spec
      assert wi.addressable_shards[0].data.shape == (16, 32 // shape[1]), wi.addressable_shards[0].data.shape
      emb = state.params["token_embedder"]["embedding"]
      assert emb.addressable_shards[0].data.shape == (64 // shape[1], 16)
    print("OK", ref)
""")


@pytest.mark.integration
def test_train_step_on_8_device_meshes_matches_one_device():
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  assert "OK" in out.stdout
