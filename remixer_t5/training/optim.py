"""Adafactor and T5's learning-rate schedules (Raffel et al. 2020 §3.1.2; Shazeer & Stern 2018), and nanoT5's
AdamW with RMS scaling and its warmup-then-cosine schedule (Nawrot 2023, "nanoT5: A PyTorch Framework for
Pre-training and Fine-tuning T5-style Models with Limited Resources", arXiv:2309.02373)."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax


def rsqrt_schedule(
  base_learning_rate: float = 1.0, warmup_steps: int = 10_000, cooldown_steps: int = 0, total_steps: int | None = None
):
  """T5 pretraining: base / sqrt(max(step, warmup)) — 0.01 for the first 10k steps, then inverse sqrt.

  `cooldown_steps` = N > 0 ends the run with a linear decay over its last N of `total_steps` = T (the
  rsqrt-then-linear-cooldown of Zhai et al. 2022, "Scaling Vision Transformers"; Hägele et al. 2024): the rate
  is multiplied by (T - step) / N from step T - N on. The trainer's updates use steps 0 .. T-1, so the last N
  updates get N/N, ..., 1/N of T5's rate (optax's linear_schedule convention; N = 1 would change nothing and
  is refused). Before that the schedule is T5's: the state at step T - N is the plain run's."""
  if cooldown_steps < 0 or cooldown_steps == 1:
    raise ValueError(f"rsqrt_schedule: cooldown_steps must be 0 or >= 2, got {cooldown_steps}")
  if cooldown_steps and (total_steps is None or not 0 < cooldown_steps <= total_steps):
    raise ValueError(
      f"rsqrt_schedule: cooldown_steps={cooldown_steps} needs total_steps >= it (the run's "
      f"TRAIN_STEPS), got total_steps={total_steps}"
    )

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


def _is_count(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and float(x) == int(x)


def _check_warmup_then_decay(
  name: str, peak_learning_rate, warmup_steps, total_steps, final_learning_rate, warmup_start_factor
) -> None:
  """The arguments of `cosine_schedule` and `linear_schedule`; a ValueError names the first bad one."""
  if not peak_learning_rate > 0:
    raise ValueError(f"{name}: peak_learning_rate must be > 0, got {peak_learning_rate}")
  if not _is_count(warmup_steps) or warmup_steps < 0:
    raise ValueError(f"{name}: warmup_steps must be an integer >= 0, got {warmup_steps}")
  if not _is_count(total_steps) or total_steps <= warmup_steps:
    raise ValueError(
      f"{name}: total_steps must be an integer > warmup_steps={warmup_steps} (the decay needs at "
      f"least one step), got {total_steps}"
    )
  if not 0 <= final_learning_rate <= peak_learning_rate:
    raise ValueError(
      f"{name}: final_learning_rate must be in [0, peak_learning_rate={peak_learning_rate}], got {final_learning_rate}"
    )
  if not 0 <= warmup_start_factor <= 1:
    raise ValueError(f"{name}: warmup_start_factor must be in [0, 1], got {warmup_start_factor}")


def _warmup_then_decay(peak, warmup_steps, total_steps, final, start_factor, decay: Callable):
  """peak * (f + (1 - f) * step / W) for step < W, then final + (peak - final) * decay(r) with r = (T - step) / (T - W)
  the share of the decay still ahead, from 1 at W to 0 at T and after. In float32 T - step is exact where 1 - x
  for x = (step - W) / (T - W) would lose the last steps' rates to rounding."""
  decay_steps = total_steps - warmup_steps

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * (start_factor + (1.0 - start_factor) * step / max(warmup_steps, 1))
    ahead = jnp.clip(total_steps - step, 0.0, decay_steps) / decay_steps
    return jnp.where(step < warmup_steps, warm, final + (peak - final) * decay(ahead))

  return schedule


def cosine_schedule(
  peak_learning_rate: float = 2e-2,
  warmup_steps: int = 10_000,
  total_steps: int = 65_536,
  final_learning_rate: float = 1e-5,
  warmup_start_factor: float = 0.5,
):
  """nanoT5's default schedule (Nawrot 2023; its README, "AdamW with RMS scaling Optimizer & Cosine LR Schedule"):
  a linear warmup from half the peak, then a cosine decay to `final_learning_rate`.

  With peak P, warmup W, total T, final F and start factor f, the rate of step s is
    P * (f + (1 - f) * s / W)                          for 0 <= s < W,
    F + (P - F) * (1 + cos(pi * (s - W) / (T - W))) / 2  for W <= s <= T (F from T on).
  That is what nanoT5's PyTorch schedulers give (utils/model_utils.py, get_lr_scheduler 'cosine': LinearLR with
  start_factor=0.5, end_factor=1, total_iters=W, then CosineAnnealingLR with T_max=T-W, eta_min=F, joined by
  SequentialLR at milestone W), whose recursive updates telescope to these closed forms. Step indexing: nanoT5
  steps its scheduler after each optimizer step, so its n-th update (n = 1..T) uses the scheduler's epoch n - 1;
  the trainer's update k (k = 0..T-1) uses `schedule(k)`, so update for update the rates agree: the first is
  P * f, the peak P is reached at s = W, and the last update (s = T - 1) is a little above F, which nanoT5's
  scheduler reaches only at s = T, after its last update. Past T PyTorch's cosine would rise again; this stays
  at F. The defaults are nanoT5's configs/default.yaml (optim.base_lr, warmup_steps, total_steps = 2^16,
  final_cosine). warmup_steps = 0 starts the cosine at step 0 (nanoT5's LinearLR would still give step 0 P * f)."""
  _check_warmup_then_decay(
    "cosine_schedule", peak_learning_rate, warmup_steps, total_steps, final_learning_rate, warmup_start_factor
  )
  # (1 + cos(pi x)) / 2 with x = 1 - r is sin(pi r / 2)^2: the same value, without float32's cancellation near x = 1
  return _warmup_then_decay(
    peak_learning_rate,
    int(warmup_steps),
    int(total_steps),
    final_learning_rate,
    warmup_start_factor,
    lambda r: jnp.square(jnp.sin(0.5 * math.pi * r)),
  )


def linear_schedule(
  peak_learning_rate: float = 2e-2,
  warmup_steps: int = 10_000,
  total_steps: int = 65_536,
  final_learning_rate: float = 1e-5,
  warmup_start_factor: float = 0.5,
):
  """`cosine_schedule`'s warmup and step indexing, then a linear decay to `final_learning_rate`:
    P * (f + (1 - f) * s / W)              for 0 <= s < W,
    F + (P - F) * (1 - (s - W) / (T - W))  for W <= s <= T (F from T on),
  as PyTorch's LinearLR(start_factor=1, end_factor=F/P, total_iters=T-W) after nanoT5's warmup would give it:
  F is reached at s = T, so the trainer's last update (s = T - 1) takes F + (P - F) / (T - W).

  nanoT5 itself has no such option: its 'legacy' schedule (utils/model_utils.py, get_lr_scheduler) is T5's
  inverse square root, min(1e-2, 1/sqrt(s)), for the first ceil(0.9 T) steps, then a linear decay to 0 from that
  step's rate over the rest; this is the warmup-linear-decay variant of its cosine recipe, for comparisons."""
  _check_warmup_then_decay(
    "linear_schedule", peak_learning_rate, warmup_steps, total_steps, final_learning_rate, warmup_start_factor
  )
  return _warmup_then_decay(
    peak_learning_rate, int(warmup_steps), int(total_steps), final_learning_rate, warmup_start_factor, lambda r: r
  )


def adafactor(
  learning_rate=None,
  clip_gradient_norm: float | None = None,
  decay_rate: float = 0.8,
  clipping_threshold: float | None = 1.0,
  multiply_by_parameter_scale: bool = True,
  min_dim_size_to_factor: int = 128,
) -> optax.GradientTransformation:
  """Factored Adafactor without momentum, T5's settings; optional global-norm gradient clipping first (over the
  whole model, under `layerwise` too)."""
  tx = optax.adafactor(
    learning_rate=learning_rate or rsqrt_schedule(),
    decay_rate=decay_rate,
    clipping_threshold=clipping_threshold,
    multiply_by_parameter_scale=multiply_by_parameter_scale,
    min_dim_size_to_factor=min_dim_size_to_factor,
    factored=True,
    momentum=None,
  )
  return GlobalNormClipped(clip_gradient_norm, tx) if clip_gradient_norm else tx


class GlobalNormClipped(optax.GradientTransformation):
  """`inner` after clipping the gradients to a global norm of at most `max_norm` (optax.clip_by_global_norm).

  The chain of the two, keeping its parts: `layerwise` clips over all gradients at once and runs only `inner` per
  layer slice, as the unrolled model would be clipped (a clip per slice would use each slice's own norm)."""

  def __new__(cls, max_norm: float, inner: optax.GradientTransformation):
    chained = optax.chain(optax.clip_by_global_norm(max_norm), inner)
    self = super().__new__(cls, chained.init, chained.update)
    self.max_norm, self.inner = max_norm, inner
    return self


def scale_by_adam_step_corrected(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6) -> optax.GradientTransformation:
  """Adam as HuggingFace's AdamW computes it (nanoT5's AdamWScale copies it): the bias correction scales the
  step, outside eps. With t the update's number (1, 2, ...):
    m_t = b1 m_{t-1} + (1 - b1) g,  v_t = b2 v_{t-1} + (1 - b2) g^2,
    u_t = sqrt(1 - b2^t) / (1 - b1^t) * m_t / (sqrt(v_t) + eps).
  optax.scale_by_adam corrects m and v before adding eps, m_hat / (sqrt(v_hat) + eps): this update with eps
  multiplied by sqrt(1 - b2^t), 1/32 of it at t = 1 with b2 = 0.999. The state is optax's ScaleByAdamState."""

  def init(params):
    return optax.ScaleByAdamState(
      count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params), nu=optax.tree.zeros_like(params)
    )

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    step = jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t)
    updates = jax.tree.map(lambda m, v: (step * m / (jnp.sqrt(v) + eps)).astype(m.dtype), mu, nu)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def decay_updated_weights(weight_decay: float, learning_rate) -> optax.GradientTransformation:
  """Decoupled weight decay after the step, as nanoT5's AdamWScale (and HuggingFace's AdamW) apply it:
  p <- (p + u) * (1 - lr_t * weight_decay), i.e. the update u becomes u - lr_t * weight_decay * (p + u), with lr_t
  the schedule's rate at this step (not scaled by the RMS). optax.add_decayed_weights decays p, not p + u: the
  same to first order in lr_t."""

  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("decay_updated_weights: the update needs the parameters (tx.update(grads, state, params))")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    decay = jnp.asarray(lr, jnp.float32) * weight_decay
    updates = jax.tree.map(lambda u, p: (u - decay * (p + u)).astype(u.dtype), updates, params)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


def decay_mask(no_decay: Sequence[str]) -> Callable:
  """The weight-decay mask: True for the parameters none of whose path keys (lower case) contains a `no_decay`
  fragment."""
  fragments = tuple(f.lower() for f in no_decay)

  def mask(params):
    def decays(path, _):
      keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))).lower() for k in path]
      return not any(f in key for key in keys for f in fragments)

    return jax.tree_util.tree_map_with_path(decays, params)

  return mask


def adamw_scaled(
  learning_rate=None,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-6,
  weight_decay: float = 0.0,
  clip_gradient_norm: float | None = 1.0,
  min_param_rms: float = 1e-3,
  no_decay: Sequence[str] = ("bias", "norm"),
) -> optax.GradientTransformation:
  """nanoT5's AdamWScale (Nawrot 2023; README, "AdamW with RMS scaling Optimizer & Cosine LR Schedule"; code:
  utils/copied_utils.py): AdamW whose step for each parameter is multiplied by that parameter's RMS, floored at
  `min_param_rms`, as Adafactor's relative step is (Shazeer & Stern 2018, multiply_by_parameter_scale). With lr_t
  the rate of update t = 1, 2, ... and p the parameter before it:
    m_t = b1 m_{t-1} + (1 - b1) g,  v_t = b2 v_{t-1} + (1 - b2) g^2,
    p <- p - lr_t * sqrt(1 - b2^t) / (1 - b1^t) * max(min_param_rms, RMS(p)) * m_t / (sqrt(v_t) + eps),
    p <- p * (1 - lr_t * weight_decay)   (the parameters that decay),
  g being the gradient after clipping all gradients together to a global norm of `clip_gradient_norm` (None or
  0: no clipping) and RMS(p) = sqrt(mean(p^2)) over the whole array (over each layer slice under `layerwise`).
  Built as scale_by_adam_step_corrected, optax.scale_by_param_block_rms, optax.scale_by_learning_rate and
  decay_updated_weights (masked by `no_decay`), after optax.clip_by_global_norm (`GlobalNormClipped`).

  The defaults are nanoT5's: betas (0.9, 0.999), eps 1e-6 and the 1e-3 floor are AdamWScale's own (get_optimizer
  passes it only the rate), weight_decay 0.0 and the clip at 1.0 are configs/default.yaml's optim.weight_decay and
  optim.grad_clip. nanoT5 exempts from weight decay the parameters whose names contain "bias", "LayerNorm",
  "layernorm", "layer_norm" or "ln" (its T5's layer norms and relative attention bias); `no_decay` matches
  fragments of path keys in lower case, and ("bias", "norm") exempts our norms' scales and any bias. PyTorch's
  clip_grad_norm_ scales by max_norm / (norm + 1e-6) where optax divides by the norm itself.
  `learning_rate`: a float or a schedule; None is `cosine_schedule()`, nanoT5's default."""
  checks = (
    ("b1", b1, 0 <= b1 < 1, "in [0, 1)"),
    ("b2", b2, 0 <= b2 < 1, "in [0, 1)"),
    ("eps", eps, eps >= 0, ">= 0"),
    ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
    ("min_param_rms", min_param_rms, min_param_rms >= 0, ">= 0"),
    (
      "clip_gradient_norm",
      clip_gradient_norm,
      clip_gradient_norm is None or clip_gradient_norm >= 0,
      "None, 0 (no clipping) or > 0",
    ),
  )
  for name, value, ok, expected in checks:
    if not ok:
      raise ValueError(f"adamw_scaled: {name} must be {expected}, got {value}")
  if learning_rate is None:
    learning_rate = cosine_schedule()
  elif not callable(learning_rate) and not learning_rate >= 0:
    raise ValueError(f"adamw_scaled: learning_rate must be a schedule or a float >= 0, got {learning_rate}")
  if isinstance(no_decay, str):
    raise ValueError(f"adamw_scaled: no_decay must be a sequence of name fragments, got the string {no_decay!r}")
  parts = [
    scale_by_adam_step_corrected(b1, b2, eps),
    optax.scale_by_param_block_rms(min_param_rms),
    optax.scale_by_learning_rate(learning_rate),
  ]
  if weight_decay:
    parts.append(optax.masked(decay_updated_weights(weight_decay, learning_rate), decay_mask(no_decay)))
  tx = optax.chain(*parts)
  return GlobalNormClipped(clip_gradient_norm, tx) if clip_gradient_norm else tx


def is_scanned(path) -> bool:
  """A parameter of a `scan_layers` stack: `<stack>/layers/...`, stacked on a leading layers axis."""
  return any(getattr(k, "key", None) == "layers" for k in path)


def layerwise(
  tx: optax.GradientTransformation, stacked: Callable[[tuple], bool] = is_scanned
) -> optax.GradientTransformation:
  """`tx` applied to each layer's slice of a stacked parameter as to a parameter of its own.

  Adafactor's statistics are per parameter (Shazeer & Stern 2018: the RMS behind the parameter scale and the
  update clipping, the factored row/column moments), so on a scanned stack's [layers, ...] arrays they would
  mix layers; t5x treats 'layers' as a batch axis for the same reason, and AdamWScale's per-parameter RMS
  (`adamw_scaled`) needs the same. With this a scanned stack trains like the unrolled one. Leaves where
  `stacked(path)` is false get `tx` unchanged. A `GlobalNormClipped` clips over all gradients at once, then runs
  its inner transformation layer by layer."""
  if isinstance(tx, GlobalNormClipped):
    return optax.chain(optax.clip_by_global_norm(tx.max_norm), layerwise(tx.inner, stacked))

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
