"""The loss head (models.cross_entropy_with_z_loss) against numpy's cross-entropy of (smoothed) one-hot targets."""
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.model import models


def _data(seed=0, shape=(3, 5), vocab=11):
  rng = np.random.default_rng(seed)
  return rng.normal(size=shape + (vocab,)).astype(np.float32), rng.integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_numpy(smoothing):
  logits, targets = _data(3, (2, 4), 9)
  targets[1, 3] = 9  # outside [0, V): a zero one-hot row, so its cross-entropy is log Z (smoothing: the low rest)
  weights = np.array([[1, 1, 1, 0], [1, 0, 1, 1]], np.float32)
  total, z, wsum = models.cross_entropy_with_z_loss(jnp.asarray(logits), jnp.asarray(targets),
                                                    jnp.asarray(weights), 1e-2, smoothing)
  lg = logits.astype(np.float64)
  log_z = np.log(np.exp(lg).sum(-1))
  soft = np.full(lg.shape, smoothing / 8) + np.eye(10)[targets][..., :9] * (1 - smoothing - smoothing / 8)
  ce = log_z - (soft * lg).sum(-1)
  if smoothing:
    ce -= -((1 - smoothing) * np.log(1 - smoothing) + smoothing * np.log(smoothing / 8))
  np.testing.assert_allclose(float(total), ((ce + 1e-2 * log_z ** 2) * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(z), (1e-2 * log_z ** 2 * weights).sum(), rtol=1e-5)
  assert float(wsum) == weights.sum()
