"""`remixer-t5 repro cogs` (COGS from scratch): the word vocabulary, the gen file choice, the table and plot,
the decode statistics, and a tiny end-to-end run through the trainer and the seqio evaluation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SHARED_COGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "cogs"


# --- the word vocabulary ----------------------------------------------------------------------------------
def _vocab(tmp_path, texts):
  from remixer_t5.data import word_vocab

  path = tmp_path / "words.model"
  path.write_bytes(word_vocab.build_word_model(texts))
  import seqio

  return seqio.SentencePieceVocabulary(str(path), extra_ids=0)


def test_word_vocabulary_has_a_piece_per_train_word_and_spells_the_rest(tmp_path):
  train = [
    "A rose was helped by a dog .",
    "rose ( x _ 1 ) AND help . theme ( x _ 3 , x _ 1 )",
    "x _ 18 AND dog ( x _ 12 )",
  ]
  v = _vocab(tmp_path, train)
  sp = v.tokenizer
  for word in ("rose", "helped", "AND", "theme", "(", "."):  # one piece each, as Kim & Linzen's word tokens
    assert len(v.encode(word)) == 1, (word, [sp.id_to_piece(i) for i in v.encode(word)])
  # Numbers are spelled digit by digit: 44 never occurs in training, yet is made of pieces that do (x _ 14).
  assert [sp.id_to_piece(i) for i in v.encode("x _ 44")] == ["\u2581x", "\u2581_", "\u25814", "4"]
  # Unseen words (and characters never seen at all, through bytes) still decode back exactly.
  for text in ("A gardner helped a monastery .", "x _ 44 AND x _ 107", "caf\u00e9 \u00fcber", "a  b"):
    assert v.decode(v.encode(text)) == text
  assert 2 not in v.encode("caf\u00e9 \u00fcber")  # no <unk>: bytes stand in
  # The model is the same bytes for the same texts (its cache key is the train file's hash).
  from remixer_t5.data import word_vocab

  assert word_vocab.build_word_model(train) == word_vocab.build_word_model(list(train))
  with pytest.raises(ValueError, match="no word"):
    word_vocab.build_word_model(["", " "])


def test_word_vocabulary_normalises_nothing_but_u_ffff_and_loads_without_a_log_line(tmp_path):
  """The character map holds one rule (U+FFFF -> U+FFFD); every other character, whitespace included, passes
  as written, in SentencePiece's Python copy (seqio's decode) and in tf_text's (seqio's dataset tokenizer), which
  give the same ids. tf_text's copy, which logs "precompiled_charsmap is empty" for a model without a map (every
  COGS dataset built before), prints nothing when it loads this one; the same model with the map emptied still
  makes it log, so the test sees the line where it would be."""
  from remixer_t5.data import word_vocab
  from sentencepiece import sentencepiece_model_pb2 as pb

  texts = ["A rose was helped by a dog .", "rose ( x _ 1 ) AND help . theme ( x _ 3 , x _ 1 )"]
  model = word_vocab.build_word_model(texts)
  proto = pb.ModelProto()
  proto.ParseFromString(model)
  assert proto.normalizer_spec.precompiled_charsmap
  proto.normalizer_spec.precompiled_charsmap, proto.normalizer_spec.name = b"", "identity"
  (tmp_path / "empty.model").write_bytes(proto.SerializeToString())
  v = _vocab(tmp_path, texts)
  # Characters that NFKC or SentencePiece's default rules would change (ligature, full-width, compatibility
  # forms, combining marks, no-break space, tabs, runs of spaces), and U+FFFE beside the one mapped character.
  kept = ["\ufb01ne \uff21\uff22 \u2460 e\u0301 a\u00a0b \t x", "  two  spaces ", "\ufffe \U0001f600", "rose ( x _ 1 )"]
  for text in kept:
    assert v.decode(v.encode(text)) == text
  assert v.decode(v.encode("x \uffff y")) == "x \ufffd y"
  every = kept + ["x \uffff y"]
  (tmp_path / "texts.json").write_text(json.dumps(every), encoding="utf-8")
  script = (
    "import json, sys, tensorflow_text as t\n"
    "texts = json.load(open(sys.argv[3], encoding='utf-8'))\n"
    "for name in ('ours', 'empty'):\n"
    "  print('LOADING ' + name, file=sys.stderr, flush=True)\n"
    "  tok = t.SentencepieceTokenizer(model=open(sys.argv[1 if name == 'ours' else 2], 'rb').read())\n"
    "  print(json.dumps(tok.tokenize(texts).to_list()), flush=True)\n"
  )
  done = subprocess.run(
    [
      sys.executable,
      "-c",
      script,
      str(tmp_path / "words.model"),
      str(tmp_path / "empty.model"),
      str(tmp_path / "texts.json"),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads(done.stdout.splitlines()[0]) == [list(v.encode(t)) for t in every]
  ours, empty = done.stderr.split("LOADING ours")[1].split("LOADING empty")
  assert "precompiled_charsmap" not in ours, ours[-2000:]
  assert empty.count("precompiled_charsmap is empty") == 1, empty[-2000:]


@pytest.mark.skipif(not SHARED_COGS.is_dir(), reason="../shared/data/cogs (the COGS release files) is absent")
def test_every_cogs_split_round_trips_through_the_train_word_vocabulary(tmp_path, monkeypatch):
  from remixer_t5.data import word_vocab
  from remixer_t5.tasks import cogs

  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(SHARED_COGS.parent))
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(tmp_path))
  vocab = cogs.cogs_word_vocabulary()
  train_words = {w for r in cogs.read_cogs_tsv(cogs.split_path("train")) for t in r[:2] for w in t.split(" ")}
  unseen = set()
  for split in ("train", "validation", "test", "gen"):
    rows = cogs.read_cogs_tsv(cogs.split_path(split))
    assert word_vocab.round_trip_failures(vocab, [t for r in rows for t in r[:2]]) == [], split
    unseen |= {w for r in rows for t in r[:2] for w in t.split(" ")} - train_words
  assert "gardner" in unseen and "44" in unseen  # what a train-only word list could not hold
  assert list((tmp_path / "cogs").glob("word_vocab_*.model"))  # cached under $REMIXER_T5_CACHE_DIR/cogs


# --- the gen file -----------------------------------------------------------------------------------------
def _tsv(path: Path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


def test_gen_split_reads_gen_tsv_else_the_sample_else_the_given_file(tmp_path, monkeypatch):
  from remixer_t5.tasks import cogs

  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  monkeypatch.delenv(cogs.GEN_ENV_VAR, raising=False)
  (tmp_path / "cogs").mkdir()
  with pytest.raises(FileNotFoundError, match="gen_sample.tsv"):
    cogs.gen_path()
  _tsv(tmp_path / "cogs" / "gen_sample.tsv", [("A b .", "b ( x _ 1 )", "pp_recursion")])
  assert cogs.split_path("gen").name == "gen_sample.tsv"
  _tsv(tmp_path / "cogs" / "gen.tsv", [("A b .", "b ( x _ 1 )", "pp_recursion")])
  assert cogs.split_path("gen").name == "gen.tsv"
  other = tmp_path / "elsewhere.tsv"
  _tsv(other, [("A b .", "b ( x _ 1 )", "cp_recursion")])
  try:
    cogs.set_gen_file(other)
    assert cogs.split_path("gen") == other
  finally:
    cogs.set_gen_file(None)
  with pytest.raises(FileNotFoundError, match="missing.tsv"):
    cogs.set_gen_file(tmp_path / "missing.tsv")


# --- outputs ----------------------------------------------------------------------------------------------
def _records():
  rows = []
  for model, seeds in (("t5_1_1", {0: (0.99, 0.5, 0.1), 1: (0.97, 0.7, 0.3)}), ("remixer", {0: (0.9, 0.2, 0.0)})):
    for seed, (test, cat_a, cat_b) in seeds.items():
      base = {
        "model": model,
        "seed": seed,
        "params": 1000,
        "train_steps": 10,
        "train_seconds": 5.0,
        "seconds": 1.0,
        "decode_examples_per_s": 100.0,
        "decode_tokens_per_s": 4000.0,
      }
      rows += [
        {**base, "split": "dev", "category": None, "exact_match": test, "n": 3},
        {**base, "split": "test", "category": None, "exact_match": test, "n": 3},
        {**base, "split": "gen", "category": "obj_to_subj_common", "exact_match": cat_a, "n": 2},
        {**base, "split": "gen", "category": "pp_recursion", "exact_match": cat_b, "n": 2},
        {
          **base,
          "split": "gen",
          "category": "mean over categories",
          "exact_match": (cat_a + cat_b) / 2,
          "n": 4,
          "categories": 2,
        },
      ]
  return rows


def test_table_gives_mean_and_range_over_seeds_per_category(tmp_path):
  from remixer_t5.repro import cogs as repro

  table = repro.markdown_table(_records())
  t5 = next(line for line in table.splitlines() if line.startswith("| T5.1.1"))
  cells = [c.strip() for c in t5.strip("|").split("|")]
  head = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
  col = dict(zip(head, cells))
  assert col["seeds"] == "2" and col["test"] == "98.0 (97.0-99.0)"
  assert col["gen: obj_to_subj_common"] == "60.0 (50.0-70.0)" and col["gen: pp_recursion"] == "20.0 (10.0-30.0)"
  assert col["gen mean"] == "40.0 (30.0-50.0)"
  remixer = dict(
    zip(
      head,
      [
        c.strip()
        for c in next(line for line in table.splitlines() if line.startswith("| Remixer")).strip("|").split("|")
      ],
    )
  )
  assert remixer["seeds"] == "1" and remixer["gen mean"] == "10.0"
  assert col["steps"] == "10"  # rows without cooldown_steps (folders from before --cooldown)
  cooled = repro.markdown_table([{**r, "cooldown_steps": 4} for r in _records()])
  assert (
    dict(
      zip(
        head,
        [
          c.strip()
          for c in next(line for line in cooled.splitlines() if line.startswith("| T5.1.1")).strip("|").split("|")
        ],
      )
    )["steps"]
    == "10 (cooldown 4)"
  )
  scaled = repro.markdown_table([{**r, "base_lr": 2.0} for r in _records()])
  assert (
    dict(
      zip(
        head,
        [
          c.strip()
          for c in next(line for line in scaled.splitlines() if line.startswith("| T5.1.1")).strip("|").split("|")
        ],
      )
    )["steps"]
    == "10 (base lr 2)"
  )
  repro.plot(_records(), tmp_path / "cogs.png")
  assert (tmp_path / "cogs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_stats_count_tokens_up_to_eos():
  from remixer_t5.training import evaluation

  tokens = np.array([[5, 6, 1, 0, 0], [5, 1, 0, 0, 0], [4, 4, 4, 4, 4]])
  assert evaluation._generated(tokens).tolist() == [3, 2, 5]


def test_settings_refuse_bad_values():
  from remixer_t5.repro import cogs as repro

  with pytest.raises(ValueError, match="--steps"):
    repro.Settings(steps=0)
  with pytest.raises(ValueError, match="--seeds"):
    repro.Settings(seeds=(1, 1))
  with pytest.raises(ValueError, match="--models must be distinct, got t5_1_1,t5_1_1"):
    repro.Settings(models=("t5_1_1", "t5_1_1"))  # one run folder, trained twice at once
  with pytest.raises(ValueError, match="gmlp_nope.*models with a COGS config: .*t5_1_1"):
    repro.model_gin("gmlp_nope")
  import argparse

  parser = argparse.ArgumentParser()
  repro.add_arguments(parser)
  with pytest.raises(ValueError, match="--seeds 0: a single number is a count.*--seeds 1"):
    repro.settings_from_args(parser.parse_args(["--seeds", "0"]))
  assert repro.settings_from_args(parser.parse_args(["--seeds", "2"])).seeds == (0, 1)
  assert repro.settings_from_args(parser.parse_args(["--seeds", "0,3"])).seeds == (0, 3)


# --- end to end -------------------------------------------------------------------------------------------
def _toy_cogs(folder: Path) -> None:
  """A COGS-shaped toy in the release's TSV format: 'The N V .' -> '* N ( x _ 1 ) ; V . agent ( x _ 2 , x _ 1 )'."""
  nouns, verbs = ["cat", "dog", "girl", "boy", "bird"], [("smiled", "smile"), ("ran", "run"), ("slept", "sleep")]
  rows = [
    (f"The {n} {v} .", f"* {n} ( x _ 1 ) ; {lemma} . agent ( x _ 2 , x _ 1 )", "in_distribution")
    for n in nouns
    for v, lemma in verbs
  ]
  _tsv(folder / "cogs" / "train.tsv", rows * 4)
  _tsv(folder / "cogs" / "dev.tsv", rows[:6])
  _tsv(folder / "cogs" / "test.tsv", rows[6:12])
  _tsv(
    folder / "cogs" / "gen_sample.tsv",
    [
      ("The hedgehog smiled .", "* hedgehog ( x _ 1 ) ; smile . agent ( x _ 2 , x _ 1 )", "new_noun"),
      ("The cat ran .", "* cat ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "seen"),
      ("The dog slept .", "* dog ( x _ 1 ) ; sleep . agent ( x _ 2 , x _ 1 )", "seen"),
    ],
  )


@pytest.mark.integration
def test_repro_cogs_end_to_end_through_the_trainer_and_resumes(tmp_path, fresh_cache, monkeypatch, capsys):
  """Two models, 1 seed, a few steps on a toy in COGS's format: every row, the table and plot; a rerun keeps
  the finished runs; other settings in the same folder are refused."""
  _toy_cogs(tmp_path / "data")
  out = tmp_path / "out"
  env = {**__import__("os").environ, "REMIXER_T5_CACHE_DIR": str(fresh_cache), "JAX_PLATFORMS": "cpu"}
  cmd = [
    sys.executable,
    "-m",
    "remixer_t5",
    "repro",
    "cogs",
    "--models",
    "t5_1_1,remixer",
    "--seeds",
    "1",
    "--steps",
    "4",
    "--batch_size",
    "2",
    "--warmup",
    "2",
    "--eval_batch_size",
    "8",
    "--data_dir",
    str(tmp_path / "data"),
    "--json",
    "--out",
    str(out),
    "--jobs",
    "2",
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert {(r["model"], r["split"], r["category"]) for r in rows} == {
    (m, s, c)
    for m in ("t5_1_1", "remixer")
    for s, c in (("dev", None), ("test", None), ("gen", "new_noun"), ("gen", "seen"), ("gen", "mean over categories"))
  }
  for r in rows:
    assert 0.0 <= r["exact_match"] <= 1.0 and r["train_steps"] == 4 and r["params"] > 0 and r["seed"] == 0
    assert r["decode_examples_per_s"] > 0 and r["decode_tokens_per_s"] > 0
  n = {(r["model"], r["split"], r["category"]): r["n"] for r in rows}
  assert n[("t5_1_1", "dev", None)] == 6 and n[("t5_1_1", "gen", "seen")] == 2
  assert n[("t5_1_1", "gen", "mean over categories")] == 3
  assert "0 do not round-trip" in proc.stderr and "gen_sample.tsv" in proc.stderr
  # the gen file named without this machine's folders (the data folder came from --data_dir)
  assert json.loads((out / "settings.json").read_text())["gen_file"] == "$REMIXER_T5_DATA_DIR/cogs/gen_sample.tsv"
  written = "".join((out / f).read_text() for f in ("settings.json", "data.json", "cogs_table.md", "cogs.jsonl"))
  assert str(tmp_path) not in written and str(tmp_path.resolve()) not in written
  assert "longer than necessary" not in proc.stderr  # seqio's warning on the deliberate decode lengths
  assert {p.name for p in out.iterdir()} >= {"cogs.jsonl", "cogs_table.md", "cogs.png", "settings.json"}
  assert len((out / "cogs.jsonl").read_text().splitlines()) == len(rows)
  assert "| T5.1.1 |" in (out / "cogs_table.md").read_text()
  # The run went through the trainer (its checkpoint and metrics) and seqio's evaluator (its logs).
  run = out / "runs" / "t5_1_1-seed0"
  assert (run / "checkpoints" / "4").is_dir() and (run / "metrics.jsonl").is_file()
  # --jobs 2: the two models trained at the same time, each pinned (by its own report) to its share of the cores.
  spans = []
  for m in ("t5_1_1", "remixer"):
    last = [
      r
      for r in map(json.loads, (out / "runs" / f"{m}-seed0" / "metrics.jsonl").read_text().splitlines())
      if r["split"] == "train"
    ][-1]
    spans.append((last["time"] - last["window_seconds"], last["time"]))
  assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans  # the training windows overlap
  if hasattr(__import__("os"), "sched_getaffinity") and len(__import__("os").sched_getaffinity(0)) >= 2:
    pinned = [
      (out / "runs" / f"{m}-seed0" / "train.log").read_text().split("cores: this process runs on ")[1].split()[0]
      for m in ("t5_1_1", "remixer")
    ]
    assert len(set(pinned)) == 2, pinned
    # and each decoded in its own child on the same cores (decode_run), not one after the other in the driver
    decoded = [
      (out / "runs" / f"{m}-seed0" / "decode.log").read_text().split("cores: this process runs on ")[1].split()[0]
      for m in ("t5_1_1", "remixer")
    ]
    assert decoded == pinned
    assert all((out / "runs" / f"{m}-seed0" / "decode.json").is_file() for m in ("t5_1_1", "remixer"))
  assert {r["jobs"] for r in rows} == {2}
  assert list((run / "inference_eval").glob("cogs_words-*.jsonl"))
  from remixer_t5.repro import cogs as repro

  trained = repro.training_seconds(run)  # the trainer's windows, not the subprocess's wall time
  assert trained is not None and trained > 0
  assert {r["train_seconds"] for r in rows if r["model"] == "t5_1_1"} == {round(trained, 1)}
  # The rerun and the refusal in this process (the CLI's main, without another interpreter start-up).
  from remixer_t5 import cli

  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(fresh_cache))
  capsys.readouterr()
  assert cli.main(cmd[3:]) == 0
  again = capsys.readouterr()
  assert "done before, kept" in again.err and not re.search(r"training \d+ steps", again.err)  # no run restarted
  key = lambda r: (r["model"], r["split"], r["category"] or "")
  assert sorted((json.loads(line) for line in again.out.splitlines() if line.startswith("{")), key=key) == sorted(
    rows, key=key
  )
  assert cli.main(cmd[3 : cmd.index("--steps") + 1] + ["5"] + cmd[cmd.index("--steps") + 2 :]) == 2
  assert "other settings" in capsys.readouterr().err
  # The unpinned path (--jobs 1: decoded in this process, under the lock) gives the same fields and example
  # counts as the pinned child wrote (not the same scores: an almost untrained model, other thread counts).
  if not (hasattr(__import__("os"), "sched_getaffinity") and len(__import__("os").sched_getaffinity(0)) >= 2):
    return  # unpinned there too (no affinity, or one core): no child decoded
  import threading
  from remixer_t5.tasks import sources

  monkeypatch.setenv(sources.DATA_ENV_VAR, str((tmp_path / "data").resolve()))
  child = json.loads((run / "decode.json").read_text())
  settings = repro.Settings(
    models=("t5_1_1", "remixer"), seeds=(0,), steps=4, batch_size=2, warmup=2, eval_batch_size=8
  )
  here = repro.decode_run(
    "t5_1_1",
    0,
    settings,
    json.loads((out / "data.json").read_text()),
    run,
    lambda s: None,
    cpus=None,
    lock=threading.Lock(),
  )
  assert set(here) == set(child) == set(repro.SPLITS)
  for split in repro.SPLITS:
    assert {k for k in here[split] if k != "wall_seconds"} == {k for k in child[split] if k != "wall_seconds"}
    assert here[split]["examples"] == child[split]["examples"]


def test_a_failed_decoding_child_names_its_log_and_writes_no_result(tmp_path):
  """decode_run's pinned path: the child's failure (here: no checkpoint to decode) is one error naming the run and
  its log, and no decode.json is left behind for a later read."""
  import os
  from remixer_t5.repro import cogs as repro

  if not hasattr(os, "sched_getaffinity"):
    pytest.skip("pinning needs sched_setaffinity (Linux)")
  run_dir = tmp_path / "run"
  (run_dir / "checkpoints").mkdir(parents=True)  # a run folder without a finished checkpoint
  (run_dir / "decode.json").write_text("{}")  # a stale result from an earlier try must not be read
  data = {"model_lengths": {"inputs": 16, "targets": 32}, "splits": {s: {"max_target_tokens": 8} for s in repro.SPLITS}}
  lines = []
  with pytest.raises(
    RuntimeError,
    match=r"decoding t5_1_1 seed 0 failed \(exit \d+\): remixer-t5: error: "
    r"no finished checkpoint in .*; see .*decode\.log",
  ):
    repro.decode_run(
      "t5_1_1",
      0,
      repro.Settings(models=("t5_1_1",), seeds=(0,), steps=4),
      data,
      run_dir,
      lines.append,
      cpus=sorted(os.sched_getaffinity(0))[:1],
    )
  assert not (run_dir / "decode.json").exists()
  log = (run_dir / "decode.log").read_text()
  assert "--decode_spec" in log and "cores: this process runs on" in log


def test_eta_counts_the_runs_in_flight_and_the_free_cores():
  """--quick's first finished run used to say 'ETA 13 min' with the other run a minute from its end: the ETA
  took the runs left as one after the other, each as long as the mean so far."""
  from remixer_t5.repro.cogs import eta_seconds

  assert eta_seconds(800.0, [740.0], 0, 2) == pytest.approx(60.0)  # --quick: the other run 740 s into its 800
  assert eta_seconds(100.0, [], 4, 1) == pytest.approx(400.0)  # one after the other
  assert eta_seconds(100.0, [], 4, 2) == pytest.approx(200.0)  # two at a time
  assert eta_seconds(100.0, [90.0], 3, 2) == pytest.approx(200.0)  # slots free now and in 10 s: 0+100+100, 10+100
  assert eta_seconds(100.0, [150.0], 0, 2) == 0.0  # a run slower than the mean: not negative
  assert eta_seconds(100.0, [], 0, 2) == 0.0


def test_a_resumed_run_counts_its_training_in_the_eta():
  """A sweep resumed after seed 0 had trained said 'ETA 5 min' for two more 12,000-step runs: seed 0's wall
  time in the resumed driver was its decode alone. Its cost is its training over all starts plus decode."""
  from remixer_t5.repro.cogs import eta_seconds, run_cost

  resumed = run_cost(150.0, 3600.0, 100.0)
  assert resumed == pytest.approx(3700.0)
  assert eta_seconds(resumed, [], 2, 1) == pytest.approx(7400.0)
  assert run_cost(3800.0, 3600.0, 100.0) == pytest.approx(3800.0)  # a fresh run: its wall, start-up included


def test_jobs_split_the_cores_into_groups(monkeypatch):
  from remixer_t5.repro import cogs as repro

  monkeypatch.setattr(repro.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
  monkeypatch.setattr(repro.os, "sched_setaffinity", lambda pid, cpus: None, raising=False)
  assert repro.core_groups(1) == [None]
  assert repro.core_groups(2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert repro.core_groups(3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
  assert repro.core_groups(8) == [[c] for c in range(8)]
  with pytest.raises(ValueError, match=r"--jobs 9: this process may use 8 core"):
    repro.core_groups(9)
  with pytest.raises(ValueError, match=r"--jobs 0: at least 1"):
    repro.core_groups(0)


def test_quick_trains_its_runs_side_by_side_where_there_are_two_cores(monkeypatch):
  import argparse
  from remixer_t5.repro import cogs as repro

  parser = argparse.ArgumentParser()
  repro.add_arguments(parser)
  jobs = lambda *argv: repro.jobs_from_args(parser.parse_args(list(argv)))
  monkeypatch.setattr(repro.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
  assert jobs("--quick") == repro.QUICK_JOBS == 2
  assert jobs() == 1 and jobs("--quick", "--jobs", "1") == 1 and jobs("--jobs", "2") == 2
  monkeypatch.setattr(repro.os, "sched_getaffinity", lambda pid: {3}, raising=False)
  assert jobs("--quick") == 1  # one core: one run after the other
  monkeypatch.setattr(repro.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
  monkeypatch.delattr(repro.os, "sched_setaffinity", raising=False)
  assert jobs("--quick") == 1  # no pinning (macOS): not side by side unless asked


def _stub_sweep(monkeypatch, repro, train_run, evaluate_run, rows):
  """`repro.run` with its data, training, decoding and outputs replaced: the sweep's own scheduling alone."""
  monkeypatch.setattr(
    repro,
    "measure_splits",
    lambda progress, n: {
      "gen_file": "gen.tsv",
      "gen_digest": "x",
      "model_lengths": {"inputs": 16, "targets": 32},
      "splits": {"gen": {"categories": {"c": 1}, "round_trip_failures": 0}},
    },
  )
  monkeypatch.setattr(repro, "train_run", train_run)
  monkeypatch.setattr(repro, "evaluate_run", evaluate_run)
  monkeypatch.setattr(
    repro,
    "decode_run",
    lambda model, seed, settings, data, run_dir, progress, cpus=None, lock=None: evaluate_run(
      model, seed, settings, data, run_dir, progress
    ),
  )
  monkeypatch.setattr(repro, "training_seconds", lambda run_dir: None)
  monkeypatch.setattr(repro, "_param_count", lambda run_dir: 1)
  monkeypatch.setattr(repro, "_rows", rows)
  monkeypatch.setattr(repro, "_write_outputs", lambda *a: None)


def test_a_lone_run_left_is_not_pinned_to_a_share_of_the_cores(tmp_path, monkeypatch):
  """--jobs 2 with one run to train (one model, or the other already done): it gets every core, not half."""
  from remixer_t5.repro import cogs as repro

  monkeypatch.setattr(repro.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
  monkeypatch.setattr(repro.os, "sched_setaffinity", lambda pid, cpus: None, raising=False)
  pinned = []
  _stub_sweep(
    monkeypatch,
    repro,
    train_run=lambda model, seed, settings, lengths, run_dir, progress, cpus=None: pinned.append((model, cpus)) or 1.0,
    evaluate_run=lambda *a: {s: {"seconds": 1.0, "exact_match": 50.0} for s in ("dev", "test", "gen")},
    rows=lambda model, seed, *a: [{"model": model, "seed": seed, "exact_match": 0.5}],
  )
  rows = repro.run(repro.Settings(models=("t5_1_1",), seeds=(0,), steps=4), tmp_path / "one", jobs=2)
  assert pinned == [("t5_1_1", None)] and [r["jobs"] for r in rows] == [1]
  pinned.clear()
  rows = repro.run(repro.Settings(models=("t5_1_1", "remixer"), seeds=(0,), steps=4), tmp_path / "two", jobs=2)
  assert sorted(cpus for _, cpus in pinned) == [[0], [1]] and {r["jobs"] for r in rows} == {2}


def test_training_seconds_count_each_step_once_across_a_resume(tmp_path):
  """A run killed after step 300 and resumed from its step-200 checkpoint logs 300 twice: the second start's
  window counts (its compile included), the first's is lost work; other splits are not training."""
  from remixer_t5.repro import cogs as repro

  rows = [
    (100, "train", 10.0),
    (200, "train", 5.0),
    (200, "validation", 3.0),
    (300, "train", 5.0),
    (300, "train", 8.0),
    (400, "train", 5.0),
  ]
  (tmp_path / "metrics.jsonl").write_text(
    "".join(json.dumps({"step": st, "split": sp, "time": 0.0, "window_seconds": w}) + "\n" for st, sp, w in rows)
  )
  assert repro.training_seconds(tmp_path) == pytest.approx(10 + 5 + 8 + 5)
  with (tmp_path / "metrics.jsonl").open("a") as f:  # a log from before the trainer wrote windows
    f.write(json.dumps({"step": 500, "split": "train", "time": 0.0}) + "\n")
  assert repro.training_seconds(tmp_path) is None
  assert repro.training_seconds(tmp_path / "never_started") is None


def test_a_preempted_training_is_not_decoded_as_a_finished_run(tmp_path, monkeypatch):
  """SIGTERM makes the trainer save, log and exit 0; the sweep must stop there, not score that checkpoint."""
  from remixer_t5.repro import cogs as repro

  class Preempted:  # what `remixer-t5 train` does on SIGTERM before its last step: exit 0, no final checkpoint
    def __init__(self, cmd, **kwargs):
      self.stdout, self.returncode = iter(["[train] step 2 | loss 3.0\n", "preempted (SIGTERM): saved step 2\n"]), 0

    def wait(self):
      return self.returncode

  monkeypatch.setattr(repro.subprocess, "Popen", Preempted)
  with pytest.raises(RuntimeError, match=r"t5_1_1 seed 0 stopped at step None of 4 .*rerun the same command"):
    repro.train_run(
      "t5_1_1", 0, repro.Settings(steps=4), {"inputs": 64, "targets": 400}, tmp_path / "run", lambda s: None
    )
  assert "preempted (SIGTERM)" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("steps,period", [(12000, 1000), (600, 600)])
def test_runs_checkpoint_often_enough_to_survive_a_kill(tmp_path, steps, period):
  from remixer_t5.repro import cogs as repro

  args = repro._gin_args("t5_1_1", tmp_path, 0, repro.Settings(steps=steps), {"inputs": 64, "targets": 400})
  assert f"--gin.CHECKPOINT_PERIOD={period}" in args and f"--gin.TRAIN_STEPS={steps}" in args


def test_decode_lengths_are_each_splits_longest_target():
  from remixer_t5.repro import cogs as repro

  data = {
    "model_lengths": {"inputs": 64, "targets": 400},
    "splits": {
      "validation": {"max_target_tokens": 173},
      "test": {"max_target_tokens": 138},
      "gen": {"max_target_tokens": 385},
    },
  }
  assert repro.decode_lengths(data, "validation") == {"inputs": 64, "targets": 176}
  assert repro.decode_lengths(data, "test") == {"inputs": 64, "targets": 144}
  assert repro.decode_lengths(data, "gen") == {"inputs": 64, "targets": 400}


@pytest.mark.parametrize("model", [pytest.param("t5_1_1", marks=pytest.mark.integration), "remixer"])
def test_decoding_shorter_than_the_model_length_decodes_the_same_prefix(model):
  """Dev and test decode with a cache shorter than the model length (decode_lengths): the fixed-length
  Remixer (the decoder's H sized to the declared 576) and T5 give the first tokens of the full-length decode,
  token for token."""
  import jax
  from remixer_t5 import gin_utils
  from remixer_t5.repro import cogs as repro

  gin_utils.parse_gin([repro.model_gin(model), repro.RUN_FILE], ["MODEL_DIR='/nonexistent'"])
  mdl = gin_utils.macro("MODEL")
  long, short = gin_utils.macro("MODEL_LENGTHS")["targets"], 24
  params = mdl.init_variables(
    jax.random.PRNGKey(0),
    {"encoder_input_tokens": (1, 64), "decoder_input_tokens": (1, long), "decoder_target_tokens": (1, long)},
  )["params"]
  # Make the untrained decoder emit varied tokens (no EOS): scale the output layer's weights up.
  params = jax.tree_util.tree_map(lambda x: x * 3.0, params)
  enc = np.random.default_rng(0).integers(3, 1000, size=(3, 64)).astype(np.int32)
  full = np.asarray(mdl.predict_batch(params, {"encoder_input_tokens": enc}, max_decode_length=long))
  part = np.asarray(mdl.predict_batch(params, {"encoder_input_tokens": enc}, max_decode_length=short))
  assert len(set(full[:, :short].ravel().tolist())) > 3  # a real sequence, not one repeated token
  np.testing.assert_array_equal(part, full[:, :short])


@pytest.mark.integration
def test_cogs_curve_decodes_every_kept_checkpoint(tmp_path, fresh_cache):
  """`remixer-t5 repro cogs-curve`: the sweep's training with every checkpoint kept, then test and gen decoded at
  each."""
  _toy_cogs(tmp_path / "data")
  env = {
    **__import__("os").environ,
    "REMIXER_T5_CACHE_DIR": str(fresh_cache),
    "JAX_PLATFORMS": "cpu",
    "REMIXER_T5_DATA_DIR": str(tmp_path / "data"),
  }
  cmd = [
    sys.executable,
    "-m",
    "remixer_t5",
    "repro",
    "cogs-curve",
    "--model",
    "t5_1_1",
    "--steps",
    "4",
    "--every",
    "2",
    "--out",
    str(tmp_path / "out"),
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "out" / "curve.jsonl").read_text().splitlines()]
  assert {(r["step"], r["split"], r["category"]) for r in rows} == {
    (s, sp, c)
    for s in (2, 4)
    for sp, c in (("test", None), ("gen", "mean over categories"), ("gen", "new_noun"), ("gen", "seen"))
  }
  assert all(0.0 <= r["exact_match"] <= 1.0 for r in rows)
  run = tmp_path / "out" / "runs" / "t5_1_1-seed0"
  assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
  assert (tmp_path / "out" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _trainers_schedule(tmp_path, settings):
  """The run's gin flags for `settings` and the learning-rate schedule the trainer is given by them."""
  import gin
  from remixer_t5 import gin_utils
  from remixer_t5.repro import cogs as repro

  flags = repro._gin_args("t5_1_1", tmp_path, 0, settings, {"inputs": 64, "targets": 400})
  gin_utils.parse_gin(
    [f[len("--gin_file=") :] for f in flags if f.startswith("--gin_file=")],
    [f[len("--gin.") :] for f in flags if f.startswith("--gin.")],
  )
  return flags, gin.query_parameter("remixer_t5.training.run_config.Training.learning_rate").scoped_configurable_fn()


def _old_folder_resumes(tmp_path, key, default, other):
  """settings.json of a folder from before setting `key` existed: the same run with its default resumes, one
  with `other` does not."""
  from remixer_t5.repro import cogs as repro

  record = {
    "settings": {k: v for k, v in __import__("dataclasses").asdict(repro.Settings()).items() if k != key}
    | {"models": None, "seeds": None},
    "gen_file": "x",
    "model_lengths": {"inputs": 64, "targets": 400},
  }
  (tmp_path / "settings.json").write_text(json.dumps(record))
  assert repro.settings_match(tmp_path / "settings.json", {**record, "settings": {**record["settings"], key: default}})
  assert not repro.settings_match(
    tmp_path / "settings.json", {**record, "settings": {**record["settings"], key: other}}
  )


def test_cooldown_reaches_the_trainers_schedule_and_old_folders_still_resume(tmp_path):
  """--cooldown binds the schedule the trainer is given (through the run's gin flags): T5's rsqrt until the
  last N steps, then linearly to 0 at the final step. A folder made before the setting existed resumes."""
  import gin
  from remixer_t5.training import optim
  from remixer_t5.repro import cogs as repro

  for bad in (101, 1, -1):
    with pytest.raises(ValueError, match="--cooldown must be 0 .none. or 2 to --steps"):
      repro.Settings(steps=100, cooldown=bad)
  plain = optim.rsqrt_schedule(1.0, 300)
  for cooldown in (0, 1500):
    schedule = _trainers_schedule(tmp_path, repro.Settings(steps=6000, cooldown=cooldown))[1]
    assert float(schedule(4500)) == float(plain(4500))
    assert float(schedule(6000)) == (0.0 if cooldown else float(plain(6000)))  # ends with TRAIN_STEPS
    assert float(schedule(5999)) == pytest.approx(float(plain(5999)) / (1500 if cooldown else 1), rel=1e-5)
    assert float(schedule(5250)) == pytest.approx(float(plain(5250)) * (0.5 if cooldown else 1.0), rel=1e-6)
  gin.clear_config()
  _old_folder_resumes(tmp_path, "cooldown", 0, 10)


def test_base_lr_scales_the_trainers_schedule_and_old_folders_still_resume(tmp_path):
  """--base_lr is the base of the rsqrt schedule the trainer is given (through the run's gin flags): every
  step's rate scales with it; the default passes no flag, and a folder from before the setting resumes."""
  import gin
  from remixer_t5.training import optim
  from remixer_t5.repro import cogs as repro

  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="--base_lr must be a positive finite number"):
      repro.Settings(base_lr=bad)
  plain = optim.rsqrt_schedule(1.0, 300)
  for base in (1.0, 2.5):
    flags, schedule = _trainers_schedule(tmp_path, repro.Settings(steps=3000, base_lr=base))
    assert any("base_learning_rate" in f for f in flags) == (base != 1.0)
    for step in (0, 300, 2999):
      assert float(schedule(step)) == pytest.approx(base * float(plain(step)), rel=1e-6)
  gin.clear_config()
  _old_folder_resumes(tmp_path, "base_lr", 1.0, 2.0)
  parser = __import__("argparse").ArgumentParser()
  repro.add_arguments(parser)
  assert repro.settings_from_args(parser.parse_args(["--base_lr", "2"])).base_lr == 2.0


def test_the_gen_file_is_named_portably_and_known_by_its_bytes(tmp_path, monkeypatch):
  """Rows and settings.json name the gen file relative to $REMIXER_T5_DATA_DIR when it lies there; a folder
  resumes on another machine (another data folder) when the gen file's bytes are the same, and not when they
  differ; a folder from before the digest compares the file's name."""
  from remixer_t5.repro import cogs as repro

  data = tmp_path / "data"
  _toy_cogs(data)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(data))
  assert repro.portable_path(data / "cogs" / "gen_sample.tsv") == "$REMIXER_T5_DATA_DIR/cogs/gen_sample.tsv"
  elsewhere = tmp_path / "other" / "gen.tsv"
  assert repro.portable_path(elsewhere) == str(elsewhere.resolve())
  linked = tmp_path / "linked"  # a data folder whose cogs/ is a symbolic link elsewhere
  linked.mkdir()
  (linked / "cogs").symlink_to(data / "cogs")
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(linked))
  assert repro.portable_path(linked / "cogs" / "gen_sample.tsv") == "$REMIXER_T5_DATA_DIR/cogs/gen_sample.tsv"
  monkeypatch.delenv("REMIXER_T5_DATA_DIR")
  assert repro.portable_path(data / "cogs" / "gen_sample.tsv") == str((data / "cogs" / "gen_sample.tsv").resolve())

  settings = __import__("dataclasses").asdict(repro.Settings()) | {"models": None, "seeds": None}
  base = {"settings": settings, "model_lengths": {"inputs": 64, "targets": 400}}
  record = {**base, "gen_file": "$REMIXER_T5_DATA_DIR/cogs/gen_sample.tsv", "gen_digest": "abc"}
  path = tmp_path / "settings.json"
  path.write_text(json.dumps({**record, "gen_file": "/some/machine/data/cogs/gen_sample.tsv"}))
  assert repro.settings_match(path, record)  # same bytes, another folder
  assert not repro.settings_match(path, {**record, "gen_digest": "abd"})  # other bytes
  assert not repro.settings_match(path, {**record, "model_lengths": {"inputs": 64, "targets": 416}})
  flagged = {**record, "settings": {**settings, "gen_file": "/one/machine/gen.tsv"}}  # --gen, spelled per machine
  path.write_text(json.dumps(flagged))
  assert repro.settings_match(path, {**flagged, "settings": {**settings, "gen_file": "$REMIXER_T5_DATA_DIR/g.tsv"}})
  assert not repro.settings_match(path, {**flagged, "gen_digest": "abd"})
  path.write_text(json.dumps({**base, "gen_file": "/old/machine/cogs/gen_sample.tsv"}))  # before gen_digest
  assert repro.settings_match(path, record)
  assert not repro.settings_match(path, {**record, "gen_file": "$REMIXER_T5_DATA_DIR/cogs/gen.tsv"})


def test_an_interrupted_sweep_stops_a_decoding_child(tmp_path, monkeypatch, request):
  """--jobs 2 decodes each run in a child pinned to its cores (decode_run): Ctrl-C while it decodes ends that
  child with SIGTERM at its next progress line, and the driver does not wait for it to finish."""
  import os
  import signal
  import threading
  import time as time_lib
  from remixer_t5.repro import cogs as repro

  if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
    pytest.skip("--jobs 2 needs 2 cores")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the test below
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  children, real_popen = [], subprocess.Popen

  def popen(cmd, *a, **kw):  # the decoding child: a stand-in printing one progress line every 50 ms for 30 s
    if not (isinstance(cmd, list) and "--decode_spec" in cmd):
      return real_popen(cmd, *a, **kw)  # everything else (the module is subprocess's own)
    model = json.loads(Path(cmd[cmd.index("--decode_spec") + 1]).read_text())["model"]
    child = real_popen(
      [
        sys.executable,
        "-u",
        "-c",
        f"import time\nfor k in range(600):\n  print('{model} seed 0 test: decoded', k, flush=True); time.sleep(0.05)",
      ],
      **kw,
    )
    children.append(child)
    if len(children) == 1:
      threading.Timer(1.0, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)).start()
    return child

  monkeypatch.setattr(repro.subprocess, "Popen", popen)
  real_decode_run = repro.decode_run  # the real one, pinned children and all: _stub_sweep replaces it
  _stub_sweep(
    monkeypatch,
    repro,
    train_run=lambda *a, **k: 1.0,
    evaluate_run=None,
    rows=lambda *a: [{"exact_match": 0.5, "seconds": 1.0}],
  )
  monkeypatch.setattr(repro, "decode_run", real_decode_run)
  t0 = time_lib.time()
  with pytest.raises(KeyboardInterrupt):
    repro.run(repro.Settings(models=("remixer", "t5_1_1"), seeds=(0,), steps=4), tmp_path, jobs=2)
  assert time_lib.time() - t0 < 15
  assert children and all(c.wait(5) == -signal.SIGTERM for c in children)
  assert "decoded 5" in (tmp_path / "runs" / "remixer-seed0" / "decode.log").read_text()  # it did decode a while


@pytest.mark.parametrize("where", ["decode", "training"])
def test_an_interrupted_sweep_stops_its_running_runs(tmp_path, monkeypatch, request, where):
  """Ctrl-C (SIGINT to the driver) while a run decodes or trains: the decode stops at its next batch's
  progress line and the training child gets SIGTERM (the trainer saves and exits), instead of the driver
  waiting for them to finish; then the interrupt propagates."""
  import os
  import signal
  import threading
  import time as time_lib
  from remixer_t5.repro import cogs as repro

  if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
    pytest.skip("--jobs 2 needs 2 cores")
  seen = {}
  ctrl_c = lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
  # Python's own Ctrl-C handler: a process started in the background by a non-interactive shell (CI) inherits
  # SIGINT ignored, and Python then leaves it ignored.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

  def train_run(model, seed, settings, lengths, run_dir, progress, cpus=None):
    if model == "t5_1_1":
      time_lib.sleep(0.3)  # the Remixer decodes first
    elif where == "training":  # a child that would train for a minute; only SIGTERM ends it sooner
      child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
      repro._CHILDREN.add(child)
      seen["child"] = child
      threading.Timer(0.5, ctrl_c).start()
      child.wait()
      raise RuntimeError("training stopped")
    return 1.0

  def evaluate_run(model, seed, settings, data, run_dir, progress):
    if model == "remixer":
      k = 0
      try:
        for k in range(600):  # a 30-second decode, one progress line a batch
          if k == 5:
            ctrl_c()
          progress(f"decoded {k}")
          time_lib.sleep(0.05)
      finally:
        seen["decode_stopped_at"] = k
    return {s: {"exact_match": 50.0, "seconds": 1.0} for s in ("dev", "test", "gen")}

  _stub_sweep(monkeypatch, repro, train_run, evaluate_run, rows=lambda *a: [{"exact_match": 0.5, "seconds": 1.0}])
  t0 = time_lib.time()
  with pytest.raises(KeyboardInterrupt):
    repro.run(repro.Settings(models=("remixer", "t5_1_1"), seeds=(0,), steps=4), tmp_path, jobs=2)
  assert time_lib.time() - t0 < 15
  if where == "decode":
    assert 5 <= seen["decode_stopped_at"] < 100
  else:
    assert seen["child"].returncode == -signal.SIGTERM
