"""`remixer-t5 compare`: the table and the PNG come from given (hand-written) run directories.

Each number is worked out by hand below from the rows written here (tokens seen = tokens_per_s / steps_per_s x
steps since the previous train row, summed; tokens/s = median of the train rows without the first).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from remixer_t5 import cli, compare

TINY_T5_GIN = """\
from __gin__ import dynamic_registration
from remixer_t5.model import models
from remixer_t5.model import network

MODEL = @models.EncoderDecoderModel()
MODEL_DIR = '/somewhere/else'
TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 8}
models.EncoderDecoderModel.module = @network.Transformer()
network.Transformer.config = @network.T5Config()
network.T5Config.vocab_size = 64
network.T5Config.emb_dim = 8
network.T5Config.num_heads = 2
network.T5Config.head_dim = 4
network.T5Config.num_encoder_layers = 1
network.T5Config.num_decoder_layers = 1
network.T5Config.mlp_dim = 16
network.T5Config.mlp_activations = ('gelu', 'linear')
"""
# Counted by hand: embedding 64x8 + logits 8x64; relpos 2x32 per stack; encoder layer: 2 norms (8 each),
# q/k/v/o 4x(8x8), wi_0/wi_1 2x(8x16), wo 16x8; decoder layer: 3 norms, self + cross attention, the MLP; final norms.
_ATTN, _MLP = 4 * 8 * 8, 3 * 8 * 16
TINY_T5_PARAMS = 2 * 64 * 8 + 2 * 2 * 32 + (2 * 8 + _ATTN + _MLP) + (3 * 8 + 2 * _ATTN + _MLP) + 2 * 8

SIGNATURE = {
  "config.emb_dim": 8,
  "config.num_encoder_layers": 1,
  "config.num_decoder_layers": 1,
  "model": "Transformer",
  "task": "embedded_span_corruption",
}


def _write(d: Path, rows, config: str | None = TINY_T5_GIN, signature=SIGNATURE, tail: str = ""):
  d.mkdir(parents=True)
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
  if config is not None:
    (d / "config.gin").write_text(config)
  if signature is not None:
    (d / "run_signature.json").write_text(json.dumps(signature))
  return d


def _train(step, loss, tokens_per_s, steps_per_s, split=None):
  """A train row; `split`: (window seconds, step seconds, input seconds), the rest of the window `other`."""
  row = {
    "step": step,
    "split": "train",
    "time": 0.0,
    "loss": loss,
    "accuracy": 0.1,
    "tokens_per_s": tokens_per_s,
    "steps_per_s": steps_per_s,
  }
  if split:
    seconds, step_s, input_s = split
    row.update(
      {
        "window_seconds": seconds,
        "time/step": step_s,
        "time/input": input_s,
        "time/compile": 0.0,
        "time/eval": 0.0,
        "time/checkpoint": 0.0,
        "time/other": seconds - step_s - input_s,
        "goodput": step_s / seconds,
      }
    )
  return row


def _val(step, loss):
  return {"step": step, "split": "validation", "time": 0.0, "loss": loss, "accuracy": 0.2}


@pytest.fixture
def runs(tmp_path):
  # Run a: 1000 tokens/step throughout; log every 10 steps; validation at 0, 20, 40.
  a = _write(
    tmp_path / "a",
    [
      _val(0, 8.0),
      _train(10, 6.0, 500.0, 0.5, (20.0, 1.0, 0.0)),  # first row: compilation, left out of tokens/s
      _train(20, 5.0, 4000.0, 4.0, (2.5, 2.0, 0.25)),
      _val(20, 5.5),
      _train(30, 4.5, 3000.0, 3.0, (10 / 3, 2.5, 0.5)),
      _train(40, 4.0, 2000.0, 2.0, (5.0, 3.0, 1.25)),
      _val(40, 5.2),
    ],
  )
  # Run b: resumed. Its first launch logged 10 and 20 and died after step 25 (checkpoint at 20), the second
  # launch re-logged 20 with other numbers and went on: the last row for a step wins. 800 tokens/step, then 600.
  b = _write(
    tmp_path / "b",
    [
      _val(0, 8.0),
      _train(10, 6.5, 400.0, 0.5),
      _train(20, 9.9, 8000.0, 10.0),  # first launch, replaced below
      _train(20, 5.8, 1600.0, 2.0),
      _val(20, 5.0),  # the best validation loss of b, at step 20
      _train(30, 5.1, 1200.0, 2.0),
      _val(30, 5.4),
      {"step": 30, "split": "infer/cogs", "time": 0.0, "exact_match": 0.25, "note_text": "not a number"},
    ],
    tail='{"step": 31, "split": "tra',
  )  # killed in the middle of writing a row
  (b / "inference_eval").mkdir()
  (b / "inference_eval" / "other_task-metrics.jsonl").write_text(
    json.dumps({"step": 10, "accuracy": 0.1}) + "\n" + json.dumps({"step": 30, "accuracy": 0.3}) + "\n"
  )
  return a, b


def test_numbers_in_the_table_come_from_the_files(runs, tmp_path):
  out = tmp_path / "out"
  loaded, written = compare.compare(runs, out)
  assert sorted(p.name for p in out.iterdir()) == sorted(compare.OUTPUT_FILES) == sorted(written)
  with open(out / "compare.csv") as f:
    rows = {r["run"]: r for r in csv.DictReader(f)}
  a, b = rows["a"], rows["b"]
  # a: 10 steps x 1000 tokens x 4 rows; tokens/s median of 4000, 3000, 2000.
  assert float(a["tokens_seen"]) == 40_000
  assert float(a["tokens_per_s"]) == 3000
  assert (float(a["best_validation_loss"]), int(a["best_validation_step"])) == (5.2, 40)
  assert float(a["final_train_loss"]) == 4.0 and int(a["steps"]) == 40
  # goodput and input share: summed step and input seconds over the summed windows, the first left out.
  windows = 2.5 + 10 / 3 + 5.0
  assert float(a["goodput"]) == pytest.approx((2.0 + 2.5 + 3.0) / windows)
  assert float(a["input_share"]) == pytest.approx((0.25 + 0.5 + 1.25) / windows)
  assert b["goodput"] == "" and b["input_share"] == ""  # rows without a time split
  # b: 10 x 800 + 10 x 800 + 10 x 600; tokens/s median of 1600 and 1200 (the stale 8000 row is gone).
  assert float(b["tokens_seen"]) == 22_000
  assert float(b["tokens_per_s"]) == 1400
  assert (float(b["best_validation_loss"]), int(b["best_validation_step"])) == (5.0, 20)
  assert float(b["final_train_loss"]) == 5.1 and int(b["steps"]) == 30
  # Task metrics: metrics.jsonl's infer rows (numbers only) and, for a task without them, inference_eval/'s latest.
  assert float(b["cogs/exact_match"]) == 0.25 and float(b["other_task/accuracy"]) == 0.3
  assert a["cogs/exact_match"] == "" and "cogs/note_text" not in b
  # Parameters from config.gin's model, by hand; the model column from its slots and the signature.
  assert int(a["params"]) == int(b["params"]) == TINY_T5_PARAMS
  assert a["model"] == "T5.1.1; d8 1+1"
  # The markdown table says the same, formatted.
  md = (out / "compare.md").read_text()
  assert md == compare.markdown_table(loaded)
  line_a = next(line for line in md.splitlines() if line.startswith("| a |"))
  cells = [c.strip() for c in line_a.strip("|").split("|")]
  assert cells == [
    "a",
    "T5.1.1; d8 1+1",
    f"{TINY_T5_PARAMS:,}",
    "40",
    "40k",
    "3k",
    "69%",
    "18%",
    "4.0000",
    "5.2000",
    "40",
    "",
    "",
  ]


def test_curves_against_tokens_seen(runs):
  b = compare.load_run(runs[1], params=False)
  assert [(s, t) for s, _, t in b.train] == [(10, 8000), (20, 16000), (30, 22000)]
  # Validation points sit at the tokens seen at their step (step 0: none yet).
  assert [(s, t) for s, _, t in b.validation] == [(0, 0), (20, 16000), (30, 22000)]
  # Between train rows: linear; past the last one: at its rate.
  assert compare._tokens_at(15, b.train) == 12000
  assert compare._tokens_at(35, b.train) == 25000


def test_png_draws_every_run(runs, tmp_path):
  import matplotlib.image

  loaded, written = compare.compare(runs, tmp_path / "out", names=["first", "second"])
  image = matplotlib.image.imread(written["compare.png"])
  assert image.shape[0] >= 800 and image.shape[1] >= 1200
  assert np.std(image[..., :3]) > 0.05  # not blank
  assert [r.name for r in loaded] == ["first", "second"]


def test_model_label_names_the_replaced_slots():
  config = (
    "network.Transformer.encoder_token_mixer = @hypermixer.HyperMixing\n"
    "network.Transformer.decoder_cross_mixer = @cross/hypermixer.HyperMixing\n"
    "network.Transformer.decoder_token_mixer = @hypermixer.HyperMixing\n"
    "network.Transformer.encoder_feature_mixer = None\n"
    "network.Transformer.config = @network.T5Config()\n"
  )
  assert (
    compare.model_label(config, {"config.emb_dim": 128, "config.num_encoder_layers": 2, "config.num_decoder_layers": 2})
    == "HyperMixing: enc token, dec token, dec cross; none: enc feature; d128 2+2"
  )
  assert compare.model_label("", None) == "T5.1.1"


def test_same_directory_names_are_told_apart(tmp_path):
  assert compare.unique_names([tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z"]) == [
    "x/run",
    "y/run",
    "z",
  ]


def test_a_dir_without_metrics_is_a_clear_error(runs, tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  assert cli.main(["compare", str(runs[0]), str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert f"{tmp_path / 'empty'} has no metrics.jsonl" in err and "remixer-t5 train" in err
  assert not (tmp_path / "out").exists()  # nothing written when one run is unreadable
  assert cli.main(["compare", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]) == 2
  assert "run directory" in capsys.readouterr().err
  _write(tmp_path / "bad", [_val(0, 8.0)], tail="not json\n" + json.dumps(_val(1, 7.0)) + "\n")
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
    compare.read_metrics(tmp_path / "bad")
  _write(tmp_path / "infer_only", [{"step": 1, "split": "infer/cogs", "exact_match": 1.0}])
  with pytest.raises(ValueError, match=r"no train or validation rows \(splits found: \['infer/cogs'\]\)"):
    compare.load_run(tmp_path / "infer_only")


def test_cli_prints_the_table_and_tolerates_an_unreadable_config(runs, tmp_path, capsys):
  (runs[0] / "config.gin").write_text("network.NoSuchThing.x = 1\n")
  assert cli.main(["compare", *map(str, runs), "--out", str(tmp_path / "out"), "--names", "A,B"]) == 0
  captured = capsys.readouterr()
  assert captured.out == (tmp_path / "out" / "compare.md").read_text()
  assert "A: parameters unknown" in captured.err
  with open(tmp_path / "out" / "compare.csv") as f:
    rows = {r["run"]: r for r in csv.DictReader(f)}
  assert rows["A"]["params"] == "" and int(rows["B"]["params"]) == TINY_T5_PARAMS
  assert cli.main(["compare", *map(str, runs), "--out", str(tmp_path / "out"), "--names", "A"]) == 2
  assert "--names gives 1 names for 2 run directories" in capsys.readouterr().err
