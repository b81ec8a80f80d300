"""Model summaries without allocating weights: parameter counts per module and FLOPs per token."""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5 import partitioning


def _shapes(model, lengths):
  shapes = {"encoder_input_tokens": (1, lengths["inputs"]), "decoder_input_tokens": (1, lengths["targets"]),
            "decoder_target_tokens": (1, lengths["targets"])}
  return shapes, jax.eval_shape(lambda rng: model.init_variables(rng, shapes), jax.random.PRNGKey(0))


def _count(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def model_info(model, lengths: Mapping[str, int]) -> dict[str, Any]:
  """{'params', 'modules' (name -> count), 'flops_per_token', 'forward_flops_per_example', ...}.

  FLOPs come from XLA's cost analysis of the lowered (not compiled) forward pass for one example at the
  given feature lengths; training FLOPs per token = 3 x forward (backward ~ 2 x forward) / (inputs + targets).
  """
  shapes, variables = _shapes(model, lengths)
  params = variables["params"]
  modules: dict[str, int] = {}
  for top, sub in params.items():
    if isinstance(sub, Mapping) and top in ("encoder", "decoder"):
      layer_total = sum(_count(v) for k, v in sub.items() if k.startswith("layers_"))
      n_layers = sum(1 for k in sub if k.startswith("layers_"))
      modules[f"{top}/layers_* ({n_layers} layers)"] = layer_total
      for k, v in sub.items():
        if not k.startswith("layers_"):
          modules[f"{top}/{k}"] = _count(v)
    else:
      modules[top] = _count(sub)
  batch = {k: jax.ShapeDtypeStruct(v, jnp.int32) for k, v in shapes.items()}
  fwd = jax.jit(lambda p, b: model.logits(p, b)).lower(params, batch)
  cost = fwd.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  fwd_flops = float(cost.get("flops", 0.0)) if cost else 0.0
  tokens = lengths["inputs"] + lengths["targets"]
  return {"params": _count(params), "modules": modules, "forward_flops_per_example": fwd_flops,
          "flops_per_token": 3.0 * fwd_flops / tokens, "feature_lengths": dict(lengths)}


def format_report(report: Mapping[str, Any]) -> str:
  lines = [f"parameters: {report['params']:,}"]
  width = max(len(k) for k in report["modules"])
  for k, v in report["modules"].items():
    lines.append(f"  {k:<{width}}  {v:>15,}  {100 * v / report['params']:5.1f}%")
  lines.append(f"FLOPs per token (training, 3x forward): {report['flops_per_token']:.4g} at lengths "
               f"{report['feature_lengths']}")
  return "\n".join(lines)


def format_sharding(model, lengths, num_partitions: int = 1) -> str:
  """Each parameter's shape, logical axes and mesh partition spec on the current devices."""
  _, variables = _shapes(model, lengths)
  mesh = partitioning.make_mesh(num_partitions)
  shardings = partitioning.param_shardings(variables["params_axes"], mesh)
  flat = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
  sh = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(shardings)[0])
  lines = [f"mesh {dict(mesh.shape)}"]
  for path, leaf in flat:
    key = jax.tree_util.keystr(path)
    lines.append(f"  {key:<70} {str(leaf.shape):<16} {sh[key].spec}")
  return "\n".join(lines)
