"""The trainer's state, its abstract form (shapes and shardings: what programs.py builds the steps for, restores
and ahead-of-time compiles take) and an INIT_CHECKPOINT's fixed-length matrices fitted on load."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import struct

from remixer_t5.model import fixed_length
from remixer_t5.training import partitioning


class TrainState(struct.PyTreeNode):
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def input_shapes(feature_lengths: Mapping[str, int]) -> dict[str, tuple[int, int]]:
  return {
    "encoder_input_tokens": (1, feature_lengths["inputs"]),
    "decoder_input_tokens": (1, feature_lengths["targets"]),
    "decoder_target_tokens": (1, feature_lengths["targets"]),
  }


def abstract(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_state(model, tx, input_shapes, partitioner) -> tuple[TrainState, TrainState]:
  """(abstract TrainState carrying its shardings, the shardings), from shapes alone, placed by `partitioner`."""
  abstract_vars = jax.eval_shape(lambda rng: model.init_variables(rng, input_shapes), jax.random.PRNGKey(0))
  param_sh = partitioner.param_shardings(abstract_vars["params_axes"], params=abstract_vars["params"])
  abstract_opt = jax.eval_shape(tx.init, abstract_vars["params"])
  opt_sh = partitioner.opt_state_shardings(abstract_opt, abstract_vars["params"], param_sh)
  rep = partitioner.replicated()
  shardings = TrainState(step=rep, params=param_sh, opt_state=opt_sh, rng=rep)
  shapes = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),
    params=abstract_vars["params"],
    opt_state=abstract_opt,
    rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
  )
  return abstract(shapes, shardings), shardings


def fit_lengths(model, feature_lengths, fresh, params, log):
  """INIT_CHECKPOINT's fixed-length mixer matrices fitted to this run's lengths (see `fixed_length`)."""
  variables = jax.eval_shape(
    lambda rng: model.init_variables(rng, input_shapes(feature_lengths)), jax.random.PRNGKey(0)
  )
  params, resized = fixed_length.fit_params(params, fresh, partitioning.logical_axes(variables["params_axes"]))
  for line in resized:
    log.info(f"INIT_CHECKPOINT resized to this run's lengths: {line}")
  return params
