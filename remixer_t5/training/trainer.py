"""Training and evaluation loops: jit-compiled steps with NamedShardings over a device mesh.

The same code runs on one CPU and on a TPU slice: the state is created directly in its shardings, batches are
global arrays assembled from process-local data, and only process 0 writes summaries.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from remixer_t5.training import accumulate, checkpoints, optim, partitioning, plots
from remixer_t5.model import fixed_length
from remixer_t5.training import mfu as mfu_lib
from remixer_t5.model.models import EncoderDecoderModel

if TYPE_CHECKING:
  import seqio

# The data side (seqio, TensorFlow) is imported where it is used, so that compiling a step
# (`remixer-t5 compile`, remixer_t5/aot_compile.py) never loads TensorFlow.


def __getattr__(name: str):
  if name in ("get_task", "with_vocabulary"):  # trainer.get_task(...), as before the imports became lazy
    from remixer_t5.data import task_lookup
    return getattr(task_lookup, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
from remixer_t5.training.metrics_log import MetricsLogger, format_duration


# Config fields that may change between runs in one MODEL_DIR (they do not change the parameters).
_RESUMABLE_FIELDS = ("dropout_rate", "dtype", "remat_policy")


class TrainState(struct.PyTreeNode):
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


# --- data ------------------------------------------------------------------------------------------------
def get_batches(task, feature_lengths: Mapping[str, int], split: str, batch_size: int, *, seed: int,
                shuffle: bool, repeat: bool, pack: bool, skip_batches: int = 0):
  """Iterator of numpy batches in the model's feature format (t5x's EncDecFeatureConverter): this process's
  shard of the global `batch_size`; its position can be saved and restored in constant time
  (remixer_t5/data/input_pipeline.py)."""
  from remixer_t5.data import input_pipeline
  return input_pipeline.get_batches(task, feature_lengths, split, batch_size, seed=seed, shuffle=shuffle,
                                    repeat=repeat, pack=pack, skip_batches=skip_batches)


def global_from_host(x: np.ndarray, sharding) -> jax.Array:
  """A global array from a host array that every process holds in full (identical on all processes)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(array: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) global array, on every process."""
  if array.is_fully_addressable:
    return np.asarray(jax.device_get(array))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _global_batch(batch: Mapping[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def _real_tokens(batch: Mapping[str, np.ndarray]) -> int:
  return int((batch["encoder_input_tokens"] > 0).sum() + (batch["decoder_target_tokens"] > 0).sum())


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


# --- the program: one place for what `train` compiles and what `remixer-t5 compile` compiles ahead of time -
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
  """The jitted steps of a run and the abstract state and shardings they take.

  `train`, `evaluate_checkpoint` and `remixer-t5 compile` (aot_compile.py) all build it with `program`, so the
  ahead-of-time compile is of exactly the step `train` runs.
  """
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
  abstract, shardings = _abstract_state(model, tx, _input_shapes(feature_lengths), mesh)
  batch_sh = partitioning.data_sharding(mesh)
  train_step = jax.jit(make_train_step(model, tx, schedule, num_microbatches),
                       in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(model), in_shardings=(shardings.params, batch_sh))
  return Program(mesh, abstract, shardings, batch_sh, train_step, eval_step)


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
  w = max(float(sums["weight_sum"]), 1.0)
  return {"loss": float(sums["loss_sum"]) / w, "z_loss": float(sums["z_loss_sum"]) / w,
          "accuracy": float(sums["correct_sum"]) / w}


# --- the loop --------------------------------------------------------------------------------------------
def train(*, model_dir: str, model: EncoderDecoderModel, task_name: str, feature_lengths: Mapping[str, int],
          batch_size: int, train_steps: int, checkpoint_period: int = 1000, eval_period: int = 1000,
          log_period: int = 100, random_seed: int = 0, learning_rate: Callable | float | None = None,
          optimizer: Callable[..., optax.GradientTransformation] = optim.adafactor,
          eval_steps: int = 10, num_decoded_examples: int = 3, num_partitions: int = 1,
          mesh_shape: tuple[int, ...] | None = None, keep_checkpoints: int = 3, pack: bool = True,
          shuffle: bool = True, vocabulary: seqio.Vocabulary | None = None, init_checkpoint: str | None = None,
          run_signature: Mapping[str, Any] | None = None, config_text: str | None = None,
          data_dir: str | None = None, infer_eval_period: int = 0, infer_examples: int | None = None,
          infer_eval_task: str | None = None, peak_flops_per_device: float | None = None,
          num_microbatches: int | None = None
          ) -> dict[str, float]:
  """Train `model` on `task_name`, resuming from the latest good checkpoint in `model_dir`. Returns last metrics.

  `config_text` (the launch's gin config) is saved as MODEL_DIR/config.gin once the run is accepted.
  `data_dir`: local dataset release files (see remixer_t5.tasks.sources; default $REMIXER_T5_DATA_DIR).
  `infer_eval_period`: every so many steps, also decode the validation split (first `infer_examples` of each
  task) with the seqio Evaluator and log the tasks' metrics (0: never; `remixer-t5 eval` does it on demand).
  `infer_eval_task`: the task or mixture decoded there (None: `task_name`; e.g. SuperGLUE while co-training
  on mt_cotrain), in the vocabulary of the task trained on.
  `num_microbatches`: gradient accumulation (memory), same gradient as the whole batch.
  Faults: SIGTERM saves a checkpoint and returns; an unreadable latest checkpoint is reported and the previous
  one restored; a non-finite loss or update stops the run (FloatingPointError) before it is checkpointed.
  """
  if not model_dir:
    raise ValueError("MODEL_DIR is not set: pass --gin.MODEL_DIR=\"'/path/to/run'\"")
  model_dir = str(Path(model_dir).expanduser())
  _set_data_dir(data_dir)
  from remixer_t5.data.task_lookup import get_task, with_vocabulary
  task_name = with_vocabulary(task_name, vocabulary)
  task = get_task(task_name)
  vocab = task.output_features["targets"].vocabulary
  _check_vocab_fits(model, task)
  infer_task_name = with_vocabulary(infer_eval_task, vocab) if infer_eval_task else task_name
  get_task(infer_task_name)  # an unknown name fails here, not at the first evaluation
  pack = _packing(model, pack)
  signature = dict(run_signature or {})
  signature.update(task=task_name, feature_lengths=dict(feature_lengths), vocab_size=vocab.vocab_size,
                   model=type(model.module).__name__)
  if dataclasses.is_dataclass(getattr(model.module, "config", None)):
    signature.update({f"config.{k}": v for k, v in dataclasses.asdict(model.module.config).items()
                      if k not in _RESUMABLE_FIELDS})
  defaults = {}
  if dataclasses.is_dataclass(getattr(model.module, "config", None)):
    defaults = {f"config.{f.name}": f.default for f in dataclasses.fields(model.module.config)
                if f.name not in _RESUMABLE_FIELDS}
  checkpoints.check_signature(model_dir, signature, defaults)
  if config_text is not None and jax.process_index() == 0:
    checkpoints.atomic_write_text(Path(model_dir) / "config.gin", config_text)

  mesh = partitioning.make_mesh(num_partitions, mesh_shape)
  partitioning.check_batch_size(batch_size, mesh)
  schedule = learning_rate if callable(learning_rate) else None
  tx = _optimizer(model, optimizer, learning_rate)
  prog = program(model, tx, schedule, feature_lengths, mesh, num_microbatches)
  shardings = prog.shardings
  state = _init_state(model, tx, _input_shapes(feature_lengths), shardings, random_seed)
  log = MetricsLogger(model_dir)
  ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints)

  position = 0  # input batches consumed so far (the pipeline is deterministic given the seed)
  input_state = None  # this process's saved tf.data iterator state at the restored step
  restored = ckpt.restore_latest_good(_abstract(state, shardings), log=log.info)
  if restored is not None:
    state, extra, at = restored
    position = int(extra.get("data_position", {}).get("batches", int(state.step)))
    input_state = checkpoints.input_state_prefix(model_dir, at)
    log.info(f"resumed from {ckpt.directory}/{at} (input position: {position} batches)")
  elif init_checkpoint:
    fit = lambda p: _fit_lengths(model, feature_lengths, state.params, p, log)
    params = checkpoints.restore_init_params(init_checkpoint, _abstract(state.params, shardings.params), fit)
    state = state.replace(params=params)
    log.info(f"initialised params from {init_checkpoint} (fresh optimizer state and step)")
  start = int(state.step)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(state.params))
  log.info(f"model: {n_params:,} params | mesh {dict(mesh.shape)} | task {task_name} | "
           f"batch {batch_size} | lengths {dict(feature_lengths)} | steps {start}->{train_steps}")

  batch_sh, eval_step = prog.batch_sharding, prog.eval_step
  evaluate = lambda st: _evaluate(model, eval_step, st, task, vocab, feature_lengths, batch_size, eval_steps,
                                  num_decoded_examples, random_seed, pack, batch_sh, log)

  if start == 0 and eval_period:
    evaluate(state)  # the starting point of the validation curve
  batches = _restore_batches(task, feature_lengths, batch_size, random_seed, shuffle, pack, position,
                             input_state, log)
  input_checkpointable = [True]

  def save(step, state):
    # The input state first: a finalised orbax step then always has it (kill -9 between the two leaves an
    # input state without its step, which is never read).
    if input_checkpointable[0]:
      from remixer_t5.data.input_pipeline import InputNotCheckpointableError
      try:
        checkpoints.save_input_state(model_dir, step, batches.save)
      except InputNotCheckpointableError as e:  # keep training; a resume replays the position with skip
        input_checkpointable[0] = False
        log.info(str(e))
    ckpt.save(step, state, extra={"data_position": {"batches": position, "seed": random_seed, "task": task_name,
                                                    "iterator": input_checkpointable[0]}}, force=True)
    steps = ckpt.all_steps()
    checkpoints.prune_input_states(model_dir, min([*steps, step]))

  peak = mfu_lib.peak_flops_per_device(override=peak_flops_per_device)
  # MFU counts the model's FLOPs (the same whether the stack is scanned or rematerialised); HFU counts what XLA
  # compiled (recomputation included), where its count is whole (a step without while loops).
  model_flops = None
  if peak:
    model_flops, model_loops = mfu_lib.model_flops_and_loops(model, batch_shapes(feature_lengths, batch_size, pack))
    model_flops /= jax.device_count()
    if model_loops:
      log.info(f"mfu is a lower bound: the model's mixers loop ({model_loops} while loops in the step) and "
               "XLA's cost analysis counts each loop body once")
  step_flops, compiled = None, None
  last: dict[str, float] = {}
  acc_metrics, tokens, t0, steps_in_window, checked_through = None, 0, time.time(), 0, start
  run_t0 = time.time()
  step = start
  with _PreemptionWatch() as preemption:
    while step < train_steps:
      host_batch = next(batches)
      position += 1
      tokens += _real_tokens(host_batch)
      batch = _global_batch(host_batch, batch_sh)
      if compiled is None:
        compiled = prog.compile(prog.train_step, state, batch)
        # XLA's count is the step's only without loops (scanned layers, microbatches, a mixer's scans).
        step_flops = None if mfu_lib.compiled_loops(compiled) else mfu_lib.compiled_flops(compiled)
      state, metrics = compiled(state, batch)
      step += 1
      steps_in_window += 1
      acc_metrics = metrics if acc_metrics is None else jax.tree_util.tree_map(jnp.add, acc_metrics, metrics)
      due_log = step % log_period == 0 or step == train_steps
      due_save = step % checkpoint_period == 0 or step == train_steps
      # Many processes must agree on stopping (a collective): ask only where the host syncs anyway.
      stop = preemption.requested() if jax.process_count() == 1 or due_log or due_save else False
      if due_log or due_save or stop:
        m = jax.device_get(acc_metrics)
        if m["nonfinite"]:
          ckpt.close()  # finish the saves in flight: they hold good states
          raise FloatingPointError(
              f"non-finite loss or update between steps {checked_through} and {step} (loss "
              f"{float(m['loss_sum']) / max(float(m['weight_sum']), 1.0):.4g}); stopped without saving. The last "
              f"good checkpoint is {ckpt.latest_step()} in {ckpt.directory}")
        checked_through = step
      if due_log or stop:  # a preempted run logs its last, partial window too: its steps' time is counted
        dt = time.time() - t0
        row = summarize(m)
        row.update(tokens_per_s=tokens / dt, tokens_per_s_per_device=tokens / dt / jax.device_count(),
                   steps_per_s=steps_in_window / dt, window_seconds=dt,
                   grad_norm=float(m["grad_norm"]) / steps_in_window)
        for name, flops in (("mfu", model_flops), ("hfu", step_flops)):
          utilisation = mfu_lib.mfu(flops, steps_in_window / dt, peak)
          if utilisation is not None:
            row[name] = utilisation
        if "learning_rate" in m:
          row["learning_rate"] = float(m["learning_rate"]) / steps_in_window
        eta = (train_steps - step) * dt / steps_in_window
        log.write(step, "train", row, f"ETA {format_duration(eta)} (elapsed "
                  f"{format_duration(time.time() - run_t0)})")
        last = row
        acc_metrics, tokens, t0, steps_in_window = None, 0, time.time(), 0
      if stop:
        save(step, state)
        ckpt.close()
        log.info(f"preempted (SIGTERM): saved step {step} in {ckpt.directory}; rerun the same command to resume")
        log.close()
        return last
      if eval_period and (step % eval_period == 0 or step == train_steps):
        last.update({f"validation_{k}": v for k, v in evaluate(state).items()})
      if infer_eval_period and (step % infer_eval_period == 0 or step == train_steps):
        _infer_eval(model, state.params, infer_task_name, feature_lengths, batch_size, infer_examples, model_dir,
                    step, random_seed, batch_sh, log)
      if due_save:
        save(step, state)
  ckpt.close()
  log.close()
  if jax.process_index() == 0:
    log.info(f"curves drawn in {plots.plot_metrics(model_dir)}")
  return last


class _PreemptionWatch:
  """SIGTERM (a preemption notice) sets a flag the loop polls; with many processes they agree (any -> all)."""

  def __enter__(self):
    import signal
    import threading
    self._flag = False
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self._flag = True

  def requested(self) -> bool:
    if jax.process_count() == 1:
      return self._flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array(self._flag))))

  def __exit__(self, *exc):
    if self._previous is not None:
      import signal
      signal.signal(signal.SIGTERM, self._previous)
    return False


def _restore_batches(task, feature_lengths, batch_size, seed, shuffle, pack, position, input_state, log):
  """The training batches at `position`: the saved iterator state restored (constant time), else replayed
  with skip (a checkpoint from before iterator checkpoints, or a pipeline that cannot be checkpointed)."""
  from remixer_t5.data import input_pipeline
  say = log.info
  if jax.process_count() > 1:  # each process restores its own shard's position: every one reports
    say = lambda m: print(f"[process {jax.process_index()}] {m}", flush=True)
  if input_state is not None:
    batches = get_batches(task, feature_lengths, "train", batch_size, seed=seed, shuffle=shuffle, repeat=True,
                          pack=pack)
    try:
      seconds = batches.restore(input_state, position)
      say(f"input position restored from {input_state} ({position} batches) in {seconds:.2f}s")
      return batches
    except Exception as e:  # noqa: BLE001 - e.g. the task's pipeline changed since: say so, then replay
      say(f"input state {input_state} does not fit this pipeline ({type(e).__name__}: "
          f"{str(e).splitlines()[0][:200] if str(e) else ''}); replaying {position} batches with skip")
  elif position:
    say(f"no input-iterator state for this checkpoint (a run from before iterator checkpoints, a pipeline "
        f"that cannot be checkpointed, or another number of processes): replaying {position} batches with "
        f"skip, which takes time proportional to the position")
  return input_pipeline.get_batches(task, feature_lengths, "train", batch_size, seed=seed, shuffle=shuffle,
                                    repeat=True, pack=pack, skip_batches=position)


def _infer_eval(model, params, task_name, feature_lengths, batch_size, num_examples, model_dir, step, seed,
                batch_sh, log, split="validation", beam_size=1, progress=None) -> dict[str, dict[str, float]]:
  """Decode-and-score evaluation (remixer_t5.training.evaluation) logged as metrics.jsonl rows `infer/<task>`."""
  from remixer_t5.training import evaluation
  per_task = evaluation.infer_eval(
      model, params, task_name, batch_size=batch_size, feature_lengths=feature_lengths, split=split,
      num_examples=num_examples, log_dir=str(Path(model_dir) / "inference_eval"), step=step, seed=seed,
      beam_size=beam_size, put=lambda x: global_from_host(x, batch_sh), fetch=to_host, progress=progress)
  for name, metrics in per_task.items():
    log.write(step, f"infer/{name}", metrics)
  return per_task


def _packing(model: EncoderDecoderModel, pack: bool) -> bool:
  if pack and not getattr(model.module, "packable", True):
    print("packing off: a mixer of this model cannot mix packed examples exactly", flush=True)
    return False
  return pack


def _check_vocab_fits(model: EncoderDecoderModel, task) -> None:
  cfg = getattr(model.module, "config", None)
  for name, feature in task.output_features.items():
    if cfg is not None and feature.vocabulary.vocab_size > cfg.vocab_size:
      raise ValueError(f"the {name!r} vocabulary has {feature.vocabulary.vocab_size} ids but the model's "
                       f"vocab_size is {cfg.vocab_size}; use a model config with vocab_size >= "
                       f"{feature.vocabulary.vocab_size}")


def _input_shapes(feature_lengths: Mapping[str, int]) -> dict[str, tuple[int, int]]:
  return {"encoder_input_tokens": (1, feature_lengths["inputs"]),
          "decoder_input_tokens": (1, feature_lengths["targets"]),
          "decoder_target_tokens": (1, feature_lengths["targets"])}


def _abstract_state(model, tx, input_shapes, mesh) -> tuple[TrainState, TrainState]:
  """(abstract TrainState carrying its shardings, the shardings), from shapes alone."""
  abstract_vars = jax.eval_shape(lambda rng: model.init_variables(rng, input_shapes), jax.random.PRNGKey(0))
  param_sh = partitioning.param_shardings(abstract_vars["params_axes"], mesh, params=abstract_vars["params"])
  abstract_opt = jax.eval_shape(tx.init, abstract_vars["params"])
  opt_sh = partitioning.opt_state_shardings(abstract_opt, abstract_vars["params"], param_sh, mesh)
  rep = partitioning.replicated(mesh)
  shardings = TrainState(step=rep, params=param_sh, opt_state=opt_sh, rng=rep)
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_vars["params"],
                      opt_state=abstract_opt, rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)))
  return _abstract(shapes, shardings), shardings


def _create_state(model, tx, input_shapes, mesh, seed):
  """Initialise params and optimizer state directly in their shardings (nothing is built replicated)."""
  _, shardings = _abstract_state(model, tx, input_shapes, mesh)
  return _init_state(model, tx, input_shapes, shardings, seed), shardings


def _init_program(model, tx, input_shapes, shardings, seed):
  """The state's initialiser, jitted into `shardings`, and the key it takes (scripts/gpu_measure.py times its
  compile and its run apart). Lower or call it inside `init_rng_as_kernel(shardings)`, as `_init_state` does."""
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

  Inlined, every parameter's threefry stream is unrolled into XLA:GPU's fusions: deviceless for one H100 on a
  2-core host, T5.1.1-base's initialiser took 177 s to lower and compile, 14.9 s with the kernel
  (docs/benchmarks.md, "Initialising on a GPU"). The kernel computes the same threefry2x32 function (jax's
  GPU lowering before the inlined one became its default): on an H200 the tiny model's state came out
  bit-identical both ways (scripts/gpu_measure.py's init_rng stage, docs/benchmarks.md). It writes each draw's
  bits to memory before they are transformed, which costs the initialiser temporaries once, before training
  (471 MiB for T5.1.1-base on one device).

  Only where `shardings` (the state's) keep every value whole on each device: one device, or replicated
  parameters (the data-parallel rules). XLA does not partition the kernel's custom call, so under sharded
  parameters (fsdp, model rules) every device would draw every parameter in full; there, and with a jax
  without the option (its CHANGELOG says it may go), the inlined form stays. The train step (dropout) always
  keeps it; CPUs and TPUs are unaffected (the option picks only the GPU lowering). It sets jax's global
  option: not for initialisers lowered in several threads at once."""
  whole = shardings is None or all(s.is_fully_replicated for s in jax.tree_util.tree_leaves(shardings))
  try:
    was = getattr(jax.config, RNG_KERNEL_OPTION)
  except AttributeError:
    whole = False
  if not whole:
    yield
    return
  jax.config.update(RNG_KERNEL_OPTION, True)
  try:
    yield
  finally:
    jax.config.update(RNG_KERNEL_OPTION, was)


def _init_state(model, tx, input_shapes, shardings, seed):
  init, rng = _init_program(model, tx, input_shapes, shardings, seed)
  with init_rng_as_kernel(shardings):
    return init(rng)


def _fit_lengths(model, feature_lengths, fresh, params, log):
  """INIT_CHECKPOINT's fixed-length mixer matrices fitted to this run's lengths (see `fixed_length`)."""
  variables = jax.eval_shape(lambda rng: model.init_variables(rng, _input_shapes(feature_lengths)),
                             jax.random.PRNGKey(0))
  params, resized = fixed_length.fit_params(params, fresh, partitioning.logical_axes(variables["params_axes"]))
  for line in resized:
    log.info(f"INIT_CHECKPOINT resized to this run's lengths: {line}")
  return params


def _abstract(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                                shardings)


def _evaluate(model, eval_step, state, task, vocab, feature_lengths, batch_size, eval_steps,
              num_decoded_examples, seed, pack, batch_sh, log) -> dict[str, float]:
  """Loss/accuracy over the first `eval_steps` validation batches, plus a few greedy decodes."""
  sums, first = None, None
  t0 = time.time()
  for i, host_batch in enumerate(get_batches(task, feature_lengths, "validation", batch_size, seed=seed,
                                             shuffle=False, repeat=False, pack=pack)):
    if i >= eval_steps:
      break
    first = first if first is not None else host_batch
    m = eval_step(state.params, _global_batch(host_batch, batch_sh))
    sums = m if sums is None else jax.tree_util.tree_map(jnp.add, sums, m)
  if sums is None:
    raise ValueError(f"the validation split of {task.name!r} gave no full batch of {batch_size}; lower "
                     "BATCH_SIZE or TASK_FEATURE_LENGTHS")
  row = summarize(jax.device_get(sums))
  examples = (_decode_examples(model, state.params, first, vocab, num_decoded_examples, pack, batch_sh.mesh)
              if num_decoded_examples else [])
  row["eval_seconds"] = time.time() - t0
  log.write(int(state.step), "validation", row, examples=examples)
  return {k: v for k, v in row.items() if k in ("loss", "accuracy")}


def _decode_examples(model, params, batch, vocab, n, pack, mesh):
  """Greedy decodes of the first `n` validation examples (unpacked: the first segment of each row)."""
  enc, tgt = batch["encoder_input_tokens"][:n], batch["decoder_target_tokens"][:n]
  if pack:  # keep only each row's first example so the decode sees what a user would feed it
    enc = np.where(batch["encoder_segment_ids"][:n] == 1, enc, 0)
    tgt = np.where(batch["decoder_segment_ids"][:n] == 1, tgt, 0)
  if jax.process_count() > 1:  # every process decodes process 0's rows (their local batches differ)
    from jax.experimental import multihost_utils
    enc, tgt = multihost_utils.broadcast_one_to_all((enc, tgt))
  replicated = partitioning.replicated(mesh)
  preds = to_host(_jit_predict(model)(params, {"encoder_input_tokens": global_from_host(enc, replicated)},
                                      tgt.shape[-1]))
  out = []
  for e, t, p in zip(enc, tgt, preds):
    out.append({"inputs": vocab.decode(_strip(e)), "targets": vocab.decode(_strip(t)),
                "prediction": vocab.decode(_strip(p))})
  return out


@functools.lru_cache(maxsize=4)
def _jit_predict(model):
  return jax.jit(lambda p, b, n: model.predict_batch(p, b, max_decode_length=n), static_argnums=2)


def _strip(ids) -> list[int]:
  ids = [int(i) for i in ids]
  if 1 in ids:
    ids = ids[:ids.index(1)]
  return [i for i in ids if i > 0]


def evaluate_checkpoint(*, model_dir: str, model: EncoderDecoderModel, task_name: str,
                        feature_lengths: Mapping[str, int], batch_size: int, random_seed: int = 0,
                        eval_steps: int = 10, num_decoded_examples: int = 3, pack: bool = True,
                        vocabulary: seqio.Vocabulary | None = None, num_partitions: int = 1,
                        mesh_shape: tuple[int, ...] | None = None, checkpoint_step: int | None = None,
                        learning_rate: Callable | float | None = None,
                        optimizer: Callable[..., optax.GradientTransformation] = optim.adafactor,
                        infer: bool | None = None, infer_split: str = "validation",
                        infer_examples: int | None = None, beam_size: int = 1, data_dir: str | None = None,
                        infer_task: str | None = None) -> dict[str, Any]:
  """Restore a checkpoint from `model_dir`; evaluate loss/accuracy on the validation split (metrics.jsonl rows)
  and, with `infer` (default: when the task has metrics), decode `infer_split` with the seqio Evaluator and
  score it with each task's metrics (MODEL_DIR/inference_eval/: JSON and TensorBoard; metrics.jsonl rows
  `infer/<task>`). Returns {"validation": {...}, "<task>": {metric: value}, ...}. `infer_task`: the task or
  mixture decoded (None: `task_name`), in `task_name`'s vocabulary.
  """
  _set_data_dir(data_dir)
  import seqio
  from remixer_t5.data.task_lookup import get_task, with_vocabulary
  task_name = with_vocabulary(task_name, vocabulary)
  task = get_task(task_name)
  vocab = task.output_features["targets"].vocabulary
  pack = _packing(model, pack)
  mesh = partitioning.make_mesh(num_partitions, mesh_shape)
  partitioning.check_batch_size(batch_size, mesh)
  ckpt = checkpoints.Checkpointer(model_dir)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt.directory}; train first or pass the right MODEL_DIR")
  prog = program(model, _optimizer(model, optimizer, learning_rate), None, feature_lengths, mesh)
  state, _ = ckpt.restore(prog.state, checkpoint_step)
  ckpt.close()
  batch_sh, eval_step = prog.batch_sharding, prog.eval_step
  log = MetricsLogger(model_dir)
  try:
    results: dict[str, Any] = {"validation": _evaluate(
        model, eval_step, state, task, vocab, feature_lengths, batch_size, eval_steps, num_decoded_examples,
        random_seed, pack, batch_sh, log)}
    infer_name = with_vocabulary(infer_task, vocab) if infer_task else task_name
    infer_of = get_task(infer_name)
    if infer is None:
      infer = any(t.metric_fns for t in (infer_of.tasks if isinstance(infer_of, seqio.Mixture) else [infer_of]))
    if infer:
      results.update(_infer_eval(model, state.params, infer_name, feature_lengths, batch_size, infer_examples,
                                 model_dir, int(state.step), random_seed, batch_sh, log, infer_split, beam_size,
                                 log.info))
    return results
  finally:
    log.close()


def _optimizer(model, optimizer, learning_rate) -> optax.GradientTransformation:
  """The run's optimizer; a scanned model's stacked layers are optimised layer by layer (optim.layerwise)."""
  return optim.for_model(optimizer(learning_rate=learning_rate), model.module)


def _set_data_dir(data_dir: str | None) -> None:
  if data_dir is not None:
    from remixer_t5.tasks import sources
    sources.set_data_dir(data_dir)
