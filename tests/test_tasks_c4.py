"""C4 span-corruption seqio task (tasks/c4.py): TFDS (mocked) and local release shards."""

import gzip
import importlib
import json
import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
T5_VOCAB = SHARED / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"
C4_SAMPLE = SHARED / "data" / "c4" / "c4_en_train_sample_1000.jsonl"

WORDS = (
  "the cat sat on a mat while rain fell over the quiet town and people walked home from work "
  "with bread milk and news of the day"
).split()


def _docs(prefix, n, words=40):
  """Distinct plain-English documents (ASCII words the embedded vocabulary spells)."""
  out = []
  for i in range(n):
    body = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))
    out.append(
      {
        "text": f"Story {prefix} {i}. {body}.\nThe end.",
        "timestamp": f"2019-04-2{i % 10}T12:00:00Z",
        "url": f"https://example.com/{prefix}/{i}",
      }
    )
  return out


# file name -> documents, in the allenai/c4 release layout (gzipped and decompressed shards mixed).
TRAIN = {
  "c4-train.00000-of-00003.json.gz": _docs("a", 3),
  "c4-train.00001-of-00003.jsonl": _docs("b", 2),
  "c4-train.00002-of-00003.json.gz": _docs("c", 3),
}
VALIDATION = {"c4-validation.00000-of-00001.json": _docs("v", 2)}


def _write(folder: Path, name: str, rows) -> Path:
  lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
  path = folder / name
  path.write_bytes(gzip.compress(lines) if name.endswith(".gz") else lines)
  return path


@pytest.fixture
def data_root(tmp_path, monkeypatch):
  """An empty data directory as the process's data dir; returns <data dir>/c4/en (not yet created)."""
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  return tmp_path / "c4" / "en"


@pytest.fixture
def c4_en(data_root):
  data_root.mkdir(parents=True)
  for name, rows in {**TRAIN, **VALIDATION}.items():
    _write(data_root, name, rows)
  return data_root


def _task(name="c4_span_corruption_embedded_vocab", vocabulary=None):
  import seqio

  from remixer_t5.data.vocab import get_vocabulary
  from remixer_t5.tasks import c4

  return seqio.get_mixture_or_task(c4.register_c4_task(name, vocabulary or get_vocabulary()))


def _lengths(inputs_length):
  from remixer_t5.data.span_corruption import random_spans_helper

  return {"inputs": inputs_length, "targets": random_spans_helper(inputs_length)[1]}


def _examples(task, split="train", sequence_length=None, **kwargs):
  ds = task.get_dataset(
    sequence_length=sequence_length or _lengths(64), split=split, shuffle=False, use_cached=False, **kwargs
  )
  return list(ds.as_numpy_iterator())


def _encode(vocab, texts):
  """Token ids as the task's tokenizer (TF's SentencePiece op) gives them: the Python encoder may segment
  a few ties differently (e.g. "SSSSS" with T5's vocabulary)."""
  import tensorflow as tf

  return vocab.encode_tf(tf.constant(list(texts))).to_list()


def _is_sentinel(vocab, token):
  return token >= vocab.vocab_size - vocab.extra_ids


def _uncorrupt(vocab, inputs, targets):
  """The raw token ids: each sentinel of `inputs` replaced by what follows the same sentinel in `targets`."""
  assert inputs[-1] == targets[-1] == vocab.eos_id
  spans, current = {}, None
  for token in targets[:-1]:
    if _is_sentinel(vocab, token):
      current = spans.setdefault(token, [])
    else:
      assert current is not None, "targets must start with a sentinel"
      current.append(token)
  out = []
  for token in inputs[:-1]:
    out.extend(spans.pop(token) if _is_sentinel(vocab, token) else [token])
  assert not spans, "every target span has its sentinel in the inputs"
  return out


def _uncorrupt_all(vocab, examples):
  return [t for ex in examples for t in _uncorrupt(vocab, ex["inputs"].tolist(), ex["targets"].tolist())]


def _check_sentinels(vocab, ex):
  """Sentinels count down from the last id (<extra_id_0>), in the same order in inputs and targets."""
  ins = [t for t in ex["inputs"].tolist() if _is_sentinel(vocab, t)]
  outs = [t for t in ex["targets"].tolist() if _is_sentinel(vocab, t)]
  assert ins and ins == outs == list(range(vocab.vocab_size - 1, vocab.vocab_size - 1 - len(ins), -1))


# --- (1) TFDS ---------------------------------------------------------------------------------------------
def test_tfds_c4_version_and_features():
  import tensorflow_datasets as tfds

  from remixer_t5.tasks import c4

  builder = tfds.builder(c4.TFDS_NAME)  # code only: nothing is read or downloaded
  assert str(builder.info.version) == "3.1.0"
  assert {"text", "timestamp", "url"} <= set(builder.info.features)
  assert list(c4.c4_source().splits) == ["train", "validation"]


def test_tfds_mock_gives_span_corrupted_examples(embedded_env, monkeypatch):
  import tensorflow_datasets as tfds

  from remixer_t5.tasks import c4, sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)
  task = _task()
  vocab = task.output_features["targets"].vocabulary
  with tfds.testing.mock_data(num_examples=60, policy=tfds.testing.MockPolicy.USE_CODE):
    assert not task.source._is_local()
    examples = _examples(task, sequence_length=c4.DEFAULT_SEQUENCE_LENGTH, try_in_mem_cache=False)
  assert examples
  for ex in examples:
    assert 0 < len(ex["inputs"]) <= 512 and 0 < len(ex["targets"]) <= 114
    _check_sentinels(vocab, ex)
    assert set(ex) >= {"inputs", "targets"}


# --- (2) local shards -------------------------------------------------------------------------------------
def test_local_shards_give_the_documents_back(embedded_env, c4_en):
  task = _task()
  vocab = task.output_features["targets"].vocabulary
  assert task.source._is_local() and task.source.num_input_examples("train") is None  # never counted
  for split, files in (("train", TRAIN), ("validation", VALIDATION)):
    docs = [d["text"] for name in sorted(files) for d in files[name]]
    examples = _examples(task, split)
    assert len(examples) > 1
    for ex in examples:
      assert len(ex["inputs"]) <= 64 and len(ex["targets"]) <= _lengths(64)["targets"]
      _check_sentinels(vocab, ex)
    assert all(len(ex["inputs"]) == 64 for ex in examples[:-1])  # documents are concatenated, no padding
    raw = _uncorrupt_all(vocab, examples)
    encoded = _encode(vocab, docs)
    assert raw == [t for ids in encoded for t in ids]
    start = 0
    for doc, ids in zip(docs, encoded):
      assert vocab.decode(raw[start : start + len(ids)]) == doc.replace("\n", " ")
      start += len(ids)


def test_source_rows_keep_timestamp_and_url(c4_en):
  from remixer_t5.tasks import c4

  rows = list(c4.c4_source().get_dataset("validation", shuffle=False).as_numpy_iterator())
  want = VALIDATION["c4-validation.00000-of-00001.json"]
  assert [{k: v.decode() for k, v in r.items()} for r in rows] == want


def test_shards_split_files_disjointly(embedded_env, c4_en):
  import seqio

  from remixer_t5.tasks import c4

  source = c4.c4_source()
  names = sorted(TRAIN)
  assert [os.path.basename(f) for f in source.list_shards("train")] == names
  seen = []
  for index in range(2):
    info = seqio.ShardInfo(index=index, num_shards=2)
    mine = names[index::2]
    rows = list(source.get_dataset("train", shuffle=False, shard_info=info).as_numpy_iterator())
    assert [r["url"].decode() for r in rows] == [d["url"] for n in mine for d in TRAIN[n]]
    seen += [r["url"].decode() for r in rows]
    # Through the task too: this process's examples are exactly its own files' documents.
    task = _task()
    vocab = task.output_features["targets"].vocabulary
    raw = _uncorrupt_all(vocab, _examples(task, shard_info=info))
    assert raw == [t for ids in _encode(vocab, [d["text"] for n in mine for d in TRAIN[n]]) for t in ids]
  assert sorted(seen) == sorted(d["url"] for rows in TRAIN.values() for d in rows)  # disjoint, complete
  # Shuffled file order differs per seed but each shard still reads only its own files.
  shuffled = source.get_dataset("train", shuffle=True, seed=3, shard_info=seqio.ShardInfo(0, 2))
  assert sorted(r["url"].decode() for r in shuffled.as_numpy_iterator()) == sorted(
    d["url"] for n in names[0::2] for d in TRAIN[n]
  )


# --- (3) malformed rows -----------------------------------------------------------------------------------
def test_malformed_row_error_names_file_and_line(embedded_env, data_root):
  import tensorflow as tf

  from remixer_t5.tasks import c4

  data_root.mkdir(parents=True)
  good = _docs("m", 3)
  bad = _write(data_root, "c4-train.00000-of-00001.jsonl", [good[0], "", good[1], '{"text": "cut off', good[2]])
  with pytest.raises((ValueError, tf.errors.OpError)) as err:  # raised inside tf.data: an OpError
    _examples(_task())
  assert f"{bad}:4: malformed JSON line" in str(err.value)
  # Other bad values, straight from the reader.
  for row, message in (
    ({"url": "u"}, "lacks field"),
    ({"text": 3}, "'text' must be a string"),
    ({"text": "t", "url": 5}, "'url' must be a string"),
  ):
    path = _write(data_root, "c4-train.00000-of-00001.jsonl", [good[0], row])
    with pytest.raises(ValueError, match=f"{path}:2: .*{message}"):
      list(c4.read_c4_jsonl(str(path)))


# --- (4) missing data -------------------------------------------------------------------------------------
def test_missing_split_files_and_folder(embedded_env, data_root):
  task = _task()
  data_root.mkdir(parents=True)
  _write(data_root, "c4-train.00000-of-00001.json.gz", _docs("t", 2))
  with pytest.raises(
    FileNotFoundError,
    match=r"C4 split 'validation': no shard in .*c4/en matches "
    r"c4-validation\.\*-of-\*\.json\.gz or .*\.jsonl or .*\.json",
  ):
    _examples(task, "validation")
  # One shard both gzipped and decompressed would be read twice.
  _write(data_root, "c4-train.00000-of-00001.jsonl", _docs("t", 2))
  with pytest.raises(ValueError, match="more than one form"):
    _examples(task)


def test_missing_folder_falls_back_to_tfds_and_says_so(embedded_env, data_root):
  import tensorflow_datasets as tfds

  if (Path(tfds.core.constants.DATA_DIR) / "c4" / "en").exists():
    pytest.skip(f"TFDS has C4 prepared in {tfds.core.constants.DATA_DIR}: no error to see")
  with pytest.raises(
    FileNotFoundError,
    match=r"c4/en split 'train': no local copy \(\$REMIXER_T5_DATA_DIR=.*"
    r"TFDS 'c4/en:3\.1\.0' could not be read.*<data dir>/c4/en/",
  ):
    _examples(_task())


# --- (5) the real sample with T5's vocabulary -------------------------------------------------------------
def test_real_sample_with_t5_vocabulary(tmp_path, monkeypatch):
  if not C4_SAMPLE.is_file():
    pytest.skip(f"C4 sample not found at {C4_SAMPLE}")
  if not T5_VOCAB.is_file():
    pytest.skip(f"T5 vocabulary not found at {T5_VOCAB}")
  from remixer_t5.tasks import c4, sources

  en = tmp_path / "c4" / "en"
  en.mkdir(parents=True)
  (en / "c4-train.00000-of-00001.jsonl").symlink_to(C4_SAMPLE)
  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  task = _task("c4_span_corruption_t5_local", str(T5_VOCAB))
  vocab = task.output_features["targets"].vocabulary
  assert vocab.vocab_size == 32100
  examples = _examples(task, sequence_length=c4.DEFAULT_SEQUENCE_LENGTH)
  lengths = [(len(ex["inputs"]), len(ex["targets"])) for ex in examples]
  assert all(i <= 512 and t <= 114 for i, t in lengths)
  # Only the last example of each group of 128 concatenated documents may be short.
  assert sum(i == 512 for i, _ in lengths) >= len(lengths) - (1000 // 128 + 1)
  for ex in examples:
    _check_sentinels(vocab, ex)
  # 15% noise in spans of mean length 3 (T5 §3.3.4).
  noise = sum(sum(not _is_sentinel(vocab, t) for t in ex["targets"].tolist()[:-1]) for ex in examples)
  spans = sum(sum(_is_sentinel(vocab, t) for t in ex["targets"].tolist()) for ex in examples)
  # Un-corrupted, the examples are the documents' tokens, in order; decoded, their text.
  docs = [row["text"] for row in c4.read_c4_jsonl(str(C4_SAMPLE))]
  assert len(docs) == 1000
  encoded = _encode(vocab, docs)
  raw = _uncorrupt_all(vocab, examples)
  assert raw == [t for ids in encoded for t in ids]
  assert noise / len(raw) == pytest.approx(0.15, abs=0.005) and noise / spans == pytest.approx(3, abs=0.1)
  first = vocab.decode(raw[: len(encoded[0])])
  assert " ".join(first.split())[:200] == " ".join(docs[0].split())[:200]
  text = vocab.decode(examples[0]["inputs"].tolist())
  assert (
    "<extra_id_0>" in text
    and "<extra_id_1>" in text
    and vocab.decode(examples[0]["targets"].tolist()).startswith("<extra_id_0>")
  )


# --- (6) registration ---------------------------------------------------------------------------------------
def test_registration_is_idempotent_and_lazy(monkeypatch):
  import seqio

  from remixer_t5.data.vocab import t5_vocabulary

  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)
  from remixer_t5.tasks import c4

  before = sorted(seqio.TaskRegistry.names())
  importlib.import_module("remixer_t5.tasks.c4")
  importlib.reload(c4)  # runs registration again: a no-op, and no I/O without data
  assert c4.register_c4_task() == "c4_span_corruption"
  assert sorted(seqio.TaskRegistry.names()) == before
  task = seqio.get_mixture_or_task("c4_span_corruption")
  assert task.output_features["targets"].vocabulary == t5_vocabulary()
  assert task.output_features["inputs"].add_eos and task.output_features["targets"].add_eos
  assert list(task.splits) == ["train", "validation"]
  assert task.source.tfds_name == "c4/en:3.1.0"
  assert c4.DEFAULT_SEQUENCE_LENGTH == {"inputs": 512, "targets": 114}

  class Other:
    def __eq__(self, other):
      return False

  with pytest.raises(ValueError, match="already registered"):
    c4.register_c4_task("c4_span_corruption", vocabulary=Other())
