"""The loss head (models.cross_entropy_with_z_loss) against numpy's cross-entropy of (smoothed) one-hot targets,
its gradient and its count of correct tokens."""

import jax
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
  total, z, wsum, correct = models.cross_entropy_with_z_loss(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), 1e-2, smoothing
  )
  lg = logits.astype(np.float64)
  log_z = np.log(np.exp(lg).sum(-1))
  soft = np.full(lg.shape, smoothing / 8) + np.eye(10)[targets][..., :9] * (1 - smoothing - smoothing / 8)
  ce = log_z - (soft * lg).sum(-1)
  if smoothing:
    ce -= -((1 - smoothing) * np.log(1 - smoothing) + smoothing * np.log(smoothing / 8))
  np.testing.assert_allclose(float(total), ((ce + 1e-2 * log_z**2) * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(z), (1e-2 * log_z**2 * weights).sum(), rtol=1e-5)
  assert float(wsum) == weights.sum()
  assert float(correct) == ((lg.argmax(-1) == targets) * weights).sum()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_gradient_is_the_equations(smoothing):
  """d/dlogits of the summed loss: w (softmax (1 + 2 z log Z) - soft target), from numpy (float64)."""
  logits, targets = _data(4, (3, 5), 13)
  targets[2, 1] = 13  # outside [0, V): no target row
  weights = np.random.default_rng(5).random((3, 5)).astype(np.float32)
  grad = jax.grad(
    lambda x: models.cross_entropy_with_z_loss(x, jnp.asarray(targets), jnp.asarray(weights), 1e-2, smoothing)[0]
  )(jnp.asarray(logits))
  lg = logits.astype(np.float64)
  log_z = np.log(np.exp(lg).sum(-1))
  softmax = np.exp(lg - log_z[..., None])
  soft = np.full(lg.shape, smoothing / 12) + np.eye(14)[targets][..., :13] * (1 - smoothing - smoothing / 12)
  want = weights[..., None] * (softmax * (1 + 2e-2 * log_z)[..., None] - soft)
  np.testing.assert_allclose(grad, want, rtol=0, atol=1e-6)


def test_ties_count_as_correct_and_invalid_targets_never():
  """The one-pass count: a target whose logit equals the row's largest is correct (argmax would say so only
  for the first of the tied); an id outside [0, V) is never correct."""
  logits = jnp.asarray([[[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]]])
  targets = jnp.asarray([[2, 0, 4]])
  correct = models.cross_entropy_with_z_loss(logits, targets, jnp.ones((1, 3)))[3]
  assert float(correct) == 2.0


def test_without_smoothing_the_loss_and_its_gradient_reduce_the_logits_three_times():
  """The loss, z-loss and correct count with their gradient reduce each row of logits three times (its max, its
  sum of exp and the target's masked sum, which reads the logits beside the max) and take no argmax; the gradient
  adds no reduction of its own. The smoothed form adds an argmax."""
  from jax._src.interpreters import partial_eval as pe
  from jaxpr_util import eqns_in

  logits, targets, weights = jnp.zeros((4, 7, 50)), jnp.ones((4, 7), jnp.int32), jnp.ones((4, 7))

  def reductions(smoothing):
    loss = lambda x: (lambda out: (out[0], out[1:]))(
      models.cross_entropy_with_z_loss(x, targets, weights, 1e-4, smoothing)
    )
    closed = jax.make_jaxpr(jax.value_and_grad(loss, has_aux=True))(logits)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))  # what the outputs need
    return [
      e.primitive.name
      for e in eqns_in(jaxpr)
      if e.primitive.name.startswith(("reduce", "argm"))
      and any(getattr(v, "aval", None) is not None and v.aval.shape == logits.shape for v in e.invars)
    ]

  assert reductions(0.0) == ["reduce_max", "reduce_sum", "reduce_sum"]
  assert reductions(0.1) == ["reduce_max", "reduce_sum", "reduce_sum", "argmax"]
