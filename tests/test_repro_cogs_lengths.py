"""`repro cogs` trains one recipe whatever evaluation files sit beside train: the model's lengths are declared
for the COGS release (MODEL_LENGTHS), training rows are packed at lengths fixed from the train split
(TRAIN_LENGTHS), and an evaluation file that does not fit is refused, naming the file, the line, the length
and the limit."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from test_repro_cogs import SHARED_COGS, _toy_cogs, _tsv


def _gen_files(tmp_path: Path) -> tuple[Path, Path]:
  """Two gen files in the release's format: the toy's own (3 short rows), and a longer one whose longest
  input and target (50 and ~300 tokens) lengths measured from the files would follow."""
  short = tmp_path / "gen_short.tsv"
  _tsv(
    short,
    [
      ("The hedgehog smiled .", "* hedgehog ( x _ 1 ) ; smile . agent ( x _ 2 , x _ 1 )", "new_noun"),
      ("The cat ran .", "* cat ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "seen"),
    ],
  )
  long_target = " ; ".join(f"smile . agent ( x _ {i} , x _ 1 )" for i in range(2, 30))
  long = tmp_path / "gen_long.tsv"
  _tsv(
    long,
    [
      ("The cat ran .", "* cat ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "seen"),
      (" ".join(["The cat"] * 24) + " ran .", "* cat ( x _ 1 ) ; " + long_target, "deep"),
      ("The dog slept .", "* dog ( x _ 1 ) ; sleep . agent ( x _ 2 , x _ 1 )", "seen"),
    ],
  )
  return short, long


def _fake_decode(model, seed, settings, data, run_dir, progress, cpus=None, lock=None):
  """decode_run's result shape without decoding (the recipe under test is the training's)."""
  out = {}
  for split in ("validation", "test", "gen"):
    out[split] = {"exact_match": 50.0, "examples": 2, "tokens": 10, "seconds": 1.0}
    if split == "gen":
      out[split].update({f"accuracy_{c}": 50.0 for c in data["splits"]["gen"]["categories"]})
  return out


def _sweep(monkeypatch, tmp_path, repro, gen: Path, out: Path, train_run) -> dict:
  """repro.run over the toy data with `gen` as the gen file, `train_run` in the trainer's place and decoding
  stubbed; returns the run's settings.json."""
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path / "data"))
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(repro, "train_run", train_run)
  monkeypatch.setattr(repro, "decode_run", _fake_decode)
  settings = repro.Settings(models=("remixer",), seeds=(0,), steps=3, batch_size=2, warmup=2, gen_file=str(gen))
  try:
    repro.run(settings, out)
  finally:
    from remixer_t5.tasks import cogs

    cogs.set_gen_file(None)
    os.environ.pop(cogs.GEN_ENV_VAR, None)  # run() sets it for its subprocesses
  return json.loads((out / "settings.json").read_text())


def test_declared_lengths_hold_the_release_and_are_the_run_files():
  """MODEL_LENGTHS is the release's longest input and target rounded up to a multiple of 64 (the stated
  margin), holds the packed training rows, and is what runs/cogs_scratch.gin binds (a `remixer-t5 train` with
  the same gin files trains the same model as `repro cogs`)."""
  from remixer_t5 import gin_utils
  from remixer_t5.repro import cogs as repro

  for k in ("inputs", "targets"):
    assert repro.MODEL_LENGTHS[k] == 64 * math.ceil(repro.RELEASE_LONGEST[k] / 64) > repro.RELEASE_LONGEST[k]
    assert repro.TRAIN_LENGTHS[k] <= repro.MODEL_LENGTHS[k]
  for model in ("t5_1_1", "remixer"):
    gin_utils.parse_gin([repro.model_gin(model), repro.RUN_FILE], ["MODEL_DIR='/nonexistent'"])
    assert gin_utils.macro("MODEL_LENGTHS") == repro.MODEL_LENGTHS
    assert gin_utils.macro("TASK_FEATURE_LENGTHS") == repro.TRAIN_LENGTHS


@pytest.mark.skipif(not SHARED_COGS.is_dir(), reason="../shared/data/cogs (the COGS release files) is absent")
def test_the_release_files_here_fit_the_declared_lengths(tmp_path, monkeypatch):
  """train, dev, test and gen_sample.tsv measured under the word vocabulary: within RELEASE_LONGEST (which the
  full gen.tsv's cp_recursion reaches), train within a packed row; the numbers the comments quote."""
  from remixer_t5.repro import cogs as repro
  from remixer_t5.tasks import cogs

  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(SHARED_COGS.parent))
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv(cogs.GEN_ENV_VAR, raising=False)
  data = repro.measure_splits(lambda s: None)
  longest = {s: (v["max_input_tokens"], v["max_target_tokens"]) for s, v in data["splits"].items()}
  assert longest == {"train": (23, 166), "validation": (22, 173), "test": (20, 138), "gen": (54, 385)}
  assert data["model_lengths"] == repro.MODEL_LENGTHS and data["train_lengths"] == repro.TRAIN_LENGTHS


def test_the_training_recipe_does_not_depend_on_the_gen_file(tmp_path, monkeypatch):
  """The same sweep with two gen files whose longest rows differ (lengths measured from the files would
  differ): the trainer is given the same flags, and the folders record the same model and row lengths."""
  from remixer_t5.repro import cogs as repro

  short, long = _gen_files(tmp_path)
  _toy_cogs(tmp_path / "data")
  given = {}

  def train_run(model, seed, settings, lengths, run_dir, progress, extra_gin=(), cpus=None):
    # the flags train_run would hand the trainer, MODEL_DIR (the folder) aside
    given[run_dir.parents[1].name] = [
      f for f in repro._gin_args(model, run_dir, seed, settings, lengths) if not f.startswith("--gin.MODEL_DIR=")
    ]
    (run_dir / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text("model: 1 params | stub\n")
    return 1.0

  records = {g.stem: _sweep(monkeypatch, tmp_path, repro, g, tmp_path / g.stem, train_run) for g in (short, long)}
  measured = {g.stem: json.loads((tmp_path / g.stem / "data.json").read_text())["splits"]["gen"] for g in (short, long)}
  assert measured["gen_short"]["max_target_tokens"] < 32 < 200 < measured["gen_long"]["max_target_tokens"]
  assert measured["gen_short"]["max_input_tokens"] < 16 < 48 < measured["gen_long"]["max_input_tokens"]
  assert given["gen_short"] == given["gen_long"]
  assert f"--gin.MODEL_LENGTHS={json.dumps(repro.MODEL_LENGTHS)}" in given["gen_short"]
  assert f"--gin.TASK_FEATURE_LENGTHS={json.dumps(repro.TRAIN_LENGTHS)}" in given["gen_short"]
  for r in records.values():
    assert r["model_lengths"] == repro.MODEL_LENGTHS and r["train_lengths"] == repro.TRAIN_LENGTHS


def test_an_evaluation_file_that_does_not_fit_is_refused_before_training(tmp_path, monkeypatch):
  """A gen, dev or train row longer than the recipe holds stops the sweep before any run trains, with the
  file, its first such line (blank lines counted), the length, the limit and how many rows do not fit."""
  from remixer_t5.repro import cogs as repro

  _toy_cogs(tmp_path / "data")
  ok = ("The cat ran .", "* cat ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "seen")
  too_long_target = ("The cat ran .", " ".join(["agent"] * 600), "deep")  # 601 tokens with EOS
  too_long_input = (" ".join(["cat"] * 70), "* cat ( x _ 1 )", "deep")  # 71 tokens with EOS
  gen = tmp_path / "gen_bad.tsv"
  gen.write_text(
    "\t".join(ok) + "\n\n" + "\t".join(ok) + "\n" + "\t".join(too_long_target) + "\n" + "\t".join(too_long_input) + "\n"
  )

  def train_run(*a, **k):
    raise AssertionError("a run trained although an evaluation file does not fit")

  with pytest.raises(ValueError) as e:
    _sweep(monkeypatch, tmp_path, repro, gen, tmp_path / "out", train_run)
  msg = str(e.value)
  assert msg.startswith(f"{gen}:4: ")
  assert "target (logical form) is 601 tokens" in msg and "than the 576 of MODEL_LENGTHS['targets']" in msg
  assert "2 rows of this file do not fit" in msg
  gen.write_text("\t".join(ok) + "\n" + "\t".join(too_long_input) + "\n")
  with pytest.raises(
    ValueError,
    match=rf"^{gen}:2: .*input \(sentence\) is 71 tokens .*than the 64 of "
    r"MODEL_LENGTHS\['inputs'\].*1 row of this file does not fit",
  ):
    _sweep(monkeypatch, tmp_path, repro, gen, tmp_path / "out", train_run)
  # dev is held to the model's lengths too; train to a packed row's (a longer example would be cut short)
  _tsv(tmp_path / "gen_ok.tsv", [ok])
  dev = tmp_path / "data" / "cogs" / "dev.tsv"
  _tsv(dev, [ok, too_long_target])
  with pytest.raises(ValueError, match=rf"^{dev}:2: this dev row's target .* 601 tokens"):
    _sweep(monkeypatch, tmp_path, repro, tmp_path / "gen_ok.tsv", tmp_path / "out", train_run)
  _toy_cogs(tmp_path / "data")
  train = tmp_path / "data" / "cogs" / "train.tsv"
  with open(train, "a") as f:
    f.write("\t".join(("The cat ran .", " ".join(["agent"] * 400), "in_distribution")) + "\n")
  with pytest.raises(
    ValueError,
    match=rf"^{train}:\d+: this train row's target .* 401 tokens .*than the 320 of "
    r"TRAIN_LENGTHS\['targets'\].*a packed training row's length",
  ):
    _sweep(monkeypatch, tmp_path, repro, tmp_path / "gen_ok.tsv", tmp_path / "out", train_run)


def test_a_folder_from_before_train_lengths_were_recorded_resumes_as_it_was_packed(tmp_path):
  """settings.json without `train_lengths`: its rows were packed at TRAIN_LENGTHS cut to its model lengths."""
  import dataclasses
  from remixer_t5.repro import cogs as repro

  settings = dataclasses.asdict(repro.Settings()) | {"models": None, "seeds": None}
  old = {"settings": settings, "gen_file": "x", "model_lengths": {"inputs": 32, "targets": 176}}
  (tmp_path / "settings.json").write_text(json.dumps(old))
  assert repro.settings_match(tmp_path / "settings.json", {**old, "train_lengths": {"inputs": 32, "targets": 176}})
  assert not repro.settings_match(tmp_path / "settings.json", {**old, "train_lengths": repro.TRAIN_LENGTHS})
  new = {**old, "model_lengths": repro.MODEL_LENGTHS, "train_lengths": repro.TRAIN_LENGTHS}
  assert not repro.settings_match(tmp_path / "settings.json", new)  # a model of other lengths: not resumed


@pytest.mark.integration
def test_two_gen_files_train_the_same_run(tmp_path, monkeypatch):
  """The same seed of the Remixer (whose H is sized by the model's lengths) trained through `repro cogs` with
  two gen files: the same parameter count (the declared lengths'), bit-identical losses and metrics at each
  of the first steps in metrics.jsonl, and the same lowered programs (every StableHLO module the trainer
  compiled, the train step's among them, dumped by JAX as it lowers them)."""
  from remixer_t5.repro import cogs as repro

  short, long = _gen_files(tmp_path)
  _toy_cogs(tmp_path / "data")
  plain_args, plain_train = repro._gin_args, repro.train_run
  monkeypatch.setattr(repro, "_gin_args", lambda *a: plain_args(*a) + ["--gin.LOG_PERIOD=1"])
  runs = {}
  for g in (short, long):
    dump = tmp_path / f"ir_{g.stem}"
    monkeypatch.setenv("JAX_DUMP_IR_TO", str(dump))  # read by JAX in the trainer's subprocess
    _sweep(monkeypatch, tmp_path, repro, g, tmp_path / g.stem, plain_train)
    run_dir = tmp_path / g.stem / "runs" / "remixer-seed0"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [
      {k: r[k] for k in ("step", "loss", "z_loss", "accuracy", "grad_norm", "learning_rate")}
      for r in metrics
      if r["split"] == "train"
    ]
    modules = {p.name.split("_", 1)[1]: p.read_text() for p in dump.glob("jax_ir*.mlir")}
    runs[g.stem] = (repro._param_count(run_dir), train_rows, modules)
  (n_short, rows_short, ir_short), (n_long, rows_long, ir_long) = runs["gen_short"], runs["gen_long"]
  assert n_short == n_long == 1_541_892  # H at the declared 64 / 576
  assert [r["step"] for r in rows_short] == [1, 2, 3]
  assert rows_short == rows_long  # floats compared exactly: bit-identical training
  assert any("jit_train_step" in name for name in ir_short), sorted(ir_short)
  assert ir_short.keys() == ir_long.keys()
  for name in ir_short:
    assert ir_short[name] == ir_long[name], name
