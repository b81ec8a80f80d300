"""Evaluation during and after training: validation loss and accuracy over a few batches with greedy decodes of
the first examples (metrics.jsonl rows `validation`), and decode-and-score evaluation with each task's metrics
(`evaluation.infer_eval`, rows `infer/<task>`, and the SuperGLUE score `infer/super_glue_average`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from remixer_t5.data.input_pipeline import get_batches
from remixer_t5.tasks import super_glue
from remixer_t5.training import evaluation, partitioning, programs
from remixer_t5.training.batches import global_batch, global_from_host, to_host
from remixer_t5.training.programs import summarize


def evaluate(prog, state, task, vocab, run, log) -> dict[str, float]:
  """Loss/accuracy over the first `run.schedule.eval_steps` validation batches of `task` (`prog.eval_step`),
  plus a few greedy decodes (`num_decoded_examples`), logged as a metrics.jsonl row `validation`."""
  data, n_decoded = run.data, run.schedule.num_decoded_examples
  sums, first = None, None
  t0 = time.time()
  for i, host_batch in enumerate(
    get_batches(
      task,
      data.feature_lengths,
      "validation",
      data.batch_size,
      seed=run.training.random_seed,
      shuffle=False,
      repeat=False,
      pack=data.pack,
    )
  ):
    if i >= run.schedule.eval_steps:
      break
    first = first if first is not None else host_batch
    m = prog.eval_step(state.params, global_batch(host_batch, prog.batch_sharding))
    sums = m if sums is None else jax.tree_util.tree_map(jnp.add, sums, m)
  if sums is None:
    raise ValueError(
      f"the validation split of {task.name!r} gave no full batch of {data.batch_size}; lower "
      "BATCH_SIZE or TASK_FEATURE_LENGTHS"
    )
  row = summarize(jax.device_get(sums))
  examples = (
    decode_examples(prog.model, state.params, first, vocab, n_decoded, data.pack, prog.mesh) if n_decoded else []
  )
  row["eval_seconds"] = time.time() - t0
  log.write(int(state.step), "validation", row, examples=examples)
  return {k: v for k, v in row.items() if k in ("loss", "accuracy")}


def decode_examples(model, params, batch, vocab, n, pack, mesh):
  """Greedy decodes of the first `n` validation examples (unpacked: the first segment of each row)."""
  enc, tgt = batch["encoder_input_tokens"][:n], batch["decoder_target_tokens"][:n]
  if pack:  # keep only each row's first example so the decode sees what a user would feed it
    enc = np.where(batch["encoder_segment_ids"][:n] == 1, enc, 0)
    tgt = np.where(batch["decoder_segment_ids"][:n] == 1, tgt, 0)
  if jax.process_count() > 1:  # every process decodes process 0's rows (their local batches differ)
    enc, tgt = multihost_utils.broadcast_one_to_all((enc, tgt))
  replicated = partitioning.replicated(mesh)
  preds = to_host(programs.jit_decode(model)(params, global_from_host(enc, replicated), tgt.shape[-1]))
  return [
    {"inputs": vocab.decode(strip(e)), "targets": vocab.decode(strip(t)), "prediction": vocab.decode(strip(p))}
    for e, t, p in zip(enc, tgt, preds)
  ]


def strip(ids) -> list[int]:
  ids = [int(i) for i in ids]
  if 1 in ids:
    ids = ids[: ids.index(1)]
  return [i for i in ids if i > 0]


def infer_eval(
  prog, params, run, task_name: str, step: int, log, *, split: str = "validation", beam_size: int = 1, progress=None
) -> dict[str, dict[str, float]]:
  """Decode-and-score evaluation of `task_name` (remixer_t5.training.evaluation; the first
  `run.schedule.infer_examples` of each task) logged as metrics.jsonl rows `infer/<task>`. When the SuperGLUE
  tasks were scored, the benchmark's score (tasks/super_glue.py `super_glue_average`) is logged beside them as a
  row `infer/super_glue_average` ({"score": ...}; `...#<tag>` for tasks copied into the run's vocabulary) and
  returned under that name; with only some of the 8 tasks it needs, no score is given and a line says which are
  missing."""
  decoding = evaluation.Decoding(
    run.data.batch_size,
    beam_size,
    put=lambda x: global_from_host(x, prog.batch_sharding),
    fetch=to_host,
    progress=progress,
  )
  per_task = evaluation.infer_eval(
    prog.model,
    params,
    task_name,
    decoding,
    feature_lengths=run.data.feature_lengths,
    split=split,
    num_examples=run.schedule.infer_examples,
    log_dir=str(run.model_dir / "inference_eval"),
    step=step,
    seed=run.training.random_seed,
  )
  for name, metrics in per_task.items():
    log.write(step, f"infer/{name}", metrics)
  averages, notes = super_glue.average_entries(per_task)
  for note in notes:
    log.info(note)
  for name, metrics in averages.items():
    log.write(step, f"infer/{name}", metrics)
  return {**per_task, **averages}
