"""Evaluation during and after training: validation loss and accuracy over a few batches with greedy decodes of
the first examples (metrics.jsonl rows `validation`), and decode-and-score evaluation with each task's metrics
(`evaluation.infer_eval`, rows `infer/<task>`)."""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5 import storage
from remixer_t5.training import partitioning
from remixer_t5.training.batches import get_batches, global_batch, global_from_host, to_host
from remixer_t5.training.programs import summarize


def evaluate(model, eval_step, state, task, vocab, feature_lengths, batch_size, eval_steps,
              num_decoded_examples, seed, pack, batch_sh, log) -> dict[str, float]:
  """Loss/accuracy over the first `eval_steps` validation batches, plus a few greedy decodes."""
  sums, first = None, None
  t0 = time.time()
  for i, host_batch in enumerate(get_batches(task, feature_lengths, "validation", batch_size, seed=seed,
                                             shuffle=False, repeat=False, pack=pack)):
    if i >= eval_steps:
      break
    first = first if first is not None else host_batch
    m = eval_step(state.params, global_batch(host_batch, batch_sh))
    sums = m if sums is None else jax.tree_util.tree_map(jnp.add, sums, m)
  if sums is None:
    raise ValueError(f"the validation split of {task.name!r} gave no full batch of {batch_size}; lower "
                     "BATCH_SIZE or TASK_FEATURE_LENGTHS")
  row = summarize(jax.device_get(sums))
  examples = (decode_examples(model, state.params, first, vocab, num_decoded_examples, pack, batch_sh.mesh)
              if num_decoded_examples else [])
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
    from jax.experimental import multihost_utils
    enc, tgt = multihost_utils.broadcast_one_to_all((enc, tgt))
  replicated = partitioning.replicated(mesh)
  preds = to_host(jit_predict(model)(params, {"encoder_input_tokens": global_from_host(enc, replicated)},
                                      tgt.shape[-1]))
  return [{"inputs": vocab.decode(strip(e)), "targets": vocab.decode(strip(t)), "prediction": vocab.decode(strip(p))}
          for e, t, p in zip(enc, tgt, preds)]


@functools.lru_cache(maxsize=4)
def jit_predict(model):
  return jax.jit(lambda p, b, n: model.predict_batch(p, b, max_decode_length=n), static_argnums=2)


def strip(ids) -> list[int]:
  ids = [int(i) for i in ids]
  if 1 in ids:
    ids = ids[:ids.index(1)]
  return [i for i in ids if i > 0]


def infer_eval(model, params, task_name, feature_lengths, batch_size, num_examples, model_dir, step, seed,
                batch_sh, log, split="validation", beam_size=1, progress=None) -> dict[str, dict[str, float]]:
  """Decode-and-score evaluation (remixer_t5.training.evaluation) logged as metrics.jsonl rows `infer/<task>`."""
  from remixer_t5.training import evaluation
  per_task = evaluation.infer_eval(
      model, params, task_name, batch_size=batch_size, feature_lengths=feature_lengths, split=split,
      num_examples=num_examples, log_dir=str(storage.run_path(model_dir) / "inference_eval"), step=step, seed=seed,
      beam_size=beam_size, put=lambda x: global_from_host(x, batch_sh), fetch=to_host, progress=progress)
  for name, metrics in per_task.items():
    log.write(step, f"infer/{name}", metrics)
  return per_task
