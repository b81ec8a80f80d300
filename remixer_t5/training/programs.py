"""The jitted programs of a run: the train step (loss, gradient, optimizer update; microbatched when asked), the
eval step, and the abstract batch they take. `train`, `evaluate_checkpoint` and `remixer-t5 compile` all build
them with `program`, so the ahead-of-time compile is of exactly the step `train` runs."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from remixer_t5.model.models import EncoderDecoderModel
from remixer_t5.training import accumulate, optim, partitioning
from remixer_t5.training.train_state import TrainState, abstract_state, input_shapes


# --- steps -----------------------------------------------------------------------------------------------
def make_train_step(model: EncoderDecoderModel, optimizer: optax.GradientTransformation,
                    schedule: Callable | None, num_microbatches: int | None = None):
  """One optimizer step; with `num_microbatches` > 1 the batch's gradient is accumulated over microbatches
  (remixer_t5/training/accumulate.py: the same gradient as the whole batch at once, in less memory)."""
  grad_fn = accumulate.value_and_grad(model.loss_fn, num_microbatches,
                                      loss_normalizing_factor=model.loss_normalizing_factor)

  def train_step(state: TrainState, batch):
    dropout_rng = jax.random.fold_in(state.rng, state.step)
    (_, metrics), grads = grad_fn(state.params, batch, dropout_rng)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Counted every step, checked on the host at log and save points: a bad update is never checkpointed.
    metrics["nonfinite"] = jnp.logical_not(jnp.isfinite(metrics["loss_sum"]) & jnp.isfinite(
        optax.tree.norm(updates))).astype(jnp.int32)
    if schedule is not None:
      metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
  return train_step


def make_eval_step(model: EncoderDecoderModel):
  def eval_step(params, batch):
    return model.loss_fn(params, batch, None)[1]
  return eval_step


def batch_shapes(feature_lengths: Mapping[str, int], batch_size: int, pack: bool
                 ) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch the steps take, as shapes: seqio.EncDecFeatureConverter's int32 features."""
  enc, dec = feature_lengths["inputs"], feature_lengths["targets"]
  lengths = {"encoder_input_tokens": enc, "decoder_target_tokens": dec, "decoder_input_tokens": dec,
             "decoder_loss_weights": dec}
  if pack:
    lengths.update(encoder_segment_ids=enc, encoder_positions=enc, decoder_segment_ids=dec,
                   decoder_positions=dec)
  return {k: jax.ShapeDtypeStruct((batch_size, n), jnp.int32) for k, n in lengths.items()}


@dataclasses.dataclass(frozen=True)
class Program:
  """The jitted steps of a run and the abstract state and shardings they take (built by `program`)."""
  mesh: Any
  state: TrainState  # abstract: ShapeDtypeStructs carrying their shardings
  shardings: TrainState
  batch_sharding: Any
  train_step: Any  # jitted make_train_step, state donated
  eval_step: Any  # jitted make_eval_step (params, batch)

  def compile(self, step, *args, compiler_options: dict | None = None):
    """`step` lowered and compiled under the mesh's activation rules (constraints placed as t5x does);
    `compiler_options`: XLA debug options for this compile only (e.g. {'xla_gpu_enable_triton_gemm': False})."""
    with partitioning.activation_sharding(self.mesh):
      return step.lower(*args).compile(compiler_options)


def program(model: EncoderDecoderModel, tx: optax.GradientTransformation, schedule: Callable | None,
            feature_lengths: Mapping[str, int], mesh, num_microbatches: int | None = None) -> Program:
  abstract, shardings = abstract_state(model, tx, input_shapes(feature_lengths), mesh)
  batch_sh = partitioning.data_sharding(mesh)
  train_step = jax.jit(make_train_step(model, tx, schedule, num_microbatches),
                       in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(model), in_shardings=(shardings.params, batch_sh))
  return Program(mesh, abstract, shardings, batch_sh, train_step, eval_step)


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
  w = max(float(sums["weight_sum"]), 1.0)
  return {"loss": float(sums["loss_sum"]) / w, "z_loss": float(sums["z_loss_sum"]) / w,
          "accuracy": float(sums["correct_sum"]) / w}


def optimizer(model, optimizer, learning_rate) -> optax.GradientTransformation:
  """The run's optimizer; a scanned model's stacked layers are optimised layer by layer (optim.layerwise)."""
  return optim.for_model(optimizer(learning_rate=learning_rate), model.module)
