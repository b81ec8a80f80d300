"""Model summaries without allocating weights: parameter counts per module and FLOPs per token."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5.training import mfu, optim, partitioning


def _shapes(model, lengths):
  shapes = {
    "encoder_input_tokens": (1, lengths["inputs"]),
    "decoder_input_tokens": (1, lengths["targets"]),
    "decoder_target_tokens": (1, lengths["targets"]),
  }
  return shapes, jax.eval_shape(lambda rng: model.init_variables(rng, shapes), jax.random.PRNGKey(0))


def _count(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def param_count(model, lengths: Mapping[str, int]) -> int:
  """Parameters of `model` built for batches of these feature lengths, from shapes alone (nothing allocated)."""
  return _count(_shapes(model, lengths)[1]["params"])


def model_info(model, lengths: Mapping[str, int]) -> dict[str, Any]:
  """{'params', 'modules' (name -> count), 'flops_per_token', 'forward_flops_per_example', ...}.

  FLOPs come from XLA's cost analysis of the lowered (not compiled) forward pass for one example at the
  given feature lengths; training FLOPs per token = 3 x forward (backward ~ 2 x forward) / (inputs + targets)."""
  shapes, variables = _shapes(model, lengths)
  params = variables["params"]
  modules: dict[str, int] = {}
  for top, sub in params.items():
    if isinstance(sub, Mapping) and top in ("encoder", "decoder"):
      layers = [k for k in sub if k.startswith("layers_")]
      modules[f"{top}/layers_* ({len(layers)} layers)"] = sum(_count(sub[k]) for k in layers)
      modules.update({f"{top}/{k}": _count(v) for k, v in sub.items() if k not in layers})
    else:
      modules[top] = _count(sub)
  batch = {k: jax.ShapeDtypeStruct(v, jnp.int32) for k, v in shapes.items()}
  fwd = jax.jit(lambda p, b: model.logits(p, b)).lower(params, batch)
  fwd_flops = mfu.compiled_flops(fwd) or 0.0  # the lowered (not compiled) forward pass
  tokens = lengths["inputs"] + lengths["targets"]
  return {
    "params": _count(params),
    "modules": modules,
    "forward_flops_per_example": fwd_flops,
    "flops_per_token": 3.0 * fwd_flops / tokens,
    "feature_lengths": dict(lengths),
  }


def format_report(report: Mapping[str, Any]) -> str:
  lines = [f"parameters: {report['params']:,}"]
  width = max(len(k) for k in report["modules"])
  for k, v in report["modules"].items():
    lines.append(f"  {k:<{width}}  {v:>15,}  {100 * v / report['params']:5.1f}%")
  lines.append(
    f"FLOPs per token (training, 3x forward): {report['flops_per_token']:.4g} at lengths {report['feature_lengths']}"
  )
  return "\n".join(lines)


def format_sharding(model, lengths, *, mesh=None, rules=None) -> str:
  """Each parameter's shape, logical axes, PartitionSpec and per-device shard shape, then bytes per device for
  the parameters and the optimizer state (Adafactor, as trained), on a mesh that needs no devices.

  `mesh`: a preset name ('tpu_v3_32', ...), 'DxM', a (data, model) tuple or None (the local devices,
  data-parallel); `rules`: 'data', 'data_model', 'fsdp' (default: the preset's, else data_model). Dimensions
  the mesh does not divide are shown replicated, marked `*`."""
  _, variables = _shapes(model, lengths)
  params = variables["params"]
  part = partitioning.partitioner(
    mesh, rules=rules, abstract=True, num_devices=jax.device_count() if mesh in (None, "cpu") else None
  )
  amesh, used_rules = part.mesh, part.rules
  specs, fallbacks = part.param_specs(variables["params_axes"], params=params)
  param_sh = jax.tree_util.tree_map(
    lambda s: jax.sharding.NamedSharding(amesh, s), specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
  )
  names = partitioning.logical_axes(variables["params_axes"])
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  by_key = lambda tree: {
    jax.tree_util.keystr(k): v
    for k, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[
      0
    ]
  }
  sh, axes = by_key(param_sh), by_key(names)
  lines = [
    f"mesh {dict(amesh.shape)} ({amesh.size} devices), rules {partitioning.rules_kind(used_rules)}: "
    + ", ".join(f"{k}->{v}" for k, v in used_rules if v is not None)
  ]
  width = max(len(jax.tree_util.keystr(p)) for p, _ in flat)
  lines.append(f"  {'parameter':<{width}} {'shape':<16} {'logical axes':<28} {'partition spec':<24} per device")
  for path, leaf in flat:
    key = jax.tree_util.keystr(path)
    mark = " *" if key in fallbacks else ""
    lines.append(
      f"  {key:<{width}} {str(tuple(leaf.shape)):<16} {str(tuple(axes[key])):<28} "
      f"{str(sh[key].spec):<24} {sh[key].shard_shape(leaf.shape)}{mark}"
    )
  if fallbacks:
    lines.append(f"  * replicated where the mesh does not divide the dimension ({len(fallbacks)} parameters)")
  tx = optim.for_model(optim.adafactor(), model.module)
  abstract_opt = jax.eval_shape(tx.init, params)
  opt_sh = part.opt_state_shardings(abstract_opt, params, param_sh)
  for label, tree, shardings in (("params", params, param_sh), ("optimizer state", abstract_opt, opt_sh)):
    total, per_device = _bytes(tree, shardings)
    lines.append(f"{label}: {_mb(total)} in all, {_mb(per_device)} per device")
  return "\n".join(lines)


def _bytes(tree, shardings) -> tuple[int, int]:
  """(total bytes, bytes on one device) of a tree of arrays or ShapeDtypeStructs under its shardings."""
  leaves = jax.tree_util.tree_leaves(tree)
  shs = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
  per_device = sum(int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize for x, s in zip(leaves, shs))
  return total, per_device


def _mb(n: int) -> str:
  return f"{n / 2**20:,.2f} MiB ({n:,} bytes)"
