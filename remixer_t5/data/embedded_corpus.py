"""The embedded pretraining corpus: text that ships inside the gensim wheel.

Two sources, both in gensim's ``test/test_data`` folder, so nothing is downloaded:

* ``wiki``: ~100 English Wikipedia articles (``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``),
  turned into plain, natural text (case and punctuation kept) with gensim's own wiki tools (``extract_pages`` +
  ``filter_wiki``) and a little extra cleanup.
* ``lee``: ``lee_background.cor``, ~300 news articles, one document per line.

Documents are split into ``train`` / ``validation`` by a stable hash of ``source:title`` (about 5% validation, at
least ``MIN_VALIDATION_DOCS`` per source). :func:`prepare` writes the result once into a cache directory
(``cache_dir`` argument, else ``$REMIXER_T5_CACHE_DIR/embedded_corpus``, else ``~/.cache/remixer_t5/embedded_corpus``):

* ``<split>.jsonl``: one ``{"text", "title", "source"}`` object per line (human readable);
* ``<split>.tfrecord``: the same documents as ``tf.train.Example`` records (features ``text``, ``title``,
  ``source``), read by the seqio task;
* ``manifest.json``: counts and versions, written last. A cache directory is complete exactly when its manifest
  exists with the current ``CORPUS_VERSION``; every file is written to a temporary name and renamed.

This module imports gensim and TensorFlow only when it prepares the corpus.
"""

from __future__ import annotations

import bz2
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Iterable, Iterator

CACHE_ENV_VAR = "REMIXER_T5_CACHE_DIR"
CORPUS_SUBDIR = "embedded_corpus"
# Bump when the extraction or split changes: existing caches are then rebuilt.
CORPUS_VERSION = 2

SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.05
MIN_VALIDATION_DOCS = 3  # per source
MIN_DOC_CHARS = 500  # shorter wiki articles are "near-empty" and skipped
MIN_NEWS_CHARS = 100  # news items are shorter but all real prose

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_FILE = "lee_background.cor"

# Trailing wiki sections that hold references and link lists, not prose.
_TAIL_SECTIONS = frozenset(
  s.lower()
  for s in (
    "References",
    "Notes",
    "Footnotes",
    "Citations",
    "Sources",
    "Bibliography",
    "See also",
    "External links",
    "Further reading",
    "Notes and references",
    "References and notes",
    "Works cited",
    "Selected bibliography",
  )
)
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_LIST_PREFIX = re.compile(r"^[*#:;]+\s*")
_URL = re.compile(r"https?://\S+|www\.\S+")
_QUOTE_MARKUP = re.compile(r"'{2,}")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_PAREN_LEADING_PUNCT = re.compile(r"\(\s*[,;:]\s*")
_LEADING_PUNCT = re.compile(r"^[,;:.]\s*")
_WORD = re.compile(r"[^\W\d_]{2,}")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:)])")
_SPACES = re.compile(r"[ \t\u00a0]+")
_LEFTOVER_MARKUP = re.compile(r"[|{}\[\]<>]|^\s*!")


def cache_root() -> Path:
  """``$REMIXER_T5_CACHE_DIR`` if set, else ``~/.cache/remixer_t5``."""
  env = os.environ.get(CACHE_ENV_VAR)
  return Path(env).expanduser() if env else Path.home() / ".cache" / "remixer_t5"


def corpus_dir(cache_dir: str | os.PathLike | None = None) -> Path:
  """The corpus folder: ``cache_dir`` if given, else ``cache_root()/embedded_corpus``."""
  return Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / CORPUS_SUBDIR


def gensim_test_data_dir() -> Path:
  """gensim's ``test/test_data`` folder, located without importing gensim."""
  spec = importlib.util.find_spec("gensim")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      "The embedded corpus needs the `gensim` package (its test data holds the text); "
      "install it (`pip install gensim==4.4.0`)."
    )
  return Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"


def split_paths(cache_dir=None, fmt: str = "jsonl") -> dict[str, Path]:
  """Where the split files are (or will be) for ``fmt`` in {"jsonl", "tfrecord"}; no I/O."""
  if fmt not in ("jsonl", "tfrecord"):
    raise ValueError(f"fmt must be 'jsonl' or 'tfrecord', got {fmt!r}")
  d = corpus_dir(cache_dir)
  return {split: d / f"{split}.{fmt}" for split in SPLITS}


def manifest_path(cache_dir=None) -> Path:
  return corpus_dir(cache_dir) / "manifest.json"


def is_prepared(cache_dir=None) -> bool:
  """True when the cache holds a complete corpus of the current version."""
  try:
    manifest = json.loads(manifest_path(cache_dir).read_text())
  except (OSError, ValueError):
    return False
  return manifest.get("corpus_version") == CORPUS_VERSION and all(
    p.exists() for fmt in ("jsonl", "tfrecord") for p in split_paths(cache_dir, fmt).values()
  )


def prepare(cache_dir=None, *, wiki_path=None, lee_path=None) -> dict[str, Path]:
  """Prepares the corpus once; returns ``{split: path of <split>.jsonl}``.

  A second call finds the manifest and returns at once. ``wiki_path`` and ``lee_path`` override the gensim source
  files (FileNotFoundError, naming the path, when one is missing)."""
  out_dir = corpus_dir(cache_dir)
  if is_prepared(out_dir):
    return split_paths(out_dir)

  wiki_path = Path(wiki_path) if wiki_path is not None else gensim_test_data_dir() / WIKI_FILE
  lee_path = Path(lee_path) if lee_path is not None else gensim_test_data_dir() / LEE_FILE
  for p in (wiki_path, lee_path):
    if not p.is_file():
      raise FileNotFoundError(
        f"Embedded corpus source file not found: {p} (it ships in the gensim wheel's "
        "test data; reinstall gensim==4.4.0 or pass wiki_path/lee_path)."
      )

  start = time.perf_counter()
  out_dir.mkdir(parents=True, exist_ok=True)
  _remove_stale_temp_files(out_dir)
  # A stale (older version) cache: drop its manifest first, then the vocabularies trained on it, so that a killed
  # rebuild is never "complete".
  manifest_path(out_dir).unlink(missing_ok=True)
  for model in out_dir.glob("spm_unigram_*.model"):
    model.unlink(missing_ok=True)

  docs = _deduplicate([*iter_wiki_documents(wiki_path), *iter_lee_documents(lee_path)])
  splits = assign_splits(docs)

  jsonl, records = split_paths(out_dir, "jsonl"), split_paths(out_dir, "tfrecord")
  for split in SPLITS:
    _write_jsonl(jsonl[split], splits[split])
    _write_tfrecord(records[split], splits[split])

  manifest = {
    "corpus_version": CORPUS_VERSION,
    "counts": {
      split: {src: sum(d["source"] == src for d in splits[split]) for src in ("wiki", "lee")} for split in SPLITS
    },
    "num_documents": {split: len(splits[split]) for split in SPLITS},
    "num_chars": {split: sum(len(d["text"]) for d in splits[split]) for split in SPLITS},
    "validation_fraction": VALIDATION_FRACTION,
    "min_doc_chars": MIN_DOC_CHARS,
    "sources": {"wiki": wiki_path.name, "lee": lee_path.name},
    "versions": {"gensim": metadata.version("gensim"), "python": sys.version.split()[0]},
  }
  # The manifest goes last: its presence marks a complete cache.
  atomic_write_bytes(manifest_path(out_dir), json.dumps(manifest, indent=2, sort_keys=True).encode())
  print(
    f"remixer_t5: prepared the embedded corpus in {out_dir} ({len(splits['train'])} train / "
    f"{len(splits['validation'])} validation documents, {time.perf_counter() - start:.1f}s)",
    file=sys.stderr,
    flush=True,
  )
  return split_paths(out_dir)


def read_split(split: str, cache_dir=None) -> list[dict]:
  """All documents of ``split`` (prepares the corpus first if needed)."""
  path = prepare(cache_dir)[split]
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------
# Extraction.


def clean_wiki_text(raw: str) -> str:
  """Wiki markup -> natural text (case and punctuation kept).

  gensim's ``filter_wiki`` removes templates, links, refs, tables and tags; this then drops headings' markup, quote
  markup, list bullets, captions, URLs and everything from the first reference-like section on."""
  from gensim.corpora.wikicorpus import filter_wiki

  lines = []
  for line in filter_wiki(raw).split("\n"):
    heading = _HEADING.match(line)
    if heading:
      title = heading.group(2).strip()
      if title.lower() in _TAIL_SECTIONS:
        break
      line = title
    line = _LIST_PREFIX.sub("", line.strip())
    line = _URL.sub("", line)
    line = _QUOTE_MARKUP.sub("", line)
    line = _EMPTY_PARENS.sub("", line)
    line = _PAREN_LEADING_PUNCT.sub("(", line)
    line = _SPACES.sub(" ", line)
    line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
    line = _LEADING_PUNCT.sub("", line.strip())
    # Image captions, table cells and other markup that filter_wiki leaves behind.
    if not _WORD.search(line) or _LEFTOVER_MARKUP.search(line) or line.startswith(("File:", "Image:")):
      continue
    lines.append(line)
  return "\n".join(lines).strip()


def iter_wiki_documents(path) -> Iterator[dict]:
  """Articles of a MediaWiki XML dump (bz2) as ``{"text", "title", "source": "wiki"}``; skips redirects,
  non-article namespaces, disambiguation pages and near-empty articles."""
  from gensim.corpora.wikicorpus import IGNORED_NAMESPACES, extract_pages

  with bz2.open(path, "rb") as f:
    for title, raw, _ in extract_pages(f, filter_namespaces=("0",)):
      if raw.lstrip().lower().startswith("#redirect"):
        continue
      if title.split(":", 1)[0] in IGNORED_NAMESPACES or title.endswith("(disambiguation)"):
        continue
      text = clean_wiki_text(raw)
      if len(text) < MIN_DOC_CHARS:
        continue
      yield {"text": text, "title": title, "source": "wiki"}


def iter_lee_documents(path) -> Iterator[dict]:
  """``lee_background.cor``: one news document per line."""
  with open(path, encoding="utf-8", errors="replace") as f:
    for i, line in enumerate(f):
      text = _SPACES.sub(" ", line).strip()
      if len(text) >= MIN_NEWS_CHARS:
        yield {"text": text, "title": f"lee_background/{i:04d}", "source": "lee"}


def _deduplicate(docs: list[dict]) -> list[dict]:
  """Drops repeated texts (lee_background.cor repeats 7 items), keeping the first."""
  first: dict[str, dict] = {}
  for doc in docs:
    first.setdefault(doc["text"], doc)
  return list(first.values())


def _doc_hash(doc: dict, salt: str = "split") -> float:
  """A stable number in [0, 1) for a document (its source and title)."""
  digest = hashlib.sha256(f"{salt}:{doc['source']}:{doc['title']}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_splits(docs: Iterable[dict]) -> dict[str, list[dict]]:
  """Deterministic document-level split, stable under reordering of ``docs``.

  Per source, the ``VALIDATION_FRACTION`` of documents with the lowest hash (at least MIN_VALIDATION_DOCS) go to
  validation. Within a split, documents are ordered by a second hash, which mixes the sources (seqio concatenates
  consecutive documents)."""
  by_source: dict[str, list[dict]] = {}
  for doc in docs:
    by_source.setdefault(doc["source"], []).append(doc)
  out = {split: [] for split in SPLITS}
  for source in sorted(by_source):
    ranked = sorted(by_source[source], key=lambda d: (_doc_hash(d), d["title"]))
    n_val = max(round(VALIDATION_FRACTION * len(ranked)), min(MIN_VALIDATION_DOCS, len(ranked) // 2))
    out["validation"].extend(ranked[:n_val])
    out["train"].extend(ranked[n_val:])
  return {
    split: sorted(split_docs, key=lambda d: (_doc_hash(d, "order"), d["source"], d["title"]))
    for split, split_docs in out.items()
  }


# ----------------------------------------------------------------------------
# Atomic writes.


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[str]:
  """Yields a temporary file name beside ``path``; renames it to ``path`` on success. A killed writer leaves at
  most a hidden ``.<name>.*.tmp`` file, never a half-written ``path``."""
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  os.close(fd)
  try:
    yield tmp
    os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
  with atomic_path(path) as tmp:
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())


def _remove_stale_temp_files(directory: Path) -> None:
  for p in directory.glob(".*.tmp"):
    try:
      if time.time() - p.stat().st_mtime > 3600:  # not another live writer's
        p.unlink()
    except OSError:
      pass


def _write_jsonl(path: Path, docs: list[dict]) -> None:
  lines = (json.dumps({k: d[k] for k in ("text", "title", "source")}, ensure_ascii=False) + "\n" for d in docs)
  atomic_write_bytes(path, "".join(lines).encode("utf-8"))


def _write_tfrecord(path: Path, docs: list[dict]) -> None:
  """``tf.train.Example`` records with bytes features text/title/source."""
  import tensorflow as tf

  with atomic_path(path) as tmp:
    with tf.io.TFRecordWriter(tmp) as writer:
      for d in docs:
        feature = {
          key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[d[key].encode("utf-8")]))
          for key in ("text", "title", "source")
        }
        writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
