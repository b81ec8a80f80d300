"""Model FLOPs utilisation: the model's FLOPs per train step against the device's peak dense bf16 FLOP/s.

MFU (PaLM, Chowdhery et al. 2022, App. B) counts the FLOPs the model needs, not those the hardware ran:
`model_flops_per_step` is XLA's cost analysis of the forward and backward pass of the loss, lowered (never
compiled) for the same network unscanned and without rematerialisation, so it is the same number whether a run
scans its stacks or recomputes activations. `compiled_flops` is the other count, XLA's of a compiled step: it
includes recomputation (hardware FLOPs utilisation, HFU) and counts a loop's body once (a scanned stack, a
microbatch loop), so it is only a whole step's count for a step without loops.

Peak figures are the vendors' dense (no sparsity) bf16 numbers per JAX device. On TPU v2/v3 a JAX device is
one TensorCore (half a chip); from v4 on, one chip. `peak_flops` can be overridden (gin:
`run_config.Training.peak_flops_per_device`), e.g. for an unlisted device or to report against fp32 peaks.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Mapping

import jax

from remixer_t5 import flop_count

# (substring of jax.Device.device_kind, lower case) -> peak bf16 FLOP/s per JAX device. Order matters: the
# first match wins, so more specific names come first.
PEAK_FLOPS_PER_DEVICE: tuple[tuple[str, float], ...] = (
  ("tpu v2", 45e12 / 2),  # 45 TFLOP/s per chip, 2 cores
  ("tpu v3", 123e12 / 2),  # 123 TFLOP/s per chip, 2 cores
  ("tpu v4", 275e12),
  ("tpu v5 lite", 197e12),  # v5e
  ("tpu v5e", 197e12),
  ("tpu v5p", 459e12),
  ("tpu v5", 459e12),  # v5p reports "TPU v5"
  ("tpu v6 lite", 918e12),  # v6e (Trillium)
  ("a100", 312e12),
  ("h100", 989e12),  # SXM dense bf16
  ("h200", 989e12),
)


def peak_flops_per_device(device: jax.Device | None = None, override: float | None = None) -> float | None:
  """Peak bf16 FLOP/s of one device (None when unknown, e.g. a CPU)."""
  if override:
    return float(override)
  kind = (device or jax.devices()[0]).device_kind.lower()
  for key, peak in PEAK_FLOPS_PER_DEVICE:
    if key in kind:
      return peak
  return None


def _flops(cost) -> float:
  """The FLOP count of a `cost_analysis()` result (a dict, or a list of one in older jax), 0 when absent."""
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops") or 0.0)


def compiled_flops(compiled) -> float | None:
  """XLA's FLOP count of a compiled computation (per device for an SPMD-partitioned one); None if absent."""
  try:
    flops = _flops(compiled.cost_analysis())
  except Exception:  # noqa: BLE001 - not every backend implements cost analysis
    return None
  return flops if flops > 0 else None


def mfu(flops_per_step_per_device: float | None, steps_per_s: float, peak: float | None) -> float | None:
  """Achieved / peak FLOP/s per device, or None when either is unknown."""
  if not flops_per_step_per_device or not peak:
    return None
  return flops_per_step_per_device * steps_per_s / peak


def model_flops_per_step(model, batch: Mapping[str, jax.ShapeDtypeStruct]) -> float:
  """Model FLOPs of one training step over the whole (global) `batch` of shapes: forward and backward of
  `model.loss_fn` (no optimizer update, no dropout) of the same model unscanned and unrematerialised (see the
  module docstring), lowered from shapes (nothing is allocated or compiled). Divide by the device count for a
  per-device figure. Mixers' chunk scans are unrolled for the count and CPU/GPU kernels (FFI custom calls, which
  XLA's cost analysis counts as nothing) take their XLA form (`flop_count.counting_model_flops`)."""
  return model_flops_and_loops(model, batch)[0]


def model_flops_and_loops(model, batch: Mapping[str, jax.ShapeDtypeStruct]) -> tuple[float, int]:
  """(model_flops_per_step, the number of while loops left in the lowered step). With loops the count is a
  lower bound: XLA's cost analysis counts each loop's body once, however many times it runs."""
  plain, cfg = model, getattr(model.module, "config", None)
  if dataclasses.is_dataclass(cfg) and (
    getattr(cfg, "scan_layers", False) or getattr(cfg, "remat_policy", "none") != "none"
  ):
    plain = copy.copy(model)
    plain.module = model.module.clone(config=dataclasses.replace(cfg, scan_layers=False, remat_policy="none"))
  # The batch counted unpacked, the model's math, not a packing's bookkeeping: without segment ids every mixer
  # takes its unpacked form (packed HyperMixing scans segment ids a block at a time, several unpacked passes).
  batch = {k: v for k, v in batch.items() if not k.endswith(("_segment_ids", "_positions"))}
  input_shapes = {
    k: (1,) + tuple(v.shape[1:])
    for k, v in batch.items()
    if k in ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens")
  }
  params = jax.eval_shape(lambda rng: plain.init_variables(rng, input_shapes), jax.random.PRNGKey(0))["params"]
  grad = jax.grad(lambda p, b: plain.loss_fn(p, b, None)[0])

  def lower():
    with flop_count.counting_model_flops():  # loops unrolled; kernels and custom calls in XLA's form
      lowered = jax.jit(grad).lower(params, dict(batch))
    return lowered, _flops(lowered.cost_analysis())

  lowered, flops = lower()
  if flops <= 0 and jax.default_backend() != "cpu":
    # The GPU backend's lowered cost analysis can count nothing; the math is the same lowered for the host,
    # whose cost analysis counts it.
    with jax.default_device(jax.devices("cpu")[0]):
      lowered, flops = lower()
  if flops <= 0:
    raise ValueError("XLA's cost analysis of the lowered train step gave no FLOP count")
  return flops, lowered.as_text().count("stablehlo.while")


# Name-stack parts that say how a computation was transformed, not where it is in the model.
_TRANSFORM = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|cond|while|scan|shard_map)\(.*\)$")


def compiled_loops(compiled) -> list[str]:
  """Where the while loops of a compiled program come from: their op names without transformation wrappers,
  with layer numbers as `layers_*`, each once ('train_step (its microbatch loop)' for a loop of the step itself).
  Empty when the program has none. XLA's cost analysis counts a loop's body once, so a program with loops has
  no whole-step FLOP count or time estimate from it."""
  try:
    text = compiled.as_text()
  except Exception:  # noqa: BLE001 - not every compiled object prints its HLO
    return []
  found: list[str] = []
  for line in text.splitlines():
    if not re.search(r"\swhile\(", line):
      continue
    name = re.search(r'op_name="([^"]*)"', line)
    parts = [p for p in (name.group(1).split("/") if name else []) if p and not _TRANSFORM.match(p)]
    if parts and parts[-1] == "while":
      parts = parts[:-1]
    where = re.sub(r"layers_\d+", "layers_*", "/".join(parts)) or "train_step (its microbatch loop)"
    if where not in found:
      found.append(where)
  return found
