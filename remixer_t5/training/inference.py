"""`remixer-t5 infer`: a checkpoint's predictions for a task's split or a file of inputs, written as JSONL.

As t5x's `infer.py`: the run's gin files name the model, the vocabulary, the lengths and the batch size; the
parameters come from any checkpoint `checkpoints.restore_any_params` reads (a training MODEL_DIR's latest step,
an `import-hf` output, a t5x checkpoint), no optimizer state needed. Inputs are a seqio task's split, labelled
or not, or a file: one text a line, or JSONL rows with an `inputs` field (other fields, e.g. `targets`, are
carried into the row). Each output row has `inputs`, `prediction`, `targets` where known and `log_prob`, the
model's log-probability of the predicted tokens (up to and with EOS). Decoding is greedy, beam search or sampling
(`decoding.Sampling`); the output file is written whole at the end (a bucket path too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import PurePosixPath
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5 import storage
from remixer_t5.model import decoding
from remixer_t5.training import checkpoints, trainer
from remixer_t5.training.run_config import Run

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
  """What to predict and how. `inputs`: a text or JSONL file (None: the task's `split`); `output`: the JSONL
  written (None: MODEL_DIR/infer/<inputs file's stem or task-split>.jsonl); `checkpoint`: where the parameters
  come from (None: MODEL_DIR); `sampling`: None for greedy (beam_size 1) or beam search."""

  inputs: str | None = None
  output: str | None = None
  split: str = "validation"
  checkpoint: str | None = None
  beam_size: int = 1
  sampling: decoding.Sampling | None = None
  max_examples: int | None = None

  def __post_init__(self):
    if self.beam_size < 1 or (self.sampling is not None and self.beam_size != 1):
      raise ValueError(
        f"infer: beam_size {self.beam_size} with sampling {self.sampling}: expected beam_size >= 1, and 1 when sampling"
      )
    if self.max_examples is not None and self.max_examples < 1:
      raise ValueError(f"infer: max_examples {self.max_examples}: expected a positive count or None")


def read_inputs(path: str) -> list[dict[str, Any]]:
  """Rows with an `inputs` text from a file: JSONL when every non-empty line is a JSON object with `inputs`,
  else one text a line (empty lines skipped)."""
  lines = [line for line in storage.run_path(path).read_text().splitlines() if line.strip()]
  if not lines:
    raise ValueError(f"--inputs {path}: no inputs (expected one text a line, or JSONL rows with an 'inputs' field)")
  if all(line.lstrip().startswith("{") for line in lines):
    rows = []
    for n, line in enumerate(lines, 1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"--inputs {path}:{n}: not JSON ({e.msg}); expected a JSON object a line") from None
      if not isinstance(row, dict) or not isinstance(row.get("inputs"), str):
        raise ValueError(f"--inputs {path}:{n}: expected a JSON object with a text field 'inputs', got {line[:80]}")
      rows.append(row)
    return rows
  return [{"inputs": line} for line in lines]


def encode_inputs(rows: list[dict[str, Any]], vocab, length: int) -> list[np.ndarray]:
  """Each row's input ids as the task's preprocessing gives them: the text's pieces, truncated to leave room
  for EOS, then EOS (id 1)."""
  return [np.asarray(list(vocab.encode(r["inputs"]))[: length - 1] + [1], np.int32) for r in rows]


def task_rows(
  task, split: str, lengths: dict[str, int], limit: int | None
) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
  """(row with `inputs` and `targets` texts where the task keeps them, input ids) for a seqio task's split,
  preprocessed as evaluation reads it (no shuffling, inputs truncated to the run's length)."""
  ds = task.get_dataset(
    dict(lengths), split=split, shuffle=False, use_cached=False, num_epochs=1, trim_output_features=True
  )
  if limit:
    ds = ds.take(limit)
  vocab = task.output_features["targets"].vocabulary
  for ex in ds.as_numpy_iterator():
    row = {"inputs": _text(ex, "inputs", task.output_features["inputs"].vocabulary)}
    if "targets" in ex or "targets_pretokenized" in ex:
      row["targets"] = _text(ex, "targets", vocab)
    yield row, np.asarray(ex["inputs"], np.int32)


def _text(ex: dict, feature: str, vocab) -> str:
  raw = ex.get(f"{feature}_pretokenized")
  return raw.decode() if isinstance(raw, bytes) else str(raw) if raw is not None else vocab.decode(ex[feature].tolist())


def sequence_log_prob(model, params, enc, tokens):
  """The model's log-probability of each row of `tokens` given `enc`, teacher-forced: the sum over positions up
  to and with the first EOS (id 1). The same measure for greedy, beam and sampled outputs."""
  dec_in = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)
  logits = model.logits(
    params, {"encoder_input_tokens": enc, "decoder_input_tokens": dec_in, "decoder_target_tokens": tokens}, None
  )
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), tokens[..., None], -1)[..., 0]
  eos = (tokens == 1).astype(jnp.int32)
  return jnp.sum(jnp.where(jnp.cumsum(eos, axis=1) - eos == 0, log_probs, 0.0), axis=1)


def predict(
  model,
  params,
  ids: list[np.ndarray],
  request: Request,
  batch_size: int,
  lengths: dict[str, int],
  put: Callable[[np.ndarray], Any] = jnp.asarray,
  progress: Callable[[str], None] = log.info,
) -> Iterator[tuple[list[int], float]]:
  """(predicted ids up to and with EOS, their log-probability) for each input, in order, a batch at a time with
  a progress line (inputs/s, ETA) per batch; the last batch padded with empty rows. `put` places a host batch
  (the trainer's batch sharding under a mesh)."""
  sampling = request.sampling

  @jax.jit
  def decode(p, enc, rng):
    tokens = model.predict_batch(
      p,
      {"encoder_input_tokens": enc},
      max_decode_length=lengths["targets"],
      beam_size=request.beam_size,
      sampling=sampling,
      rng=rng,
    )
    return tokens, sequence_log_prob(model, p, enc, tokens)

  rng = jax.random.PRNGKey(sampling.seed if sampling else 0)
  t0, n = time.time(), len(ids)
  for start in range(0, n, batch_size):
    chunk = ids[start : start + batch_size]
    enc = np.zeros((batch_size, lengths["inputs"]), np.int32)
    for i, row in enumerate(chunk):
      enc[i, : len(row)] = row[: lengths["inputs"]]
    tokens, scores = jax.device_get(decode(params, put(enc), jax.random.fold_in(rng, start)))
    done = min(n, start + batch_size)
    rate = done / max(time.time() - t0, 1e-9)
    progress(f"[infer] {done}/{n} inputs | {rate:.1f}/s | ETA {(n - done) / rate:.0f} s")
    for i in range(len(chunk)):
      out = tokens[i].tolist()
      yield out[: out.index(1) + 1] if 1 in out else out, float(scores[i])


def output_path(run: Run, request: Request) -> str:
  if request.output:
    return request.output
  if not run.model_dir:
    raise ValueError("infer: pass --output FILE, or set MODEL_DIR for the default MODEL_DIR/infer/<name>.jsonl")
  name = PurePosixPath(str(request.inputs)).stem if request.inputs else f"{run.data.task}-{request.split}"
  return str(run.model_dir / "infer" / f"{name}.jsonl")


def infer(run: Run, request: Request, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
  """Predict as `request` says with `run`'s model and vocabulary; write the JSONL; return {output, rows}."""
  _, task, vocab, _ = trainer.task_and_vocabulary(run.data.task, run.data.vocabulary, run.data.data_dir, None)
  lengths = dict(run.data.feature_lengths)
  source = request.checkpoint or run.model_dir
  if not source:
    raise ValueError("infer: no checkpoint: set MODEL_DIR or pass --checkpoint PATH")
  out = output_path(run, request)
  prog = trainer.eval_program(run)
  params = checkpoints.restore_init_params(source, prog.state.params, None, what="checkpoint")
  if request.inputs:
    rows = read_inputs(request.inputs)[: request.max_examples]
    ids = encode_inputs(rows, vocab, lengths["inputs"])
  else:
    pairs = list(task_rows(task, request.split, lengths, request.max_examples))
    rows, ids = [r for r, _ in pairs], [i for _, i in pairs]
  written = []
  put = lambda a: jax.device_put(a, prog.batch_sharding)
  outputs = predict(prog.model, params, ids, request, run.data.batch_size, lengths, put, progress)
  for row, (tokens, log_prob) in zip(rows, outputs):
    written.append({**row, "prediction": vocab.decode([t for t in tokens if t != 1]), "log_prob": log_prob})
  if jax.process_index() == 0:
    storage.write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in written))
  progress(f"[infer] wrote {len(written)} rows to {out}")
  return {"output": out, "rows": len(written)}
