"""Adafactor and T5's learning-rate schedules (Raffel et al. 2020 §3.1.2; Shazeer & Stern 2018)."""
from __future__ import annotations

import jax.numpy as jnp
import optax


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000):
  """T5 pretraining: base / sqrt(max(step, warmup)) — 0.01 for the first 10k steps, then inverse sqrt."""
  def schedule(step):
    return base_learning_rate * jnp.power(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps), -0.5)
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
