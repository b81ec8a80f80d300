"""The program builder: a run's model, optax transformation (`tx`) and partitioner in, its jitted initialiser,
train and eval steps out. `train`, `eval`, `remixer-t5 compile`, `bench train` and the scripts all build them
with `build`, so the ahead-of-time compile and every measurement are of exactly the step `train` runs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax._src import config as jax_config  # the option's context-manager form is not exported

from remixer_t5.model.models import EncoderDecoderModel
from remixer_t5.training import accumulate, optim
from remixer_t5.training.partitioning import Partitioner
from remixer_t5.training.train_state import TrainState, abstract_state, input_shapes

INIT_RNG_FORMS = ("auto", "inline", "kernel")


# --- steps -----------------------------------------------------------------------------------------------
def make_train_step(
  model: EncoderDecoderModel,
  tx: optax.GradientTransformation,
  schedule: Callable | None,
  num_microbatches: int | None = None,
):
  """One update by `tx`; with `num_microbatches` > 1 the batch's gradient is accumulated over microbatches
  (remixer_t5/training/accumulate.py: the same gradient as the whole batch at once, in less memory)."""
  grad_fn = accumulate.value_and_grad(
    model.loss_fn, num_microbatches, loss_normalizing_factor=model.loss_normalizing_factor
  )

  def train_step(state: TrainState, batch):
    dropout_rng = jax.random.fold_in(state.rng, state.step)
    (_, metrics), grads = grad_fn(state.params, batch, dropout_rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Counted every step, checked on the host at log and save points: a bad update is never checkpointed.
    metrics["nonfinite"] = jnp.logical_not(
      jnp.isfinite(metrics["loss_sum"]) & jnp.isfinite(optax.tree.norm(updates))
    ).astype(jnp.int32)
    if schedule is not None:
      metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(model: EncoderDecoderModel):
  def eval_step(params, batch):
    return model.loss_fn(params, batch, None)[1]

  return eval_step


def make_init(model: EncoderDecoderModel, tx: optax.GradientTransformation, feature_lengths: Mapping[str, int]):
  """rng -> the TrainState: parameters from `rng`'s first half, the dropout key its second."""
  shapes = input_shapes(feature_lengths)

  def init(rng):
    init_rng, dropout_rng = jax.random.split(rng)
    params = model.init_variables(init_rng, shapes)["params"]
    return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params), rng=dropout_rng)

  return init


@functools.lru_cache(maxsize=8)
def jit_decode(model: EncoderDecoderModel, beam_size: int = 1, eos_id: int = 1):
  """(params, encoder tokens, decode length) -> tokens: the jitted greedy (beam_size 1) or beam decode, one per
  (model, beams, EOS) so that evaluating several splits compiles each length once. Evaluation stops at EOS (id 1);
  `remixer-t5 bench decode` passes an id no token has (bench_decode.NO_EOS) to time every position."""
  return jax.jit(
    lambda p, enc, n: model.predict_batch(
      p, {"encoder_input_tokens": enc}, max_decode_length=n, beam_size=beam_size, eos_id=eos_id
    ),
    static_argnums=2,
  )


def batch_shapes(feature_lengths: Mapping[str, int], batch_size: int, pack: bool) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch the steps take, as shapes: seqio.EncDecFeatureConverter's int32 features."""
  enc, dec = feature_lengths["inputs"], feature_lengths["targets"]
  lengths = {
    "encoder_input_tokens": enc,
    "decoder_target_tokens": dec,
    "decoder_input_tokens": dec,
    "decoder_loss_weights": dec,
  }
  if pack:
    lengths.update(encoder_segment_ids=enc, encoder_positions=enc, decoder_segment_ids=dec, decoder_positions=dec)
  return {k: jax.ShapeDtypeStruct((batch_size, n), jnp.int32) for k, n in lengths.items()}


# --- the initialiser's random bits on GPUs ---------------------------------------------------------------
def _rng_kernel_option():
  """jax's thread-local switch for its GPU threefry kernel (None where this jax has no such option)."""
  return getattr(jax_config, "threefry_gpu_kernel_lowering", None)


def init_rng_kernel(form: str, shardings) -> bool:
  """Whether the initialiser draws its bits with jax's threefry kernel (one custom call a draw) instead of XLA's
  inlined threefry, for `form` 'auto', 'inline' or 'kernel'.

  Inlined, every parameter's threefry stream is unrolled into XLA:GPU's fusions, which makes the initialiser slow
  to lower and compile. The kernel computes the same threefry2x32 function (jax's earlier GPU lowering), so the
  state comes out bit-identical both ways (scripts/gpu_measure.py's init_rng stage). 'auto' takes it where the
  state's `shardings` keep every value whole on each device (one device, or the data-parallel rules): XLA does
  not partition the kernel's custom call, so under sharded parameters every device would draw every parameter in
  full. It picks only the GPU lowering (CPUs and TPUs compile the same program either way); the train step
  (dropout) always keeps the inlined form."""
  if form not in INIT_RNG_FORMS:
    raise ValueError(f"init_rng={form!r}: expected one of {INIT_RNG_FORMS}")
  if form == "inline" or _rng_kernel_option() is None:
    return False
  return form == "kernel" or all(s.is_fully_replicated for s in jax.tree_util.tree_leaves(shardings))


@contextlib.contextmanager
def rng_kernel(on: bool):
  """Inside the block (this thread only), jitted code lowered for a GPU draws threefry bits with jax's kernel."""
  option = _rng_kernel_option()
  with option(True) if on and option is not None else contextlib.nullcontext():
    yield


# --- the program -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Program:
  """The jitted steps of a run, the abstract state and shardings they take, and the partitioner that placed them.
  `init_rng_kernel`: whether `init` draws its bits with jax's GPU threefry kernel (`init_rng_kernel`)."""

  model: EncoderDecoderModel
  partitioner: Partitioner
  state: TrainState  # abstract: ShapeDtypeStructs carrying their shardings
  shardings: TrainState
  batch_sharding: Any
  init: Any  # jitted make_init: rng -> TrainState in `shardings`
  init_rng_kernel: bool
  train_step: Any  # jitted make_train_step, state donated
  eval_step: Any  # jitted make_eval_step (params, batch)
  feature_lengths: Mapping[str, int]

  @property
  def mesh(self):
    return self.partitioner.mesh

  def batch(self, batch_size: int, pack: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as shapes carrying the batch's sharding (for lowering without data)."""
    return {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
      for k, v in batch_shapes(self.feature_lengths, batch_size, pack).items()
    }

  def init_state(self, seed: int) -> TrainState:
    """The initial state, created directly in its shardings (nothing is built replicated first)."""
    with rng_kernel(self.init_rng_kernel):
      return self.init(jax.random.PRNGKey(seed))

  def lower(self, step, *args):
    """`step` (one of this program's) lowered under the partitioner's activation rules (constraints placed as t5x
    does); the initialiser with its random-bit form."""
    with self.partitioner.activation_sharding(), rng_kernel(self.init_rng_kernel and step is self.init):
      return step.lower(*args)

  def compile(self, step, *args, compiler_options: dict | None = None):
    """`lower`, then XLA's compile; `compiler_options`: XLA debug options for this compile only (e.g.
    {'xla_gpu_enable_triton_gemm': False})."""
    return self.lower(step, *args).compile(compiler_options)


def build(
  model: EncoderDecoderModel,
  tx: optax.GradientTransformation,
  feature_lengths: Mapping[str, int],
  partitioner: Partitioner,
  *,
  schedule: Callable | None = None,
  num_microbatches: int | None = None,
  init_rng: str = "auto",
) -> Program:
  """The run's programs: `tx` (see `make_tx`) and its `schedule` (logged each step), gradient accumulation over
  `num_microbatches`, every array placed by `partitioner`; `init_rng` as `init_rng_kernel`."""
  abstract, shardings = abstract_state(model, tx, input_shapes(feature_lengths), partitioner)
  batch_sh = partitioner.data_sharding()
  init = jax.jit(make_init(model, tx, feature_lengths), out_shardings=shardings)
  train_step = jax.jit(
    make_train_step(model, tx, schedule, num_microbatches),
    in_shardings=(shardings, batch_sh),
    out_shardings=(shardings, None),
    donate_argnums=0,
  )
  eval_step = jax.jit(make_eval_step(model), in_shardings=(shardings.params, batch_sh))
  return Program(
    model,
    partitioner,
    abstract,
    shardings,
    batch_sh,
    init,
    init_rng_kernel(init_rng, shardings),
    train_step,
    eval_step,
    dict(feature_lengths),
  )


def from_run(training, feature_lengths: Mapping[str, int], partitioner: Partitioner, **kwargs) -> Program:
  """`build` for a run's `run_config.Training`: its model, its `tx` (`make_tx`), schedule and microbatches."""
  tx = make_tx(training.model, training.optimizer, training.learning_rate)
  return build(
    training.model,
    tx,
    feature_lengths,
    partitioner,
    schedule=training.schedule,
    num_microbatches=training.num_microbatches,
    **kwargs,
  )


def packing(model: EncoderDecoderModel, pack: bool) -> bool:
  """Whether the run's batches are packed: PACK, unless a mixer of `model` cannot mix packed examples exactly."""
  if pack and not getattr(model.module, "packable", True):
    print("packing off: a mixer of this model cannot mix packed examples exactly", flush=True)
    return False
  return pack


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
  w = max(float(sums["weight_sum"]), 1.0)
  return {
    "loss": float(sums["loss_sum"]) / w,
    "z_loss": float(sums["z_loss_sum"]) / w,
    "accuracy": float(sums["correct_sum"]) / w,
  }


def make_tx(model, optimizer=optim.adafactor, learning_rate=None) -> optax.GradientTransformation:
  """The run's `tx`: the factory `optimizer` made with `learning_rate`; scanned stacks per layer (optim.layerwise)."""
  return optim.for_model(optimizer(learning_rate=learning_rate), model.module)
