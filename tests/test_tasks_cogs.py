"""COGS seqio task (tasks/cogs.py) and its metrics (tasks/metrics.py)."""

from pathlib import Path

import pytest

SEQ_LEN = {"inputs": 64, "targets": 64}
ROWS = {
  "train.tsv": [
    ("A cat smiled .", "cat ( x _ 1 ) AND smile . agent ( x _ 2 , x _ 1 )", "in_distribution"),
    (
      "Emma ate the cake .",
      "* cake ( x _ 3 ) ; eat . agent ( x _ 1 , Emma ) AND eat . theme ( x _ 1 , x _ 3 )",
      "in_distribution",
    ),
  ],
  "dev.tsv": [("Liam slept .", "sleep . agent ( x _ 1 , Liam )", "in_distribution")],
  "test.tsv": [("The dog ran .", "* dog ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "in_distribution")],
  "gen.tsv": [
    ("A hedgehog ate the cake .", "hedgehog ( x _ 1 ) AND eat . agent ( x _ 2 , x _ 1 )", "subj_to_obj_common"),
    ("Paula slept .", "sleep . agent ( x _ 1 , Paula )", "prim_to_subj_proper"),
  ],
}


def _write(folder: Path, rows=ROWS) -> Path:
  cogs = folder / "cogs"
  cogs.mkdir(parents=True, exist_ok=True)
  for name, lines in rows.items():
    (cogs / name).write_text("".join("\t".join(r) + "\n" for r in lines), encoding="utf-8")
  return cogs


@pytest.fixture
def cogs_data(tmp_path, monkeypatch):
  cogs = _write(tmp_path)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  return cogs


T5_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"


def _task(name="cogs_embedded_vocab", vocabulary=None):
  """The COGS data with the session's embedded vocabulary (the registered `cogs` uses T5's, on GCS)."""
  import seqio

  from remixer_t5.data.vocab import get_vocabulary
  from remixer_t5.tasks import cogs

  cogs.register_cogs_task(name, vocabulary=vocabulary or get_vocabulary())
  return seqio.get_mixture_or_task(name)


def _examples(split, task=None):
  ds = (task or _task()).get_dataset(sequence_length=SEQ_LEN, split=split, shuffle=False, use_cached=False)
  return list(ds.as_numpy_iterator())


@pytest.mark.parametrize(
  "split,file", [("train", "train.tsv"), ("validation", "dev.tsv"), ("test", "test.tsv"), ("gen", "gen.tsv")]
)
def test_splits_read_through_task(embedded_env, cogs_data, split, file):
  task = _task()
  vocab = task.output_features["targets"].vocabulary
  examples = _examples(split)
  assert len(examples) == len(ROWS[file])
  for ex, (sentence, lf, category) in zip(examples, ROWS[file]):
    assert ex["inputs_pretokenized"].decode() == sentence
    assert ex["targets_pretokenized"].decode() == lf
    assert ex["category"].decode() == category
    assert ex["inputs"].tolist()[-1] == 1 and ex["targets"].tolist()[-1] == 1  # EOS
    assert vocab.decode(ex["inputs"].tolist()[:-1]) == sentence
    # The embedded vocabulary has no piece for "_" or "*" (both -> <unk>, decoded " ⁇ "):
    # everything else of the logical form round-trips (T5's vocabulary round-trips exactly, below).
    decoded = vocab.decode(ex["targets"].tolist()[:-1])
    assert " ".join(decoded.replace("\u2047", " ").split()) == " ".join(lf.replace("_", " ").replace("*", " ").split())


@pytest.mark.skipif(not T5_VOCAB.exists(), reason=f"real T5 vocabulary not found at {T5_VOCAB}")
def test_targets_round_trip_exactly_with_t5_vocabulary(embedded_env, cogs_data):
  task = _task("cogs_t5_local", str(T5_VOCAB))
  vocab = task.output_features["targets"].vocabulary
  assert vocab.vocab_size == 32100
  for ex, (_, lf, _) in zip(_examples("train", task), ROWS["train.tsv"]):
    assert vocab.decode(ex["targets"].tolist()[:-1]) == lf


def test_registration_lazy_and_idempotent(monkeypatch):
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)
  import importlib

  from remixer_t5.tasks import cogs

  importlib.reload(cogs)  # registering again: no-op, no I/O even without data
  assert cogs.register_cogs_task() == "cogs"
  import seqio

  task = seqio.get_mixture_or_task("cogs")
  assert "t5-data/vocabs/cc_all.32000" in str(task.output_features["targets"].vocabulary.sentencepiece_model_file)
  assert set(task.splits) == {"train", "validation", "test", "gen"}
  with pytest.raises(ValueError, match="already registered"):
    cogs.register_cogs_task("cogs", vocabulary=_Other())


class _Other:
  def __eq__(self, other):
    return False


def test_malformed_row_names_file_and_line(embedded_env, tmp_path, monkeypatch):
  rows = dict(ROWS)
  rows["dev.tsv"] = ROWS["dev.tsv"] + [("Only two", "fields")] + ROWS["dev.tsv"]
  cogs = _write(tmp_path, rows)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  with pytest.raises(ValueError, match=r"dev\.tsv:2: malformed COGS row.*got 2") as err:
    _examples("validation")
  assert str(cogs / "dev.tsv") in str(err.value)


def test_rows_keep_their_file_line_numbers_across_blank_lines(tmp_path):
  from remixer_t5.tasks.cogs import read_cogs_tsv, read_cogs_tsv_lines

  path = tmp_path / "gen.tsv"
  path.write_text("A b .\tb ( x _ 1 )\tc\n\n  \nC d .\td ( x _ 1 )\tc\r\n", encoding="utf-8")
  assert read_cogs_tsv_lines(path) == [(1, ("A b .", "b ( x _ 1 )", "c")), (4, ("C d .", "d ( x _ 1 )", "c"))]
  assert read_cogs_tsv(path) == [row for _, row in read_cogs_tsv_lines(path)]


def test_missing_data_errors(embedded_env, tmp_path, monkeypatch):
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)
  with pytest.raises(FileNotFoundError, match="REMIXER_T5_DATA_DIR is not set"):
    _examples("train")
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match=r"nowhere/cogs.*REMIXER_T5_DATA_DIR"):
    _examples("train")
  _write(tmp_path, {"train.tsv": ROWS["train.tsv"]})
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError, match=r"cogs/gen\.tsv.*REMIXER_T5_DATA_DIR"):
    _examples("gen")


def test_metrics_gold_and_imperfect():
  from remixer_t5.tasks.metrics import cogs_accuracy, cogs_postprocess, exact_match

  cats = ["in_distribution", "in_distribution", "in_distribution", "prim_to_subj_proper", "subj_to_obj_common"]
  golds = ["a ( x _ 1 )", "b ( x _ 1 )", "c ( x _ 1 )", "d ( x _ 1 )", "e ( x _ 1 )"]
  targets = [cogs_postprocess(g, example={"category": c.encode()}, is_target=True) for g, c in zip(golds, cats)]
  assert targets[0] == {"target": golds[0], "category": cats[0]}
  assert cogs_postprocess("p", example={"category": b"x"}, is_target=False) == "p"

  assert exact_match(golds, golds) == {"exact_match": 100.0}
  gold = cogs_accuracy(targets, list(golds))
  assert gold == {
    "exact_match": 100.0,
    "accuracy_in_distribution": 100.0,
    "accuracy_prim_to_subj_proper": 100.0,
    "accuracy_subj_to_obj_common": 100.0,
  }

  # 1 of 3 in_distribution wrong, prim_to_subj_proper wrong; whitespace differences ignored.
  preds = ["a ( x _ 1 )", "WRONG", " c  ( x _ 1 ) ", "d ( x _ 2 )", "e ( x _ 1 )"]
  assert exact_match(golds, preds) == {"exact_match": 60.0}
  got = cogs_accuracy(targets, preds)
  assert got == pytest.approx(
    {
      "exact_match": 60.0,
      "accuracy_in_distribution": 200 / 3,
      "accuracy_prim_to_subj_proper": 0.0,
      "accuracy_subj_to_obj_common": 100.0,
    }
  )
  with pytest.raises(ValueError):
    exact_match(golds, preds[:2])


def test_task_metric_wiring():
  from remixer_t5.tasks.metrics import cogs_accuracy, cogs_postprocess

  task = _task()
  assert cogs_accuracy in task.metric_fns
  assert task.postprocess_fn("lf", example={"category": b"c"}, is_target=True) == {"target": "lf", "category": "c"}
  assert cogs_postprocess is task._postprocess_fn


REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "cogs"


def test_real_files(embedded_env, monkeypatch):
  if not all((REAL / f).is_file() for f in ("train.tsv", "dev.tsv", "test.tsv")):
    pytest.skip(f"COGS release files not found in {REAL}")
  from remixer_t5.tasks.cogs import read_cogs_tsv

  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(REAL.parent))
  assert len(read_cogs_tsv(REAL / "train.tsv")) == 24155
  for split in ("validation", "test"):
    ds = _task().get_dataset(
      sequence_length={"inputs": 64, "targets": 512}, split=split, shuffle=False, use_cached=False
    )
    n = 0
    for ex in ds.as_numpy_iterator():
      if n == 0:
        assert ex["inputs_pretokenized"] and ex["targets_pretokenized"] and ex["category"]
      n += 1
    assert n == 3000


def test_word_vocabulary_pickles_before_and_after_use(cogs_data):
  """The lazy COGS word vocabulary survives pickling (seqio's Beam caching and process pools pickle tasks):
  equal, and encoding alike, whether pickled before its model was built or after."""
  import pickle

  from remixer_t5.tasks import cogs

  vocab = cogs.cogs_word_vocabulary(str(cogs_data.parent))
  before = pickle.loads(pickle.dumps(vocab))
  assert before == vocab and type(before) is type(vocab)
  ids = vocab.encode("A cat smiled .")
  after = pickle.loads(pickle.dumps(vocab))
  assert before.encode("A cat smiled .") == after.encode("A cat smiled .") == ids
  assert after.decode(ids) == "A cat smiled ." and after.vocab_size == vocab.vocab_size
