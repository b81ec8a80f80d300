"""Inference evaluation with the seqio Evaluator: decode every eval task of a task or mixture and score the
decodes with the task's own postprocessor and metrics (as t5x's infer_eval does).

Per task, under ``log_dir``: seqio's ``<task>-metrics.jsonl`` (one line per step) and ``<task>-<step>.jsonl``
(inputs, targets and predictions), and TensorBoard summaries in ``<task>/``. seqio writes them with TensorFlow's
file system, so a ``log_dir`` in a bucket is written through a local mirror (remixer_t5.storage.Mirror) and
copied up once the evaluation has logged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import seqio

from remixer_t5 import storage
from remixer_t5.model.models import EncoderDecoderModel
from remixer_t5.training import programs


@dataclasses.dataclass(frozen=True)
class Decoding:
  """How predictions are made: fixed-shape batches of `batch_size` examples, `beam_size` beams (1: greedy).
  `put` makes a device array of a host batch and `fetch` brings outputs back (multi-process runs pass
  global-array versions of both); `progress` gets a line per batch; `stats`, when given, receives `examples`,
  `tokens` (generated, up to and with EOS) and `seconds` (decoding only, compilation included) of the calls."""

  batch_size: int
  beam_size: int = 1
  put: Callable[[np.ndarray], Any] = jnp.asarray
  fetch: Callable[[Any], np.ndarray] = jax.device_get
  progress: Callable[[str], None] | None = None
  stats: dict | None = None


def make_predict_fn(model: EncoderDecoderModel, params, decoding: Decoding):
  """seqio predict_fn: (index, features) dataset -> [(index, output ids)], decoded as `decoding` says (examples
  grouped by input length; the last batch padded with empty rows whose outputs are dropped). The ids keep their
  full length (seqio stacks them; the vocabulary's decode stops at EOS)."""
  predict = programs.jit_decode(model, decoding.beam_size)
  batch_size, put, fetch = decoding.batch_size, decoding.put, decoding.fetch
  progress, stats = decoding.progress, decoding.stats

  def predict_fn(ds):
    rows = list(ds.as_numpy_iterator())
    if not rows:
      return []
    # Batches of like input lengths (a proxy for output lengths): a batch decodes until its longest output
    # ends, so mixing short and long examples in every batch makes all of them as slow as the longest (COGS
    # gen: 1.8x). Outputs keep their example index; seqio puts them back in order.
    rows.sort(key=lambda r: int(np.count_nonzero(r[1]["encoder_input_tokens"])))
    length = rows[0][1]["decoder_target_tokens"].shape[-1]
    out, t0 = [], time.time()
    for start in range(0, len(rows), batch_size):
      chunk = rows[start : start + batch_size]
      enc = np.stack([r[1]["encoder_input_tokens"] for r in chunk])
      if len(chunk) < batch_size:
        enc = np.concatenate([enc, np.zeros((batch_size - len(chunk), enc.shape[1]), enc.dtype)])
      tokens = np.asarray(fetch(predict(params, put(enc), length)))
      for (index, _), ids in zip(chunk, tokens):
        out.append((int(index), ids.tolist()))
      if stats is not None:
        stats["tokens"] = stats.get("tokens", 0) + int(_generated(tokens[: len(chunk)]).sum())
      if progress:
        done = min(start + batch_size, len(rows))
        rate = done / max(time.time() - t0, 1e-9)
        progress(f"decoded {done}/{len(rows)} examples ({rate:.1f}/s, ETA {(len(rows) - done) / rate:.0f}s)")
    if stats is not None:
      stats["examples"] = stats.get("examples", 0) + len(rows)
      stats["seconds"] = stats.get("seconds", 0.0) + time.time() - t0
    return out

  return predict_fn


def _generated(tokens: np.ndarray, eos_id: int = 1) -> np.ndarray:
  """Tokens each row generated: up to and with its first EOS, or the whole row when it has none."""
  is_eos = tokens == eos_id
  return np.where(is_eos.any(-1), is_eos.argmax(-1) + 1, tokens.shape[-1])


def infer_eval(
  model: EncoderDecoderModel,
  params,
  task_name: str,
  decoding: Decoding,
  *,
  feature_lengths: Mapping[str, int] | None = None,
  split: str = "validation",
  num_examples: int | None = None,
  log_dir: str | None = None,
  step: int | None = None,
  seed: int = 0,
  lengths_on_purpose: bool = False,
) -> dict[str, dict[str, float]]:
  """Decode ``split`` of every task of ``task_name`` that has metrics as ``decoding`` says; returns
  ``{task: {metric: value}}``.

  ``feature_lengths``: truncation lengths (None: the longest example of each feature, as seqio computes);
  ``lengths_on_purpose``: they are longer than the split needs by design (a fixed-length mixer's model length,
  decode lengths rounded up), so seqio's "longer than necessary" warning is not printed;
  ``num_examples``: the first N examples of each task (None: all)."""
  absl_log = logging.getLogger("absl")
  absl_log.setLevel(logging.WARNING)  # seqio's per-dataset info lines drown the progress
  loggers = (seqio.JSONLogger, seqio.TensorBoardLogger) if log_dir and jax.process_index() == 0 else ()
  mirror = None
  if loggers:
    mirror = storage.Mirror(log_dir)  # seqio's JSONLogger writes into it without creating it
    mirror.pull("*-metrics.jsonl")  # the JSONLogger appends to these
    log_dir = str(mirror.local)
  try:
    evaluator = _evaluator(
      task_name, split, feature_lengths, num_examples, seed, loggers, log_dir, lengths_on_purpose, absl_log
    )
    metrics, _ = evaluator.evaluate(
      compute_metrics=True, step=step, predict_fn=make_predict_fn(model, params, decoding)
    )
    # seqio wraps metrics in clu-style Scalar objects
    return {
      task: {k: float(np.asarray(getattr(v, "value", v))) for k, v in values.items()}
      for task, values in metrics.result().items()
    }
  finally:
    if mirror is not None:
      mirror.close()


def _evaluator(
  task_name, split, feature_lengths, num_examples, seed, loggers, log_dir, lengths_on_purpose, absl_log
) -> seqio.Evaluator:
  # seqio's "Given sequence lengths are longer than necessary" warning, for callers whose lengths are longer on
  # purpose (`repro cogs`: fixed-length mixers see inputs at the model's length, decode lengths are rounded up),
  # would print for every split; elsewhere it stays, as it can be a real hint.
  hide = lambda record: not str(record.msg).startswith("Given sequence lengths are longer than necessary")
  if lengths_on_purpose:
    absl_log.addFilter(hide)
  try:  # the Evaluator measures the split and warns when it is built
    evaluator = seqio.Evaluator(
      mixture_or_task_name=task_name,
      feature_converter=seqio.EncDecFeatureConverter(pack=False),
      eval_split=split,
      use_cached=False,
      seed=seed,
      sequence_length=dict(feature_lengths or {}) or None,
      num_examples=num_examples,
      shuffle=False,
      logger_cls=loggers,
      log_dir=log_dir if loggers else None,
      async_compute_metrics=False,
    )
  finally:
    absl_log.removeFilter(hide)
  if not evaluator.eval_tasks:
    raise ValueError(
      f"{task_name!r} has no task with metrics and a {split!r} split to evaluate "
      "(span corruption tasks have none; use loss evaluation)"
    )
  return evaluator
