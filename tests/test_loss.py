"""The loss head's fast forms (models.target_logits, models.correct_predictions) against numpy and the one-hot
forms they replace: same values, same gradient, argmax's tie-breaking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.model import models


def _data(seed=0, shape=(3, 5), vocab=11):
  rng = np.random.default_rng(seed)
  return rng.normal(size=shape + (vocab,)).astype(np.float32), rng.integers(0, vocab, shape).astype(np.int32)


def test_target_logits_value_and_gradient_match_one_hot():
  logits, targets = _data()
  targets[0, 0], targets[0, 1] = 11, -1  # outside [0, V): one_hot gives a zero row, so 0
  got = models.target_logits(jnp.asarray(logits), jnp.asarray(targets))
  expected = np.where((targets >= 0) & (targets < 11),
                      np.take_along_axis(logits, np.clip(targets, 0, 10)[..., None], -1)[..., 0], 0.0)
  np.testing.assert_array_equal(np.asarray(got), expected)
  cot = np.random.default_rng(1).normal(size=targets.shape).astype(np.float32)
  grad = jax.grad(lambda l: jnp.sum(models.target_logits(l, jnp.asarray(targets)) * cot))(jnp.asarray(logits))
  one_hot_grad = jax.grad(lambda l: jnp.sum(jnp.sum(jax.nn.one_hot(targets, 11) * l, -1) * cot))(
      jnp.asarray(logits))
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(one_hot_grad))


def test_correct_predictions_is_argmax_with_first_index_ties():
  logits, targets = _data(2, (4, 6), 7)
  logits[0, 0, [2, 5]] = 9.0  # a tie for the maximum: argmax says 2
  targets[0, 0], targets[0, 1] = 5, int(logits[0, 1].argmax())
  logits[1, 0, [1, 3]] = 9.0
  targets[1, 0] = 1
  targets[2, 0] = 7  # out of range: never correct
  got = np.asarray(models.correct_predictions(jnp.asarray(logits), jnp.asarray(targets)))
  np.testing.assert_array_equal(got, logits.argmax(-1) == targets)
  assert not got[0, 0] and got[0, 1] and got[1, 0] and not got[2, 0]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_numpy(smoothing):
  logits, targets = _data(3, (2, 4), 9)
  weights = np.array([[1, 1, 1, 0], [1, 0, 1, 1]], np.float32)
  total, z, wsum = models.cross_entropy_with_z_loss(jnp.asarray(logits), jnp.asarray(targets),
                                                    jnp.asarray(weights), 1e-2, smoothing)
  lg = logits.astype(np.float64)
  log_z = np.log(np.exp(lg).sum(-1))
  soft = np.full(lg.shape, smoothing / 8) + np.eye(9)[targets] * (1 - smoothing - smoothing / 8)
  ce = log_z - (soft * lg).sum(-1)
  if smoothing:
    ce -= -((1 - smoothing) * np.log(1 - smoothing) + smoothing * np.log(smoothing / 8))
  np.testing.assert_allclose(float(total), ((ce + 1e-2 * log_z ** 2) * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(z), (1e-2 * log_z ** 2 * weights).sum(), rtol=1e-5)
  assert float(wsum) == weights.sum()
