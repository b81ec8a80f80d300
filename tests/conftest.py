"""Shared fixtures: the embedded corpus and vocabulary, prepared once per session."""

import atexit
import os
import shutil
import sys
import tempfile
import time
import types

import pytest

# With libtpu installed (the `test` extra: tests/test_compile.py compiles for TPU topologies) JAX would try to
# start a TPU runtime in every test process; the tests run on the CPU, and the workers of pytest-xdist may each
# load libtpu (it allows one process at a time unless told otherwise).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The CLI's host allocator policy keeps a process's heap at its peak (runtime.py; it changes no program, only
# where XLA's scratch lives); a pytest worker runs
# hundreds of CLI calls in-process and would keep the largest one's memory (5-6 GiB per worker seen). Tests of
# the policy set $REMIXER_T5_HOST_MALLOC themselves.
os.environ.setdefault("REMIXER_T5_HOST_MALLOC", "off")
# The suite's programs are compiled with LLVM at -O0 and XLA:CPU's older elemental emitter in place of its MLIR
# fusion emitters (XLA's HLO passes are unchanged, so are the programs' results up to floating-point
# contraction): most test time is compiling hundreds of distinct small programs, which run a few steps each, and
# both make the backend's compiles faster.
# This is the suite's setting alone: benchmarks and runs started as commands compile with XLA's defaults.
# Child processes inherit $XLA_FLAGS; helpers that give a child flags of its own add these
# ($REMIXER_T5_TEST_XLA_FLAGS; tests/subprocess_util.py). Set it to '' to compile as a run does everywhere.
from subprocess_util import TEST_XLA_FLAGS_ENV  # noqa: E402 (tests/ is on sys.path, as for the test modules)

os.environ.setdefault(TEST_XLA_FLAGS_ENV, "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
if os.environ[TEST_XLA_FLAGS_ENV] and os.environ[TEST_XLA_FLAGS_ENV] not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {os.environ[TEST_XLA_FLAGS_ENV]}".strip()
# One persistent XLA compilation cache for the whole run, shared by the xdist workers and the CLI subprocesses
# the tests start (they inherit the environment): dozens of tests train the same tiny configurations, and each
# distinct program then compiles once. Fresh per run (removed at exit), so no run reads another's programs; set
# $JAX_COMPILATION_CACHE_DIR yourself to keep one, or to '' to compile everything every time.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE = tempfile.mkdtemp(prefix="remixer_t5_tests_xla_cache_")
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)


# One cache root for the run ($REMIXER_T5_CACHE_DIR: corpora, vocabularies and the C++ kernels' builds, each a
# compiler run of several seconds), shared like the XLA cache above and removed at exit, so the suite writes
# nothing under ~/.cache. A test that needs an empty cache takes `fresh_cache`, which shares only the kernels'
# builds.
if "REMIXER_T5_CACHE_DIR" not in os.environ:
  os.environ["REMIXER_T5_CACHE_DIR"] = _RUN_CACHE = tempfile.mkdtemp(prefix="remixer_t5_tests_cache_")
  atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)
KERNEL_BUILDS = ("cpu_hypermixing", "cpu_threefry")  # kernels/cpu's cache folders (ffi.build's `folder`)


def share_kernel_builds(root) -> None:
  """`root`'s kernel build folders as links to the run's (a kernel absent from KERNEL_BUILDS just builds)."""
  from pathlib import Path

  shared = Path(os.environ["REMIXER_T5_CACHE_DIR"])
  Path(root).mkdir(parents=True, exist_ok=True)
  for folder in KERNEL_BUILDS:
    (shared / folder).mkdir(parents=True, exist_ok=True)
    link = Path(root) / folder
    if link.resolve() != (shared / folder).resolve():
      link.symlink_to(shared / folder, target_is_directory=True)


@pytest.fixture
def fresh_cache(tmp_path):
  """An empty $REMIXER_T5_CACHE_DIR root for one test (not set in the environment: the test sets it where it
  needs it) whose C++ kernels come from the run's builds."""
  root = tmp_path / "cache"
  share_kernel_builds(root)
  return root


for _name in [k for k in os.environ if k.startswith("WANDB_")]:  # a developer's W&B settings never reach the tests
  del os.environ[_name]


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "integration: an end-to-end run through processes, scripts or a sweep over every architecture, whose parts "
    "`make test` checks in-process or on one representative; `make test` leaves these out (to stay near the "
    "~15-minute guideline on 2 cores), `make test-integration` runs only these, `make test-all` runs everything",
  )


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
  """Corpus + 2000-piece SentencePiece model prepared once per run in a temporary cache root (one for all
  pytest-xdist workers).

  Returns a namespace with ``root`` (a $REMIXER_T5_CACHE_DIR value), ``splits``
  ({split: jsonl path}), ``spm`` (model path) and ``seconds`` (time taken).
  The environment is left untouched; use ``embedded_env`` to point it here.
  """
  import fcntl

  from remixer_t5.data import embedded_corpus, vocab

  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER") and base.name.startswith("popen-"):
    # pytest-xdist's local workers have basetemps <this run's folder>/popen-gw<N>: the first to take the lock
    # prepares the corpus and vocabulary there, the others wait and find them prepared
    # (prepare() is then a no-op). Anything else gets a folder of its own.
    root = base.parent / "remixer_t5_cache"
    root.mkdir(exist_ok=True)
  else:
    root = tmp_path_factory.mktemp("remixer_t5_cache")
  with pytest.MonkeyPatch.context() as mp, open(root.parent / f"{root.name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    share_kernel_builds(root)
    mp.setenv(embedded_corpus.CACHE_ENV_VAR, str(root))
    start = time.perf_counter()
    splits = embedded_corpus.prepare()
    corpus_seconds = time.perf_counter() - start
    spm = vocab.prepare_vocabulary()
    seconds = time.perf_counter() - start
  print(f"\n[embedded_cache] corpus {corpus_seconds:.1f}s, corpus+vocab {seconds:.1f}s")
  return types.SimpleNamespace(root=root, splits=splits, spm=spm, seconds=seconds, corpus_seconds=corpus_seconds)


@pytest.fixture
def embedded_env(embedded_cache, monkeypatch):
  """``embedded_cache`` with $REMIXER_T5_CACHE_DIR pointing at it for one test."""
  from remixer_t5.data import embedded_corpus

  monkeypatch.setenv(embedded_corpus.CACHE_ENV_VAR, str(embedded_cache.root))
  return embedded_cache


@pytest.fixture(autouse=True)
def _fresh_data_dir():
  """`sources.set_data_dir` is process-wide (a run's DATA_DIR binding); no test may leak it into the next.
  (A process that never imported it has nothing to reset: importing it would load TensorFlow and seqio.)"""
  yield
  sources = sys.modules.get("remixer_t5.tasks.sources")
  if sources is not None:
    sources.set_data_dir(None)
