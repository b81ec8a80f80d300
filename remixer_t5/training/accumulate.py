"""Gradient accumulation over microbatches: one optimizer step's gradient from k smaller forward/backward passes.

`models.EncoderDecoderModel.loss_fn` returns `loss_sum / norm` (norm: the number of real target tokens, or a
fixed `loss_normalizing_factor`) and additive `*_sum` metrics. Microbatches hold different numbers of tokens,
so averaging k normalised microbatch gradients would weight tokens unequally; instead the gradients of the
unnormalised `loss_sum` are summed and divided once by the whole batch's norm, which is exactly the full-batch
gradient (t5x accumulates the same way: sums first, normalisation once).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

Array = jax.Array
LossFn = Callable[[Any, Mapping[str, Array], Array | None], tuple[Array, dict[str, Array]]]


def split_microbatches(batch: Mapping[str, Array], num_microbatches: int) -> dict[str, Array]:
  """[batch, ...] leaves as [k, batch / k, ...]; microbatch i holds rows i, i + k, i + 2k, ...

  Strided rather than contiguous: with the batch axis split over the 'data' mesh axis, every device keeps
  batch / (k * devices) rows of each microbatch, so no microbatch waits on a subset of the devices and the
  reshape moves no data (when k divides the per-device rows)."""
  sizes = {k: v.shape[0] for k, v in batch.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"batch features disagree on the batch size: {sizes}")
  size = next(iter(sizes.values()))
  if num_microbatches < 1 or size % num_microbatches:
    raise ValueError(f"num_microbatches={num_microbatches} must be a positive divisor of the batch size {size}")
  return {
    k: jnp.swapaxes(v.reshape((size // num_microbatches, num_microbatches) + v.shape[1:]), 0, 1)
    for k, v in batch.items()
  }


def value_and_grad(
  loss_fn: LossFn, num_microbatches: int | None = None, *, loss_normalizing_factor: float | None = None
):
  """`jax.value_and_grad(loss_fn, has_aux=True)` with the batch processed as `num_microbatches` pieces.

  Returns `f(params, batch, dropout_rng) -> ((loss, metrics), grads)`, the contract of
  `jax.value_and_grad(loss_fn, has_aux=True)`. `metrics` are the sums over the whole batch; `loss` and `grads`
  are normalised by `loss_normalizing_factor`, or else by max(total `weight_sum`, 1), as `loss_fn` does for a
  single batch (pass the model's `loss_normalizing_factor`). Microbatch i uses `fold_in(dropout_rng, i)`.
  With `num_microbatches` None or 1 this is plain `jax.value_and_grad` (same numbers, same rng)."""
  if not num_microbatches or num_microbatches == 1:
    return jax.value_and_grad(loss_fn, has_aux=True)

  def summed(params, batch, dropout_rng):
    _, metrics = loss_fn(params, batch, dropout_rng)
    return metrics["loss_sum"], metrics

  grad_of_sum = jax.grad(summed, has_aux=True)

  def accumulated(params, batch, dropout_rng):
    micro = split_microbatches(batch, num_microbatches)

    def step(carry, xs):
      grad_acc, metric_acc = carry
      i, mb = xs
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
      grads, metrics = grad_of_sum(params, mb, rng)
      add = lambda a, b: a + b.astype(a.dtype)
      return (jax.tree_util.tree_map(add, grad_acc, grads), jax.tree_util.tree_map(add, metric_acc, metrics)), None

    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    metric_shapes = jax.eval_shape(lambda: loss_fn(params, first, dropout_rng)[1])
    zeros = lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))
    init = (jax.tree_util.tree_map(jnp.zeros_like, params), jax.tree_util.tree_map(zeros, metric_shapes))
    (grads, metrics), _ = jax.lax.scan(step, init, (jnp.arange(num_microbatches), micro))
    norm = loss_normalizing_factor or jnp.maximum(metrics["weight_sum"], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / norm, grads)
    return (metrics["loss_sum"] / norm, metrics), grads

  return accumulated
