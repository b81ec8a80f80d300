"""T5's schedules and Adafactor settings."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

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
