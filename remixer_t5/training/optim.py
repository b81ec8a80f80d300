"""Adafactor and T5's learning-rate schedules (Raffel et al. 2020 §3.1.2; Shazeer & Stern 2018)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000, cooldown_steps: int = 0,
                   total_steps: int | None = None):
  """T5 pretraining: base / sqrt(max(step, warmup)) — 0.01 for the first 10k steps, then inverse sqrt.

  `cooldown_steps` = N > 0 ends the run with a linear decay over its last N of `total_steps` = T (the
  rsqrt-then-linear-cooldown of Zhai et al. 2022, "Scaling Vision Transformers"; Hägele et al. 2024): the rate
  is multiplied by (T - step) / N from step T - N on. The trainer's updates use steps 0 .. T-1, so the last N
  updates get N/N, ..., 1/N of T5's rate (optax's linear_schedule convention; N = 1 would change nothing and
  is refused). Before that the schedule is T5's: the state at step T - N is the plain run's."""
  if cooldown_steps < 0 or cooldown_steps == 1:
    raise ValueError(f"rsqrt_schedule: cooldown_steps must be 0 or >= 2, got {cooldown_steps}")
  if cooldown_steps and (total_steps is None or not 0 < cooldown_steps <= total_steps):
    raise ValueError(f"rsqrt_schedule: cooldown_steps={cooldown_steps} needs total_steps >= it (the run's "
                     f"TRAIN_STEPS), got total_steps={total_steps}")

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    lr = base_learning_rate * jnp.power(jnp.maximum(step, warmup_steps), -0.5)
    if cooldown_steps:
      lr = lr * jnp.clip((total_steps - step) / cooldown_steps, 0.0, 1.0)
    return lr
  return schedule


def constant_schedule(learning_rate: float = 1e-3):
  """T5 finetuning: a constant learning rate."""
  return optax.constant_schedule(learning_rate)


def adafactor(learning_rate=None, clip_gradient_norm: float | None = None, decay_rate: float = 0.8,
              clipping_threshold: float | None = 1.0, multiply_by_parameter_scale: bool = True,
              min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
  """Factored Adafactor without momentum, T5's settings; optional global-norm gradient clipping first."""
  tx = optax.adafactor(learning_rate=learning_rate or rsqrt_schedule(), decay_rate=decay_rate,
                       clipping_threshold=clipping_threshold,
                       multiply_by_parameter_scale=multiply_by_parameter_scale,
                       min_dim_size_to_factor=min_dim_size_to_factor, factored=True, momentum=None)
  if clip_gradient_norm:
    tx = optax.chain(optax.clip_by_global_norm(clip_gradient_norm), tx)
  return tx


def is_scanned(path) -> bool:
  """A parameter of a `scan_layers` stack: `<stack>/layers/...`, stacked on a leading layers axis."""
  return any(getattr(k, "key", None) == "layers" for k in path)


def layerwise(tx: optax.GradientTransformation, stacked: Callable[[tuple], bool] = is_scanned
              ) -> optax.GradientTransformation:
  """`tx` applied to each layer's slice of a stacked parameter as to a parameter of its own.

  Adafactor's statistics are per parameter (Shazeer & Stern 2018: the RMS behind the parameter scale and the
  update clipping, the factored row/column moments), so on a scanned stack's [layers, ...] arrays they would
  mix layers; t5x treats 'layers' as a batch axis for the same reason. With this a scanned stack trains like
  the unrolled one. Leaves where `stacked(path)` is false get `tx` unchanged.
  """
  def init(params):
    if not any(hasattr(x, "shape") for x in jax.tree_util.tree_leaves(params)):
      return tx.init(params)  # optax.tree_map_params's placeholder: only the state's structure is wanted
    return jax.vmap(tx.init)(params)

  per_layer = optax.GradientTransformation(init=init, update=jax.vmap(tx.update))

  def labels(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "layers" if stacked(path) else "rest", params)
  return optax.multi_transform({"layers": per_layer, "rest": tx}, labels)


def for_model(tx: optax.GradientTransformation, module) -> optax.GradientTransformation:
  """`tx` as a run of `module` uses it: layer by layer (`layerwise`) when its config scans the layers."""
  return layerwise(tx) if getattr(getattr(module, "config", None), "scan_layers", False) else tx
