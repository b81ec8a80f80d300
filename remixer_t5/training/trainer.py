"""The trainer: `train` (a run's setup and restore, the loop, its log, evaluation and checkpoint hooks) and
`evaluate_checkpoint`, both gin-configured entry points of `remixer-t5 train` / `eval`.

The same code runs on one CPU and on a TPU slice: the state is created directly in its shardings
(train_state.py), batches are global arrays assembled from process-local data (batches.py), the steps are
programs.py's, evaluation validation.py's, and only process 0 writes summaries. It imports the data side (seqio,
TensorFlow); `remixer-t5 compile` builds the same steps from programs.py without it.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import seqio
from jax.experimental import multihost_utils

from remixer_t5 import storage
from remixer_t5.data.input_pipeline import InputNotCheckpointableError, get_batches
from remixer_t5.model.models import EncoderDecoderModel
from remixer_t5.training import best, checkpoints, partitioning, plots, profiling, programs, run_identity
from remixer_t5.training import run_lock
from remixer_t5.training import time_split, validation
from remixer_t5.training import mfu as mfu_lib
from remixer_t5.training.batches import global_batch, real_tokens
from remixer_t5.training.metrics_log import MetricsLogger, current_rows, format_duration, read_rows
from remixer_t5.training.programs import batch_shapes, summarize
from remixer_t5.training.run_config import Run
from remixer_t5.tasks import sources
from remixer_t5.tasks.lookup import get_task, with_vocabulary
from remixer_t5.training.train_state import fit_lengths


def train(run: Run, *, config_text: str | None = None) -> dict[str, float]:
  """Train `run` (run_config.Run), resuming from the latest good checkpoint in its MODEL_DIR. Returns the last
  train row's metrics.

  MODEL_DIR holds one run: a launch whose identity (run_identity.py) differs from the one recorded there is
  refused before anything in the folder changes, and a second launch while one runs is refused by the lock
  (run_lock.py). `config_text` (the launch's gin config) is saved as MODEL_DIR/config.gin once the run is
  accepted. Faults: SIGTERM or Ctrl-C save a checkpoint and return (a second Ctrl-C aborts); an unreadable
  latest checkpoint is reported and the previous one restored; a failed checkpoint save stops the run
  (StorageError); a non-finite loss or update stops it (FloatingPointError) before it is checkpointed."""
  run, task, vocab, infer_task = _setup(run, check_init=True)
  prog = _program(run)
  ident = run_identity.identity(run, vocab, prog.state, run.data.feature_lengths)
  run_identity.check(run.model_dir, ident)  # read only: a refused launch leaves the folder as it was
  lock = _lock(run.model_dir)
  ckpt = log = None
  try:
    new = run_identity.check(run.model_dir, ident)  # again, holding the lock: a launch may have ended meanwhile
    storage.probe_writes(run.model_dir)
    if jax.process_index() == 0:
      if new:
        run_identity.write(run.model_dir, ident)
      if config_text is not None:
        storage.write_text(run.model_dir / "config.gin", config_text)
    log = MetricsLogger(run.model_dir)
    ckpt = checkpoints.Checkpointer(
      run.model_dir, keep=run.schedule.keep_checkpoints, keep_best=run.schedule.keep_best_by is not None
    )
    with _StopWatch(lock) as stop:  # a signal while restoring or compiling stops after the first step
      state, position, input_state, best_state = _restore(ckpt, prog, run, log)
      log.start(int(state.step))
      sched = run.schedule
      keeper = (
        best.Keeper(sched.keep_best_by, sched.early_stop_patience, sched.early_stop_min_delta, best_state)
        if sched.keep_best_by
        else None
      )
      return _loop(run, prog, state, task, vocab, infer_task, ckpt, log, position, input_state, stop, keeper)
  finally:
    _close(ckpt, log)
    if lock is not None:
      lock.release()


def _lock(model_dir):
  """The run's lock, held by process 0 for all; every process refuses when it is held elsewhere."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = run_lock.acquire(model_dir)
    except run_lock.RunLockedError as e:
      error = e
  if jax.process_count() > 1:
    refused = bool(multihost_utils.broadcast_one_to_all(np.array(error is not None)))
    if refused and error is None:
      raise run_lock.RunLockedError(f"MODEL_DIR {model_dir} is in use by another run (process 0 says which)")
  if error is not None:
    raise error
  return lock


def _close(ckpt, log) -> None:
  """Finishes the checkpoint in flight and the logs, whatever ended the run (after an exception, the
  exception is the one reported)."""
  failing = sys.exc_info()[0] is not None
  for closer in (ckpt, log):
    if closer is None:
      continue
    try:
      closer.close()
    except Exception:  # noqa: BLE001
      if not failing:
        raise


def _setup(run: Run, check_init: bool = False):
  """(`run` with its MODEL_DIR as a run path and packing as the model allows, the task, its targets vocabulary, the name
  of the task inference evaluation decodes); the bucket checks and the vocabulary's fit, before any compile."""
  if not run.model_dir:
    raise ValueError("MODEL_DIR is not set: pass --gin.MODEL_DIR=\"'/path/to/run'\"")
  storage.check_bucket(run.model_dir)
  if check_init and run.training.init_checkpoint:
    storage.check_bucket(run.training.init_checkpoint, "INIT_CHECKPOINT")
  data = run.data
  task_name, task, vocab, infer_task = task_and_vocabulary(
    data.task, data.vocabulary, data.data_dir, run.schedule.infer_eval_task
  )
  _check_vocab_fits(run.training.model, task)
  data = dataclasses.replace(data, task=task_name, pack=programs.packing(run.training.model, data.pack))
  return dataclasses.replace(run, data=data), task, vocab, infer_task


def _program(run: Run) -> programs.Program:
  """The run's programs, on the mesh its `Training.mesh` describes over every device."""
  part = partitioning.partitioner(run.training.mesh)
  part.check_batch_size(run.data.batch_size)
  return programs.from_run(run.training, run.data.feature_lengths, part)


def eval_program(run: Run) -> programs.Program:
  """The run's programs for evaluation and inference: no learning rate (no schedule is traced)."""
  return _program(dataclasses.replace(run, training=dataclasses.replace(run.training, learning_rate=None)))


def _loop(
  run, prog, state, task, vocab, infer_task, ckpt, log, position, input_state, stop, keeper
) -> dict[str, float]:
  """The training loop from `state` to TRAIN_STEPS with its log, evaluation and checkpoint hooks."""
  data, sched, model_dir = run.data, run.schedule, run.model_dir
  step = int(state.step)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(state.params))
  log.info(
    f"model: {n_params:,} params | mesh {dict(prog.mesh.shape)} | task {data.task} | "
    f"batch {data.batch_size} | lengths {dict(data.feature_lengths)} | steps {step}->{sched.train_steps}"
  )
  evaluate = lambda st: validation.evaluate(prog, st, task, vocab, run, log)
  if step == 0 and sched.eval_period:
    evaluate(state)  # the starting point of the validation curve
  batches = _restore_batches(task, run, position, input_state, log)
  data_position = {"batches": position, "seed": run.training.random_seed, "task": data.task, "iterator": True}
  window = _LogWindow(
    prog.model,
    batch_shapes(data.feature_lengths, data.batch_size, data.pack),
    run.training.peak_flops_per_device,
    step,
    log,
  )
  profiler = profiling.StepProfiler(model_dir, sched.profile_steps, log.info)
  timed = window.split
  compiled, last, preempted, early_stop = None, {}, None, False
  while step < sched.train_steps:
    with timed("input"):
      host_batch = next(batches)
      batch = global_batch(host_batch, prog.batch_sharding)
    data_position["batches"] += 1
    if compiled is None:
      with timed("compile"):
        compiled = window.note_compiled(prog.compile(prog.train_step, state, batch))
    profiler.before(step + 1)
    with timed("step"), profiling.annotate(step + 1):
      state, metrics = compiled(state, batch)
    step += 1
    profiler.after(step, metrics)
    with timed("checkpoint"):
      ckpt.check()  # a background save that failed stops the run now, not at the next save
    window.add(metrics, real_tokens(host_batch))
    due = lambda period: step % period == 0 or step == sched.train_steps
    due_log, due_save = due(sched.log_period), due(sched.checkpoint_period)
    # Many processes must agree on stopping (a collective): ask only where the host syncs anyway.
    preempted = stop.requested() if jax.process_count() == 1 or due_log or due_save else None
    if due_log or due_save or preempted:
      window.check_finite(step, ckpt)
    if due_log or preempted:  # a stopped run logs its last, partial window too: its steps' time is counted
      last = window.write(step, sched.train_steps)
      profiler.poll(step)
    save = lambda: _save(model_dir, ckpt, step, state, batches, data_position, log, keeper, sched.keep_checkpoints)
    if preempted:
      save()
      break
    values = {}  # this step's evaluation results, as 'validation/loss', '<task>/<metric>'
    if sched.eval_period and due(sched.eval_period):
      with timed("eval"):
        result = evaluate(state)
      last.update({f"validation_{k}": v for k, v in result.items()})
      values.update({f"validation/{k}": v for k, v in result.items()})
    if sched.infer_eval_period and due(sched.infer_eval_period):
      with timed("eval"):
        result = validation.infer_eval(prog, state.params, run, infer_task, step, log)
      values.update({f"{name}/{k}": v for name, metrics in result.items() for k, v in metrics.items()})
    improved, early_stop = keeper.observe(step, values) if keeper is not None and values else (False, False)
    if due_save or improved or early_stop:
      with timed("checkpoint"):
        save()
        if improved:  # recorded once the step is whole
          ckpt.wait()
          if jax.process_index() == 0:
            best.record(model_dir, keeper)
    if early_stop:
      break
  profiler.close()
  ckpt.close()
  _report_super_glue(model_dir, step, log)
  log.close()
  if preempted:
    log.info(f"{preempted}: saved step {step} in {ckpt.directory}; rerun the same command to resume")
  elif keeper is not None and early_stop:
    log.info(f"{keeper.stop_message()}; saved step {step} in {ckpt.directory}")
  elif jax.process_index() == 0:
    log.info(f"curves drawn in {plots.plot_metrics(model_dir)}")
  return last


class _LogWindow:
  """The steps since the last train row: their summed metrics, real tokens and time, and the FLOPs that make
  steps/s a utilisation. `mfu` counts the model's FLOPs (the same whether the stack is scanned or
  rematerialised); `hfu` what XLA compiled (recomputation included), where its count is whole (no while loops)."""

  def __init__(self, model, batch, peak_flops_per_device, start: int, log):
    self.log, self.checked_through = log, start
    self.peak = mfu_lib.peak_flops_per_device(override=peak_flops_per_device)
    self.flops = {"mfu": None, "hfu": None}
    if self.peak:
      model_flops, model_loops = mfu_lib.model_flops_and_loops(model, batch)
      self.flops["mfu"] = model_flops / jax.device_count()
      if model_loops:
        log.info(
          f"mfu is a lower bound: the model's mixers loop ({model_loops} while loops in the step) and "
          "XLA's cost analysis counts each loop body once"
        )
    self.sums, self.tokens, self.steps = None, 0, 0
    self.split = time_split.TimeSplit()
    self.run_t0 = time.time()

  def note_compiled(self, compiled):
    # XLA's count is the step's only without loops (scanned layers, microbatches, a mixer's scans).
    self.flops["hfu"] = None if mfu_lib.compiled_loops(compiled) else mfu_lib.compiled_flops(compiled)
    return compiled

  def add(self, metrics, tokens: int) -> None:
    self.sums = metrics if self.sums is None else jax.tree_util.tree_map(jnp.add, self.sums, metrics)
    self.tokens += tokens
    self.steps += 1

  def check_finite(self, step: int, ckpt) -> None:
    """Fetches the window's sums (the loop's wait for its steps: step time); a non-finite loss or update since
    the last check stops the run unsaved."""
    with self.split("step"):
      self.host = m = jax.device_get(self.sums)
    if m["nonfinite"]:
      ckpt.close()  # finish the saves in flight: they hold good states
      raise FloatingPointError(
        f"non-finite loss or update between steps {self.checked_through} and {step} (loss "
        f"{float(m['loss_sum']) / max(float(m['weight_sum']), 1.0):.4g}); stopped without saving. "
        + (
          f"The last good checkpoint is {ckpt.latest_step()} in {ckpt.directory}"
          if ckpt.latest_step() is not None
          else f"No checkpoint was saved before it ({ckpt.directory} is empty)"
        )
      )
    self.checked_through = step

  def write(self, step: int, train_steps: int) -> dict:
    """The window's metrics.jsonl row (summed step metrics averaged, throughput, utilisation), logged with the
    run's ETA; the window then starts again."""
    m, steps, split = self.host, self.steps, self.split.row()
    seconds = split["window_seconds"]
    row = summarize(m)
    row.update(
      tokens_per_s=self.tokens / seconds,
      tokens_per_s_per_device=self.tokens / seconds / jax.device_count(),
      steps_per_s=steps / seconds,
      grad_norm=float(m["grad_norm"]) / steps,
      **split,
    )
    for name, count in self.flops.items():
      utilisation = mfu_lib.mfu(count, steps / seconds, self.peak)
      if utilisation is not None:
        row[name] = utilisation
    if "learning_rate" in m:
      row["learning_rate"] = float(m["learning_rate"]) / steps
    eta = (train_steps - step) * seconds / steps
    self.log.write(
      step,
      "train",
      row,
      f"{time_split.summary(split)} | ETA {format_duration(eta)} (elapsed "
      f"{format_duration(time.time() - self.run_t0)})",
    )
    self.sums, self.tokens, self.steps = None, 0, 0
    self.split.reset()
    return row


def _report_super_glue(model_dir, step: int, log) -> None:
  """T5's SuperGLUE protocol (training/best.py) from the run's infer rows, as a row and a line, when it has all
  8 tasks."""
  if jax.process_index() != 0 or not log.path.exists():
    return
  report = best.super_glue_protocol(current_rows(read_rows(log.path)))
  if report is not None:
    log.write(step, "infer/super_glue_t5_protocol", report)
    log.info(
      f"SuperGLUE, T5's protocol: {report['score']:.2f} (each task at its best checkpoint), single best "
      f"checkpoint {report['single_best_score']:.2f} (step {report['single_best_step']})"
    )


def _save(model_dir, ckpt, step: int, state, batches, data_position: dict, log, keeper=None, keep=None) -> None:
  """Checkpoints `step` with its input position: this process's iterator state first, so that a finalised orbax
  step always has it (kill -9 between the two leaves an input state without its step, which is never read).
  With a best-checkpoint `keeper` its state goes into the step and keep-N spares the best step."""
  if ckpt.pending == step or step in ckpt.all_steps():
    return  # saved at this step already
  if data_position["iterator"]:
    try:
      checkpoints.save_input_state(model_dir, step, batches.save)
    except InputNotCheckpointableError as e:  # keep training; a resume replays the position with skip
      data_position["iterator"] = False
      log.info(str(e))
    except Exception as e:  # noqa: BLE001 - TensorFlow's and the file system's errors: one line, the cause
      raise storage.StorageError(
        f"checkpoint {ckpt.directory / str(step)} could not be written (its input "
        f"position): {checkpoints.storage_cause(e)}"
      ) from e
  extra = {"data_position": dict(data_position)}
  if keeper is not None:
    extra["best"] = keeper.state()
  ckpt.save(step, state, extra=extra, force=True)
  if keeper is not None:
    ckpt.prune(keep, protected={keeper.best_step})
  checkpoints.prune_input_states(model_dir, {*ckpt.all_steps(), step})


def task_and_vocabulary(task_name, vocabulary, data_dir, infer_task):
  """(name, task, targets vocabulary, name of the task decoded by inference evaluation): `vocabulary` swaps the
  task's (tasks/lookup.py), `data_dir` is where local dataset files are read (tasks/sources.py)."""
  if data_dir is not None:
    sources.set_data_dir(data_dir)
  task_name = with_vocabulary(task_name, vocabulary)
  task = get_task(task_name)
  vocab = task.output_features["targets"].vocabulary
  infer_name = with_vocabulary(infer_task, vocab) if infer_task else task_name
  get_task(infer_name)  # an unknown name fails here, not at the first evaluation
  return task_name, task, vocab, infer_name


def _restore(ckpt, prog, run, log):
  """(state, input batches consumed, this process's saved iterator state or None, the best-checkpoint keeper's
  saved state or None): the latest good checkpoint, else INIT_CHECKPOINT's parameters (fitted to this run's
  lengths) with a fresh optimizer, else a new state."""
  restored = ckpt.restore_latest_good(prog.state, log=log.info)
  if restored is not None:
    state, extra, at = restored
    position = int(extra.get("data_position", {}).get("batches", int(state.step)))
    log.info(f"resumed from {ckpt.directory}/{at} (input position: {position} batches)")
    return state, position, checkpoints.input_state_prefix(run.model_dir, at), extra.get("best")
  state = prog.init_state(run.training.random_seed)
  init_checkpoint = run.training.init_checkpoint
  if init_checkpoint:
    fit = lambda p: fit_lengths(prog.model, run.data.feature_lengths, state.params, p, log)
    params = checkpoints.restore_init_params(init_checkpoint, prog.state.params, fit)
    state = state.replace(params=params)
    log.info(f"initialised params from {init_checkpoint} (fresh optimizer state and step)")
  return state, 0, None, None


class _StopWatch:
  """SIGTERM (a preemption notice) and Ctrl-C (SIGINT) set a flag the loop polls at step boundaries, where the
  run then saves and returns; a second Ctrl-C aborts at once (KeyboardInterrupt). A lock that is no longer this
  run's stops it unsaved (run_lock.RunLockLostError). With many processes they agree (any -> all)."""

  SIGNALS = {signal.SIGTERM: "preempted (SIGTERM)", signal.SIGINT: "interrupted (Ctrl-C)"}

  def __init__(self, lock):
    self.lock, self.reason, self.previous = lock, None, {}

  def _handle(self, signum, _frame):
    if signum == signal.SIGINT and self.reason is not None:
      raise KeyboardInterrupt  # the second Ctrl-C
    self.reason = self.SIGNALS[signum]
    if signum == signal.SIGINT:
      print(
        "\ninterrupted: saving at the end of this step, then stopping (Ctrl-C again to abort without saving)",
        flush=True,
      )

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def requested(self) -> str | None:
    """Why the run stops here (a signal's name), or None; RunLockLostError when the lock was lost."""
    lost = self.lock is not None and self.lock.lost is not None
    if jax.process_count() > 1:
      flags = multihost_utils.process_allgather(np.array([self.reason is not None, lost]))
      any_stop, lost = bool(np.any(flags[..., 0])), bool(np.any(flags[..., 1]))
      if any_stop and self.reason is None:
        self.reason = "preempted (another process was signalled)"
    if lost:
      if self.lock is not None:
        self.lock.check()
      raise run_lock.RunLockLostError("stopped: process 0 lost the run's lock; this run writes nothing more")
    return self.reason

  def __exit__(self, *exc):
    for s, previous in self.previous.items():
      signal.signal(s, previous)


def _restore_batches(task, run: Run, position: int, input_state, log):
  """The training batches at `position`: the saved iterator state restored (constant time), else replayed
  with skip (a checkpoint from before iterator checkpoints, or a pipeline that cannot be checkpointed)."""
  data = run.data
  batches_at = lambda skip=0: get_batches(
    task,
    data.feature_lengths,
    "train",
    data.batch_size,
    seed=run.training.random_seed,
    shuffle=data.shuffle,
    repeat=True,
    pack=data.pack,
    skip_batches=skip,
  )
  say = log.info
  if jax.process_count() > 1:  # each process restores its own shard's position: every one reports
    say = lambda m: print(f"[process {jax.process_index()}] {m}", flush=True)
  if input_state is not None:
    batches = batches_at()
    try:
      with tempfile.TemporaryDirectory(prefix="remixer_t5-input-state-") as staging:  # a bucket's copied here
        seconds = batches.restore(checkpoints.local_input_state(input_state, staging), position)
      say(f"input position restored from {input_state} ({position} batches) in {seconds:.2f}s")
      return batches
    except Exception as e:  # noqa: BLE001 - e.g. the task's pipeline changed since: say so, then replay
      say(
        f"input state {input_state} does not fit this pipeline ({type(e).__name__}: "
        f"{str(e).splitlines()[0][:200] if str(e) else ''}); replaying {position} batches with skip"
      )
  elif position:
    say(
      f"no input-iterator state for this checkpoint (a run from before iterator checkpoints, a pipeline "
      f"that cannot be checkpointed, or another number of processes): replaying {position} batches with "
      f"skip, which takes time proportional to the position"
    )
  return batches_at(position)


def _check_vocab_fits(model: EncoderDecoderModel, task) -> None:
  cfg = getattr(model.module, "config", None)
  for name, feature in task.output_features.items():
    if cfg is not None and feature.vocabulary.vocab_size > cfg.vocab_size:
      raise ValueError(
        f"the {name!r} vocabulary has {feature.vocabulary.vocab_size} ids but the model's "
        f"vocab_size is {cfg.vocab_size}; use a model config with vocab_size >= "
        f"{feature.vocabulary.vocab_size}"
      )


def _restore_for_eval(model_dir: storage.Path, prog: programs.Program, step: int | None):
  """The state to evaluate: a training checkpoint's (the latest or `step`), else MODEL_DIR's parameters alone
  at step 0 (the optimizer state is never read by evaluation)."""
  if (model_dir / "checkpoints").is_dir():
    ckpt = checkpoints.Checkpointer(model_dir)
    try:
      if ckpt.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt.directory}; train first or pass the right MODEL_DIR")
      return ckpt.restore(prog.state, step)[0]
    finally:
      ckpt.close()
  if step is not None:
    raise FileNotFoundError(f"checkpoint_step={step}: {model_dir} has no training checkpoints (checkpoints/)")
  params = checkpoints.restore_init_params(model_dir, prog.state.params, what="MODEL_DIR")
  return prog.state.replace(params=params, step=0)


def evaluate_checkpoint(
  run: Run,
  *,
  checkpoint_step: int | None = None,
  infer: bool | None = None,
  infer_split: str = "validation",
  beam_size: int = 1,
) -> dict[str, Any]:
  """Restore a checkpoint of `run` (the latest, or `checkpoint_step`); evaluate loss/accuracy on the validation
  split (metrics.jsonl rows) and, with `infer` (default: when the task has metrics), decode `infer_split` of
  `Schedule.infer_eval_task` (None: the task trained on) with the seqio Evaluator, in the trained task's
  vocabulary, and score it with each task's metrics (MODEL_DIR/inference_eval/: JSON and TensorBoard;
  metrics.jsonl rows `infer/<task>`). Returns {"validation": {...}, "<task>": {metric: value}, ...}.
  A MODEL_DIR without training checkpoints is read as parameters alone (`checkpoints.restore_any_params`: an
  `import-hf` output, a t5x checkpoint), scored as step 0: zero-shot evaluation of an imported model."""
  run, task, vocab, infer_name = _setup(run)
  prog = eval_program(run)
  state = _restore_for_eval(run.model_dir, prog, checkpoint_step)
  log = MetricsLogger(run.model_dir)
  try:
    results: dict[str, Any] = {"validation": validation.evaluate(prog, state, task, vocab, run, log)}
    if infer is None:
      infer_of = get_task(infer_name)
      infer = any(t.metric_fns for t in (infer_of.tasks if isinstance(infer_of, seqio.Mixture) else [infer_of]))
    if infer:
      results.update(
        validation.infer_eval(
          prog,
          state.params,
          run,
          infer_name,
          int(state.step),
          log,
          split=infer_split,
          beam_size=beam_size,
          progress=log.info,
        )
      )
    return results
  finally:
    log.close()
