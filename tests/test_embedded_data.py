"""The embedded corpus, its SentencePiece vocabulary and the seqio task."""

import bz2
import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import seqio
import sentencepiece as spm

from remixer_t5.data import embedded_corpus, vocab
from remixer_t5.data.span_corruption import random_spans_helper

T5_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"


def _read(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------
# Corpus.


def test_prepared_splits_are_disjoint_and_cover_both_sources(embedded_cache):
  docs = {split: _read(path) for split, path in embedded_cache.splits.items()}
  assert set(docs) == {"train", "validation"}
  for split, split_docs in docs.items():
    assert {d["source"] for d in split_docs} == {"wiki", "lee"}, split
    assert all(set(d) == {"text", "title", "source"} for d in split_docs)
  keys = {split: {(d["source"], d["title"]) for d in split_docs} for split, split_docs in docs.items()}
  assert keys["train"].isdisjoint(keys["validation"])
  assert len(keys["train"]) == len(docs["train"])  # no duplicates
  assert {d["text"] for d in docs["train"]}.isdisjoint(d["text"] for d in docs["validation"])
  n_train, n_val = len(docs["train"]), len(docs["validation"])
  assert n_train > 300 and 6 <= n_val <= 0.1 * (n_train + n_val)

  manifest = json.loads(embedded_corpus.manifest_path(embedded_cache.root / "embedded_corpus").read_text())
  assert manifest["num_documents"] == {"train": n_train, "validation": n_val}
  assert manifest["corpus_version"] == embedded_corpus.CORPUS_VERSION


def test_wiki_text_is_natural(embedded_cache):
  wiki = [d for d in _read(embedded_cache.splits["train"]) if d["source"] == "wiki"]
  assert len(wiki) > 50
  titles = {d["title"] for d in wiki}
  assert "Abraham Lincoln" in titles or "Albert Einstein" in titles
  for d in wiki:
    assert len(d["text"]) >= embedded_corpus.MIN_DOC_CHARS
    for markup in ("[[", "]]", "{{", "}}", "'''", "<ref", "==", "{|", "http://", "#REDIRECT"):
      assert markup not in d["text"], (d["title"], markup)
  text = "\n".join(d["text"] for d in wiki)
  assert re.search(r"[A-Z][a-z]+ [a-z]+, [a-z]+", text)  # case and commas kept
  assert text.count(". ") > 1000 and "(" in text


def test_second_prepare_is_a_noop(embedded_cache):
  directory = embedded_cache.root / "embedded_corpus"
  before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
  assert embedded_corpus.prepare(directory) == embedded_cache.splits
  assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before
  assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


_TINY_DUMP = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
{pages}
</mediawiki>"""
_PAGE = "<page><title>{title}</title><ns>{ns}</ns><id>{id}</id><revision><text>{text}</text></revision></page>"
_ARTICLE = (
  "'''Foo''' is a [[bar (thing)|bar]] of the {{{{cite web|url=http://x.org}}}} ''Baz'' kind.&lt;ref&gt;A ref."
  "&lt;/ref&gt; It was described in 1901, in Paris (France). "
  * 8
  + "\n==History==\nFoo was first seen by [[John Smith]]. It is still seen today.\n"
  "\n==References==\n* Some book, 1999.\n"
)


def _tiny_dump(path):
  pages = [
    _PAGE.format(title="Foo", ns=0, id=1, text=_ARTICLE),
    _PAGE.format(title="Foo redirect", ns=0, id=2, text="#REDIRECT [[Foo]]"),
    _PAGE.format(title="Template:Foo", ns=10, id=3, text=_ARTICLE),
    _PAGE.format(title="Stub", ns=0, id=4, text="Too short."),
  ]
  path.write_bytes(bz2.compress(_TINY_DUMP.format(pages="\n".join(pages)).encode()))
  return path


def test_wiki_extraction_keeps_articles_only(tmp_path):
  docs = list(embedded_corpus.iter_wiki_documents(_tiny_dump(tmp_path / "tiny.xml.bz2")))
  assert [d["title"] for d in docs] == ["Foo"]
  text = docs[0]["text"]
  assert text.startswith("Foo is a bar of the Baz kind. It was described in 1901, in Paris (France).")
  assert "History\nFoo was first seen by John Smith." in text
  assert "References" not in text and "Some book" not in text and "A ref" not in text


def test_interrupted_prepare_leaves_no_cache_and_recovers(tmp_path, monkeypatch):
  wiki = _tiny_dump(tmp_path / "tiny.xml.bz2")
  lee = tmp_path / "lee.cor"
  lee.write_text(
    "".join(f"News item number {i}, with enough words to count as a document. " * 2 + "\n" for i in range(40))
  )
  cache = tmp_path / "cache"

  def killed(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(embedded_corpus, "_write_tfrecord", killed)
  with pytest.raises(KeyboardInterrupt):
    embedded_corpus.prepare(cache, wiki_path=wiki, lee_path=lee)
  assert not embedded_corpus.is_prepared(cache)
  assert not (cache / "manifest.json").exists()
  assert not [p.name for p in cache.iterdir() if p.name.endswith(".tmp")]

  monkeypatch.undo()
  paths = embedded_corpus.prepare(cache, wiki_path=wiki, lee_path=lee)
  assert embedded_corpus.is_prepared(cache)
  assert sum(len(_read(p)) for p in paths.values()) == 41


def test_missing_source_file_names_the_path(tmp_path):
  missing = tmp_path / "no-such-dump.xml.bz2"
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
    embedded_corpus.prepare(tmp_path / "cache", wiki_path=missing)
  assert not (tmp_path / "cache").exists()


def test_cache_root_follows_env(monkeypatch, tmp_path):
  monkeypatch.setenv(embedded_corpus.CACHE_ENV_VAR, str(tmp_path))
  assert embedded_corpus.corpus_dir() == tmp_path / "embedded_corpus"
  assert vocab.vocab_model_path(2000) == tmp_path / "embedded_corpus" / "spm_unigram_2000.model"
  monkeypatch.delenv(embedded_corpus.CACHE_ENV_VAR)
  assert embedded_corpus.cache_root() == Path.home() / ".cache" / "remixer_t5"


# ---------------------------------------------------------------------------
# Vocabulary.


def test_sentencepiece_model_has_t5_special_ids(embedded_cache):
  assert embedded_cache.spm.name == "spm_unigram_2000.model"
  sp = spm.SentencePieceProcessor(model_file=str(embedded_cache.spm))
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  assert 1500 <= sp.get_piece_size() <= 2000


def test_embedded_vocabulary_is_lazy_and_round_trips(embedded_env):
  v = vocab.get_vocabulary()
  assert isinstance(v, seqio.SentencePieceVocabulary)
  assert v._model is None  # nothing loaded yet
  pieces = spm.SentencePieceProcessor(model_file=str(embedded_env.spm)).get_piece_size()
  assert v.vocab_size == pieces + 100
  assert v.sentencepiece_model_file == str(embedded_env.spm)
  assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  text = "The President of the United States spoke in Sydney, Australia, on Tuesday."
  ids = v.encode(text)
  assert max(ids) < pieces and v.decode(ids) == text
  assert v.decode_tf(v.encode_tf(text)).numpy().decode() == text
  assert v == vocab.get_vocabulary() and v != vocab.get_vocabulary(extra_ids=10)
  assert vocab.get_vocabulary(str(embedded_env.spm)).vocab_size == pieces + 100


def test_sentencepiece_training_is_deterministic(embedded_cache):
  texts = [d["text"] for d in _read(embedded_cache.splits["train"])[:60]]
  assert vocab.train_sentencepiece(texts, 300) == vocab.train_sentencepiece(texts, 300)


def test_missing_vocabulary_path_says_where_it_looked(tmp_path):
  missing = tmp_path / "nope" / "sentencepiece.model"
  with pytest.raises(FileNotFoundError) as info:
    vocab.get_vocabulary(str(missing))
  assert str(missing) in str(info.value) and "T5_VOCAB_PATH" in str(info.value)
  remote = vocab.get_vocabulary("gs://bucket/sentencepiece.model")  # passed through, no I/O
  assert remote.sentencepiece_model_file == "gs://bucket/sentencepiece.model"


# ---------------------------------------------------------------------------
# seqio task.


def _examples(task_name, n, inputs_length=128):
  targets_length = random_spans_helper(inputs_length)[1]
  task = seqio.get_mixture_or_task(task_name)
  ds = task.get_dataset({"inputs": inputs_length, "targets": targets_length}, split="validation", shuffle=False, seed=0)
  return task, list(ds.take(n).as_numpy_iterator()), targets_length


def test_importing_tasks_registers_without_io(tmp_path, monkeypatch):
  import remixer_t5.tasks as tasks

  monkeypatch.setenv(embedded_corpus.CACHE_ENV_VAR, str(tmp_path / "untouched"))
  task = seqio.TaskRegistry.get(tasks.embedded.TASK_NAME)
  importlib.reload(tasks.embedded)  # a second import registers nothing new
  importlib.reload(tasks)
  assert seqio.TaskRegistry.get(tasks.embedded.TASK_NAME) is task
  # A fresh registration (as on a first import) reads no files either.
  seqio.TaskRegistry.remove(tasks.embedded.TASK_NAME)
  importlib.reload(tasks.embedded)
  assert seqio.TaskRegistry.get(tasks.embedded.TASK_NAME).splits == ("train", "validation")
  assert not (tmp_path / "untouched").exists()


def test_registered_task_yields_span_corrupted_examples(embedded_env):
  import remixer_t5.tasks  # noqa: F401

  task, examples, targets_length = _examples("embedded_span_corruption", 4)
  v = task.output_features["targets"].vocabulary
  assert len(examples) == 4
  for ex in examples:
    for key, length in (("inputs", 128), ("targets", targets_length)):
      assert ex[key].dtype == np.int32 and ex[key].ndim == 1
      assert len(ex[key]) == length and ex[key][-1] == v.eos_id
    assert ex["targets"][0] == v.vocab_size - 1
    in_sentinels = [int(t) for t in ex["inputs"] if t >= v.vocab_size - 100]
    assert in_sentinels and in_sentinels == list(range(v.vocab_size - 1, v.vocab_size - 1 - len(in_sentinels), -1))
    assert [int(t) for t in ex["targets"] if t >= v.vocab_size - 100] == in_sentinels
  assert "<extra_id_0>" in v.decode(examples[0]["targets"].tolist())


def test_register_task_with_another_vocabulary(embedded_env):
  from remixer_t5.tasks.embedded import register_span_corruption_task

  if not T5_VOCAB.exists():
    pytest.skip(f"T5 vocabulary not found at {T5_VOCAB}")
  name = register_span_corruption_task("embedded_span_corruption_t5vocab", str(T5_VOCAB))
  assert register_span_corruption_task(name, vocab.get_vocabulary(str(T5_VOCAB))) == name
  with pytest.raises(ValueError, match="already registered"):
    register_span_corruption_task(name, vocab.get_vocabulary())
  _, (ex,), _ = _examples(name, 1)
  assert ex["targets"][0] == 32099  # <extra_id_0> of the 32000 + 100 T5 vocabulary
  assert len(ex["inputs"]) == 128
