"""Constant-time input resume (remixer_t5/data/input_pipeline.py): a tf.data iterator checkpoint restores the
exact position for every kind of source (embedded TFRecords, local C4 shards, local COGS rows, a real TFDS
dataset, a mixture), per process shard, at a cost that does not grow with the position; a pipeline that
cannot be checkpointed says so (the trainer then falls back to skip)."""

import gzip
import json
import statistics
import time

import numpy as np
import pytest

from remixer_t5.data import input_pipeline

LENGTHS = {"inputs": 32, "targets": 8}
WORDS = "the cat sat on a mat while rain fell over the quiet town and people walked home".split()


def _doc(prefix, i, words=30):
  return {
    "text": f"Story {prefix} {i}. " + " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(words)),
    "timestamp": "2019-04-20T12:00:00Z",
    "url": f"https://example.com/{prefix}/{i}",
  }


@pytest.fixture
def data_dir(tmp_path, monkeypatch, embedded_env):
  """Local release files: three C4 train shards (gzipped and not) and COGS."""
  c4 = tmp_path / "c4" / "en"
  c4.mkdir(parents=True)
  for n, suffix in enumerate((".json.gz", ".jsonl", ".json.gz")):
    lines = "".join(json.dumps(_doc(n, i)) + "\n" for i in range(12)).encode()
    (c4 / f"c4-train.{n:05d}-of-00003{suffix}").write_bytes(gzip.compress(lines) if suffix.endswith("gz") else lines)
  cogs = tmp_path / "cogs"
  cogs.mkdir()
  rows = [
    (f"Emma saw {n} cats .", f"see . agent ( x _ 1 , Emma ) AND see . theme ( x _ 1 , {n} )", "in_distribution")
    for n in ("two", "three", "four", "five", "six", "seven", "eight", "nine")
  ]
  for name in ("train.tsv", "dev.tsv", "test.tsv", "gen.tsv"):
    (cogs / name).write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  return tmp_path


def _vocab():
  from remixer_t5.data.vocab import get_vocabulary

  return get_vocabulary()


def _c4_task():
  import seqio

  from remixer_t5.tasks import c4

  return seqio.get_mixture_or_task(c4.register_c4_task("c4_span_corruption_embedded_vocab", _vocab()))


def _cogs_task():
  import seqio

  from remixer_t5.tasks import cogs

  cogs.register_cogs_task("cogs_embedded_vocab", vocabulary=_vocab())
  return seqio.get_mixture_or_task("cogs_embedded_vocab")


def _batches(task, position=0, **kwargs):
  kwargs = {"seed": 3, "shuffle": True, "repeat": True, "pack": True, **kwargs}
  return input_pipeline.get_batches(task, LENGTHS, "train", 4, skip_batches=position, **kwargs)


def _assert_exact_resume(task, tmp_path, k=5, m=4, **kwargs):
  """Consume k batches, save, read m more; a fresh pipeline restored from the save gives the same m."""
  a = _batches(task, **kwargs)
  start = [next(a) for _ in range(m)]
  for _ in range(k - m):
    next(a)
  prefix = a.save(str(tmp_path / f"state-{task.name}-{kwargs.get('process_index', 0)}" / "iterator"))
  want = [next(a) for _ in range(m)]
  b = _batches(task, **kwargs)
  b.restore(prefix, k)
  got = [next(b) for _ in range(m)]
  assert b.position == k + m
  for w, g in zip(want, got):
    assert set(w) == set(g)
    for key in w:
      np.testing.assert_array_equal(w[key], g[key])
  # The restored stream is the one at position k (as a replay gives it), not the start again.
  replay = _batches(task, position=k, **kwargs)
  np.testing.assert_array_equal(next(replay)["encoder_input_tokens"], want[0]["encoder_input_tokens"])
  assert not all(np.array_equal(s["encoder_input_tokens"], w["encoder_input_tokens"]) for s, w in zip(start, want))
  return prefix


def test_embedded_corpus_resumes_exactly(embedded_env, tmp_path):
  from remixer_t5.tasks.lookup import get_task

  _assert_exact_resume(get_task("embedded_span_corruption"), tmp_path)


def test_local_c4_shards_resume_exactly_and_are_read_by_tf_data(data_dir, tmp_path):
  task = _c4_task()
  _assert_exact_resume(task, tmp_path, k=7)
  _assert_exact_resume(task, tmp_path, shuffle=False, pack=False)


def test_local_cogs_rows_resume_exactly(data_dir, tmp_path):
  _assert_exact_resume(_cogs_task(), tmp_path, k=6, pack=False)


def test_mixture_resumes_exactly(data_dir, tmp_path):
  import seqio

  name = "input_resume_mix"
  if name not in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.add(name, [(_c4_task().name, 1.0), (_cogs_task().name, 1.0)])
  _assert_exact_resume(seqio.get_mixture_or_task(name), tmp_path, k=6)


@pytest.mark.integration
def test_each_process_restores_its_own_shard(data_dir, tmp_path):
  for task, k in ((_c4_task(), 4), (_cogs_task(), 3)):  # C4: files per process; COGS: rows per process
    for index in range(2):
      _assert_exact_resume(task, tmp_path, k=k, m=2, process_index=index, process_count=2)


def _tiny_tfds(tmp_path):
  """A real (prepared on disk, TFRecord) TFDS dataset with a `text` feature, as C4's TFDS copy has."""
  import tensorflow_datasets as tfds

  class TinyTextCorpus(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i in range(40):
        yield i, {"text": _doc("tfds", i)["text"]}

  TinyTextCorpus(data_dir=str(tmp_path / "tfds")).download_and_prepare()
  return str(tmp_path / "tfds")


def test_tfds_source_resumes_exactly(embedded_env, tmp_path):
  import seqio

  from remixer_t5.tasks.common import add_span_corruption_task

  tfds_dir = _tiny_tfds(tmp_path)
  name = "input_resume_tiny_tfds"
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  add_span_corruption_task(name, seqio.TfdsDataSource("tiny_text_corpus:1.0.0", tfds_data_dir=tfds_dir), _vocab())
  _assert_exact_resume(seqio.get_mixture_or_task(name), tmp_path, k=6)


def test_generator_source_is_not_checkpointable_and_says_so(embedded_env, tmp_path):
  """A source built on a Python generator (tfds.testing.mock_data's USE_CODE data is one too) has no iterator
  state to save: the error names the cause; the trainer then saves the position as a count and replays it."""
  import seqio
  import tensorflow as tf

  from remixer_t5.tasks.common import add_span_corruption_task

  name = "input_resume_generator"
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  docs = [_doc("g", i)["text"] for i in range(20)]
  source = seqio.FunctionDataSource(
    lambda split, shuffle_files, seed=None: tf.data.Dataset.from_generator(
      lambda: ({"text": d} for d in docs), output_signature={"text": tf.TensorSpec([], tf.string)}
    ),
    splits=["train"],
  )
  add_span_corruption_task(name, source, _vocab())
  batches = _batches(seqio.get_mixture_or_task(name), pack=False)
  next(batches)
  with pytest.raises(input_pipeline.InputNotCheckpointableError, match="cannot be checkpointed .*stateful"):
    batches.save(str(tmp_path / "it" / "iterator"))


@pytest.mark.integration
def test_restore_time_does_not_grow_with_the_position(embedded_env, tmp_path):
  """Time from a built pipeline to the batch at the position: restoring at position 2000 costs about what it
  costs at 2 (median of 3; a generous ratio), while replaying with skip grows with the position."""
  from remixer_t5.tasks.lookup import get_task

  task = get_task("embedded_span_corruption")
  prefixes = {}
  run = _batches(task)
  for position in (2, 2000):
    while run.position < position:
      next(run)
    prefixes[position] = run.save(str(tmp_path / str(position) / "iterator"))

  def restore_seconds(position):  # building the pipeline is not timed: the same work at any position
    times = []
    for _ in range(3):
      b = _batches(task)
      t0 = time.perf_counter()
      b.restore(prefixes[position], position)
      next(b)
      times.append(time.perf_counter() - t0)
    return statistics.median(times)

  small, large = restore_seconds(2), restore_seconds(2000)
  replay = _batches(task, position=2000)
  t0 = time.perf_counter()
  next(replay)
  skip = time.perf_counter() - t0
  print(f"restore at 2: {small:.3f}s, at 2000: {large:.3f}s; skip to 2000: {skip:.3f}s")
  assert large < 3 * small, (small, large)
  assert skip > 3 * large, (skip, large)  # the test has teeth: a replay would fail the first assertion
