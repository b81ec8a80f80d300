"""`remixer-t5 infer` and `eval` on any checkpoint: predictions for a file of inputs or a task's split from a
params-only checkpoint (what import-hf writes), against the model's own decode; zero-shot `eval` of such a
directory."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5 import cli, gin_utils
from remixer_t5.training import checkpoints, inference, run_config

TINY = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/demo.gin",
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}",
]


@pytest.fixture
def imported(tmp_path, embedded_env):
  """A directory laid out as import-hf writes it (checkpoint/: parameters alone) holding a random tiny T5.1.1,
  its parameters and the run's config."""
  gin_utils.parse_gin(
    ["models/t5_1_1/tiny.gin", "runs/demo.gin"],
    ["TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}", "BATCH_SIZE=2"],
    macro_defaults={"MODEL_DIR": "None"},
  )
  run = run_config.from_gin()
  model = run.training.model
  params = model.init_variables(
    jax.random.PRNGKey(7),
    {"encoder_input_tokens": (1, 32), "decoder_input_tokens": (1, 12), "decoder_target_tokens": (1, 12)},
  )["params"]
  out = tmp_path / "imported"
  checkpoints.save_params(out / "checkpoint", params)
  return out, model, params, run


def _decode_directly(model, params, vocab, texts):
  """Greedy tokens and log-probabilities of `texts` from the model's own predict_batch."""
  enc = np.zeros((len(texts), 32), np.int32)
  for i, ids in enumerate(inference.encode_inputs([{"inputs": t} for t in texts], vocab, 32)):
    enc[i, : len(ids)] = ids
  tokens, logp = model.predict_batch(
    params, {"encoder_input_tokens": jnp.asarray(enc)}, max_decode_length=12, return_scores=True
  )
  return [vocab.decode([t for t in row.tolist() if t not in (0, 1)]) for row in np.asarray(tokens)], logp


def test_infer_a_file_of_inputs_from_a_params_only_checkpoint(imported, tmp_path, capsys):
  """One row per non-empty line (an odd count: the last batch padded), each the model's greedy decode with its
  log-probability (teacher-forced in infer, accumulated by the decode loop here); JSONL rows keep their fields;
  progress lines on stderr."""
  out_dir, model, params, run = imported
  from remixer_t5.training import trainer

  _, _, vocab, _ = trainer.task_and_vocabulary(run.data.task, run.data.vocabulary, None, None)
  texts = ["the cat sat on the mat", "a b c", "what is going on here"]
  src = tmp_path / "in.txt"
  src.write_text("\n".join([texts[0], "", *texts[1:]]) + "\n")
  out = tmp_path / "out.jsonl"
  assert (
    cli.main(
      [
        "infer",
        *TINY,
        f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
        "--checkpoint",
        str(out_dir),
        "--inputs",
        str(src),
        "--output",
        str(out),
      ]
    )
    == 0
  )
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  want, logp = _decode_directly(model, params, vocab, texts)
  assert [r["inputs"] for r in rows] == texts
  assert [r["prediction"] for r in rows] == want
  np.testing.assert_allclose([r["log_prob"] for r in rows], np.asarray(logp), rtol=1e-4, atol=1e-4)
  assert "[infer] 3/3 inputs" in capsys.readouterr().err

  # JSONL inputs: other fields carried; top-1 sampling is greedy
  src.write_text("".join(json.dumps({"inputs": t, "targets": "x", "id": i}) + "\n" for i, t in enumerate(texts)))
  assert (
    cli.main(
      [
        "infer",
        *TINY,
        f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
        "--checkpoint",
        str(out_dir),
        "--inputs",
        str(src),
        "--output",
        str(out),
        "--top_k",
        "1",
        "--temperature",
        "3",
      ]
    )
    == 0
  )
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["id"], r["targets"], r["prediction"]) for r in rows] == [(i, "x", w) for i, w in enumerate(want)]


def test_infer_a_task_split_and_bad_inputs(imported, tmp_path, capsys):
  """A task's split (its targets beside each prediction) into MODEL_DIR/infer/<task>-<split>.jsonl; a JSONL row
  without `inputs` and a beam search with sampling are refused in one line each."""
  out_dir, _, _, _ = imported
  model_dir = tmp_path / "run"
  assert (
    cli.main(
      [
        "infer",
        *TINY,
        f"--gin.MODEL_DIR='{model_dir}'",
        "--checkpoint",
        str(out_dir),
        "--max_examples",
        "3",
        "--beam_size",
        "2",
      ]
    )
    == 0
  )
  rows = [
    json.loads(line)
    for line in (model_dir / "infer" / "embedded_span_corruption-validation.jsonl").read_text().splitlines()
  ]
  assert len(rows) == 3 and all(r["targets"] and r["inputs"] and np.isfinite(r["log_prob"]) for r in rows)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"inputs": "ok"}\n{"text": "no inputs"}\n')
  capsys.readouterr()
  assert (
    cli.main(["infer", *TINY, f"--gin.MODEL_DIR='{model_dir}'", "--checkpoint", str(out_dir), "--inputs", str(bad)])
    == 2
  )
  assert f"{bad}:2: expected a JSON object with a text field 'inputs'" in capsys.readouterr().err
  assert (
    cli.main(
      [
        "infer",
        *TINY,
        f"--gin.MODEL_DIR='{model_dir}'",
        "--checkpoint",
        str(out_dir),
        "--beam_size",
        "2",
        "--temperature",
        "1",
      ]
    )
    == 2
  )
  assert "expected beam_size >= 1, and 1 when sampling" in capsys.readouterr().err


def test_eval_scores_a_params_only_directory_without_training(imported, capsys):
  """`eval` with MODEL_DIR an import-hf-style directory: the validation loss at step 0, no training checkpoint
  needed, and the same loss the model gives those parameters; an empty MODEL_DIR fails in one line."""
  out_dir, _, _, _ = imported
  assert (
    cli.main(
      [
        "eval",
        *TINY,
        f"--gin.MODEL_DIR='{out_dir}'",
        "--gin.EVAL_STEPS=1",
        "--gin.trainer.evaluate_checkpoint.infer=False",
      ]
    )
    == 0
  )
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert np.isfinite(result["validation"]["loss"]) and result["validation"]["loss"] > 0
  rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
  assert rows[-1]["step"] == 0 and rows[-1]["split"] == "validation"
  empty = out_dir.parent / "empty"
  empty.mkdir()
  assert cli.main(["eval", *TINY, f"--gin.MODEL_DIR='{empty}'", "--gin.EVAL_STEPS=1"]) == 2
  err = capsys.readouterr().err
  assert "no checkpoint in" in err and "an import-hf output, a t5x checkpoint" in err and "Traceback" not in err
