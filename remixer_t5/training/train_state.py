"""The trainer's state: created directly in its shardings (nothing is built replicated first), its abstract
form for restores and ahead-of-time compiles, and an INIT_CHECKPOINT's fixed-length matrices fitted on load."""
from __future__ import annotations

import contextlib
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
  return {"encoder_input_tokens": (1, feature_lengths["inputs"]),
          "decoder_input_tokens": (1, feature_lengths["targets"]),
          "decoder_target_tokens": (1, feature_lengths["targets"])}


def abstract(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                                shardings)


def abstract_state(model, tx, input_shapes, mesh) -> tuple[TrainState, TrainState]:
  """(abstract TrainState carrying its shardings, the shardings), from shapes alone."""
  abstract_vars = jax.eval_shape(lambda rng: model.init_variables(rng, input_shapes), jax.random.PRNGKey(0))
  param_sh = partitioning.param_shardings(abstract_vars["params_axes"], mesh, params=abstract_vars["params"])
  abstract_opt = jax.eval_shape(tx.init, abstract_vars["params"])
  opt_sh = partitioning.opt_state_shardings(abstract_opt, abstract_vars["params"], param_sh, mesh)
  rep = partitioning.replicated(mesh)
  shardings = TrainState(step=rep, params=param_sh, opt_state=opt_sh, rng=rep)
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_vars["params"],
                      opt_state=abstract_opt, rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)))
  return abstract(shapes, shardings), shardings


def create_state(model, tx, input_shapes, mesh, seed):
  """Initialise params and optimizer state directly in their shardings (nothing is built replicated)."""
  _, shardings = abstract_state(model, tx, input_shapes, mesh)
  return init_state(model, tx, input_shapes, shardings, seed), shardings


def init_program(model, tx, input_shapes, shardings, seed):
  """The state's initialiser, jitted into `shardings`, and the key it takes (scripts/gpu_measure.py times its
  compile and its run apart). Lower or call it inside `init_rng_as_kernel(shardings)`, as `init_state` does."""
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))

  def init(rng):
    params = model.init_variables(rng, input_shapes)["params"]
    return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
                      rng=dropout_rng)

  return jax.jit(init, out_shardings=shardings), init_rng


RNG_KERNEL_OPTION = "jax_threefry_gpu_kernel_lowering"


@contextlib.contextmanager
def init_rng_as_kernel(shardings=None):
  """Inside the block, jitted code lowered for a GPU draws its threefry bits with jax's threefry kernel (one
  custom call per draw) instead of XLA's inlined threefry; for the initialiser, which is compiled once.

  Inlined, every parameter's threefry stream is unrolled into XLA:GPU's fusions, which makes the initialiser slow
  to lower and compile. The kernel computes the same threefry2x32 function (jax's earlier GPU lowering), so the
  state comes out bit-identical both ways (scripts/gpu_measure.py's init_rng stage). It writes each draw's bits
  to memory before they are transformed, which costs the initialiser temporaries once, before training.

  Only where `shardings` (the state's) keep every value whole on each device: one device, or replicated
  parameters (the data-parallel rules). XLA does not partition the kernel's custom call, so under sharded
  parameters (fsdp, model rules) every device would draw every parameter in full; there, and with a jax
  without the option (its CHANGELOG says it may go), the inlined form stays. The train step (dropout) always
  keeps it; CPUs and TPUs are unaffected (the option picks only the GPU lowering). It sets jax's global
  option: not for initialisers lowered in several threads at once."""
  was = getattr(jax.config, RNG_KERNEL_OPTION, None)
  if was is None or not (shardings is None or all(s.is_fully_replicated for s in jax.tree_util.tree_leaves(shardings))):
    yield
    return
  jax.config.update(RNG_KERNEL_OPTION, True)
  try:
    yield
  finally:
    jax.config.update(RNG_KERNEL_OPTION, was)


def init_state(model, tx, input_shapes, shardings, seed):
  init, rng = init_program(model, tx, input_shapes, shardings, seed)
  with init_rng_as_kernel(shardings):
    return init(rng)


def fit_lengths(model, feature_lengths, fresh, params, log):
  """INIT_CHECKPOINT's fixed-length mixer matrices fitted to this run's lengths (see `fixed_length`)."""
  variables = jax.eval_shape(lambda rng: model.init_variables(rng, input_shapes(feature_lengths)),
                             jax.random.PRNGKey(0))
  params, resized = fixed_length.fit_params(params, fresh, partitioning.logical_axes(variables["params_axes"]))
  for line in resized:
    log.info(f"INIT_CHECKPOINT resized to this run's lengths: {line}")
  return params
