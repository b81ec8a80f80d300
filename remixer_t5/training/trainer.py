"""The trainer: `train` (a run's setup and restore, the loop, its evaluation and checkpoint hooks) and
`evaluate_checkpoint`, both gin-configured entry points of `remixer-t5 train` / `eval`.

The same code runs on one CPU and on a TPU slice: the state is created directly in its shardings
(train_state.py), batches are global arrays assembled from process-local data (batches.py), the steps are
programs.py's, evaluation validation.py's, and only process 0 writes summaries.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from remixer_t5.model.models import EncoderDecoderModel
from remixer_t5.training import checkpoints, optim, partitioning, plots, programs, validation
from remixer_t5.training import mfu as mfu_lib
from remixer_t5.training.batches import get_batches, global_batch, real_tokens
from remixer_t5.training.programs import batch_shapes, program, summarize
from remixer_t5.training.train_state import abstract, fit_lengths, init_state, input_shapes

if TYPE_CHECKING:
  import seqio

# The data side (seqio, TensorFlow) is imported where it is used, so that compiling a step
# (`remixer-t5 compile`, remixer_t5/aot_compile.py) never loads TensorFlow.


from remixer_t5.training.metrics_log import MetricsLogger, format_duration


# Config fields that may change between runs in one MODEL_DIR (they do not change the parameters).
_RESUMABLE_FIELDS = ("dropout_rate", "dtype", "remat_policy")


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
  pack = packing(model, pack)
  _accept_run(model_dir, model, task_name, feature_lengths, vocab, run_signature, config_text)

  mesh = partitioning.make_mesh(num_partitions, mesh_shape)
  partitioning.check_batch_size(batch_size, mesh)
  schedule = learning_rate if callable(learning_rate) else None
  tx = programs.optimizer(model, optimizer, learning_rate)
  prog = program(model, tx, schedule, feature_lengths, mesh, num_microbatches)
  shardings = prog.shardings
  state = init_state(model, tx, input_shapes(feature_lengths), shardings, random_seed)
  log = MetricsLogger(model_dir)
  ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints)

  state, position, input_state = _restore(ckpt, state, shardings, model, feature_lengths, init_checkpoint,
                                          model_dir, log)
  start = int(state.step)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(state.params))
  log.info(f"model: {n_params:,} params | mesh {dict(mesh.shape)} | task {task_name} | "
           f"batch {batch_size} | lengths {dict(feature_lengths)} | steps {start}->{train_steps}")

  batch_sh, eval_step = prog.batch_sharding, prog.eval_step
  evaluate = lambda st: validation.evaluate(model, eval_step, st, task, vocab, feature_lengths, batch_size, eval_steps,
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
      tokens += real_tokens(host_batch)
      batch = global_batch(host_batch, batch_sh)
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
        row = _window_row(m, tokens, steps_in_window, dt, {"mfu": model_flops, "hfu": step_flops}, peak)
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
        validation.infer_eval(model, state.params, infer_task_name, feature_lengths, batch_size, infer_examples, model_dir,
                    step, random_seed, batch_sh, log)
      if due_save:
        save(step, state)
  ckpt.close()
  log.close()
  if jax.process_index() == 0:
    log.info(f"curves drawn in {plots.plot_metrics(model_dir)}")
  return last



def _window_row(m, tokens: int, steps: int, seconds: float, flops: Mapping[str, float | None], peak) -> dict:
  """A log window's metrics.jsonl row: the summed step metrics averaged, throughput, and each utilisation
  (`mfu` from the model's FLOPs, `hfu` from what XLA compiled) where its FLOPs and the peak are known."""
  row = summarize(m)
  row.update(tokens_per_s=tokens / seconds, tokens_per_s_per_device=tokens / seconds / jax.device_count(),
             steps_per_s=steps / seconds, window_seconds=seconds, grad_norm=float(m["grad_norm"]) / steps)
  for name, count in flops.items():
    utilisation = mfu_lib.mfu(count, steps / seconds, peak)
    if utilisation is not None:
      row[name] = utilisation
  if "learning_rate" in m:
    row["learning_rate"] = float(m["learning_rate"]) / steps
  return row


def _accept_run(model_dir, model, task_name, feature_lengths, vocab, run_signature, config_text) -> None:
  """MODEL_DIR's run signature checked against this launch (a second `train` must match the first in what
  shapes the parameters and the data), then the launch's gin config saved as MODEL_DIR/config.gin."""
  signature = dict(run_signature or {})
  signature.update(task=task_name, feature_lengths=dict(feature_lengths), vocab_size=vocab.vocab_size,
                   model=type(model.module).__name__)
  defaults = {}
  if dataclasses.is_dataclass(getattr(model.module, "config", None)):
    signature.update({f"config.{k}": v for k, v in dataclasses.asdict(model.module.config).items()
                      if k not in _RESUMABLE_FIELDS})
    defaults = {f"config.{f.name}": f.default for f in dataclasses.fields(model.module.config)
                if f.name not in _RESUMABLE_FIELDS}
  checkpoints.check_signature(model_dir, signature, defaults)
  if config_text is not None and jax.process_index() == 0:
    checkpoints.atomic_write_text(Path(model_dir) / "config.gin", config_text)


def _restore(ckpt, state, shardings, model, feature_lengths, init_checkpoint, model_dir, log):
  """(state, input batches consumed, this process's saved iterator state or None): the latest good checkpoint,
  else INIT_CHECKPOINT's parameters (fitted to this run's lengths) with a fresh optimizer, else `state`."""
  restored = ckpt.restore_latest_good(abstract(state, shardings), log=log.info)
  if restored is not None:
    state, extra, at = restored
    position = int(extra.get("data_position", {}).get("batches", int(state.step)))
    log.info(f"resumed from {ckpt.directory}/{at} (input position: {position} batches)")
    return state, position, checkpoints.input_state_prefix(model_dir, at)
  if init_checkpoint:
    fit = lambda p: fit_lengths(model, feature_lengths, state.params, p, log)
    params = checkpoints.restore_init_params(init_checkpoint, abstract(state.params, shardings.params), fit)
    state = state.replace(params=params)
    log.info(f"initialised params from {init_checkpoint} (fresh optimizer state and step)")
  return state, 0, None

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


def packing(model: EncoderDecoderModel, pack: bool) -> bool:
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
  pack = packing(model, pack)
  mesh = partitioning.make_mesh(num_partitions, mesh_shape)
  partitioning.check_batch_size(batch_size, mesh)
  ckpt = checkpoints.Checkpointer(model_dir)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt.directory}; train first or pass the right MODEL_DIR")
  prog = program(model, programs.optimizer(model, optimizer, learning_rate), None, feature_lengths, mesh)
  state, _ = ckpt.restore(prog.state, checkpoint_step)
  ckpt.close()
  batch_sh, eval_step = prog.batch_sharding, prog.eval_step
  log = MetricsLogger(model_dir)
  try:
    results: dict[str, Any] = {"validation": validation.evaluate(
        model, eval_step, state, task, vocab, feature_lengths, batch_size, eval_steps, num_decoded_examples,
        random_seed, pack, batch_sh, log)}
    infer_name = with_vocabulary(infer_task, vocab) if infer_task else task_name
    infer_of = get_task(infer_name)
    if infer is None:
      infer = any(t.metric_fns for t in (infer_of.tasks if isinstance(infer_of, seqio.Mixture) else [infer_of]))
    if infer:
      results.update(validation.infer_eval(model, state.params, infer_name, feature_lengths, batch_size, infer_examples,
                                 model_dir, int(state.step), random_seed, batch_sh, log, infer_split, beam_size,
                                 log.info))
    return results
  finally:
    log.close()


def _set_data_dir(data_dir: str | None) -> None:
  if data_dir is not None:
    from remixer_t5.tasks import sources
    sources.set_data_dir(data_dir)
