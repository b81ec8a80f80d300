"""What a user sees at start-up: the project's own lines, not TensorFlow's native start-up log.

TensorFlow is only the input pipeline here (seqio, tf.data). Importing it prints, from C++ and before any logging is set
up, a oneDNN notice, "Could not find cuda drivers", a CPU-feature notice and absl's "All log messages before
absl::InitializeLog()" banner; its first device enumeration on a machine without a GPU adds "failed call to cuInit: ...
CUDA error". No setting turns all of it off, so `configure()` installs an import hook: when anything first imports
`tensorflow`, the process's stderr (file descriptor 2) goes to a temporary file for the import and is put back after it;
what was written there is shown only if the import fails. Right after the import the hook hides GPUs from TensorFlow (as
t5x does), so on a GPU host the input pipeline never claims GPU memory that JAX needs; that enumeration runs hidden too.
`import jax` is hidden the same way (with the CUDA compiler plugin installed it prints the same notices on a machine
without a GPU), and `hidden_unless_verbose` also covers the plugin's start when `remixer-t5 compile` builds a GPU
topology. `configure()` also defaults $TF_CPP_MIN_LOG_LEVEL to 2 (TensorFlow's and XLA's INFO and WARNING lines, e.g.
tf.data cache notices; errors still show).

Python-side noise goes the same way (`quiet_logs`): orbax's absl log records ("Metadata file does not exist" at
every params restore, the JSON and read errors of a checkpoint that `restore_latest_good` then reports itself in one
line), asyncio's records, and the "Event loop is closed" RuntimeErrors that tensorstore's threads report as
unraisable after orbax gave up a read (hundreds of tracebacks for one corrupt checkpoint). An orbax failure still
reaches the run as the exception orbax raises; other libraries' absl warnings (seqio's) and the project's own
loggers are untouched. `one_line` is how the CLI shows an exception's message.

`REMIXER_T5_VERBOSE=1` turns all of this off: everything is printed, and TensorFlow sees GPUs.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import tempfile
from typing import Iterator

ENV = "REMIXER_T5_VERBOSE"
installed = False


def verbose() -> bool:
  return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def _stderr_hidden() -> Iterator[None]:
  """File descriptor 2 (C/C++ writes included) goes to a temporary file inside the block; what was written
  there is shown if the block raises (a broken install explains itself there)."""
  sys.stderr.flush()
  saved = os.dup(2)
  failed = False
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    except BaseException:
      failed = True
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      if failed:
        tmp.seek(0)
        sys.stderr.write(tmp.read().decode("utf-8", "replace"))


def hidden_unless_verbose() -> contextlib.AbstractContextManager:
  """`_stderr_hidden` unless $REMIXER_T5_VERBOSE is set."""
  return contextlib.nullcontext() if verbose() else _stderr_hidden()


class _QuietLoader(importlib.abc.Loader):
  """Runs the real loader with stderr hidden, then hides GPUs from TensorFlow, which runs the input pipeline on
  the CPU: JAX owns the accelerators (t5x does the same)."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module) -> None:
    with _stderr_hidden():
      self._loader.exec_module(module)
      if module.__name__ == "tensorflow":
        try:
          module.config.set_visible_devices([], "GPU")
        except (RuntimeError, ValueError):  # devices already initialised by someone else: leave them
          pass


QUIET_MODULES = ("tensorflow", "jax")


class _QuietImportFinder(importlib.abc.MetaPathFinder):
  """Finds `name` with the other finders and wraps its loader (once)."""

  def __init__(self, name: str):
    self.name = name

  def find_spec(self, name, path, target=None):
    if name != self.name:
      return None
    sys.meta_path.remove(self)  # one import only; also keeps the lookup below from finding this finder
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


# Libraries whose records on the "absl" logger are dropped, by the folders of their code. absl's records name
# absl's own file as where they were logged, so the filter looks at the code that is logging (its call stack).
QUIET_SOURCES = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorstore{os.sep}")


def _from_quiet_source(depth: int = 64) -> bool:
  frame = sys._getframe(2)  # noqa: SLF001 - past this function and the filter
  while frame is not None and depth > 0:
    if any(s in frame.f_code.co_filename for s in QUIET_SOURCES):
      return True
    frame, depth = frame.f_back, depth - 1
  return False


def _foreign(record: logging.LogRecord) -> bool:
  return record.name == "asyncio" or record.name.startswith("orbax") or (record.name == "absl" and _from_quiet_source())


class _DropForeign(logging.Filter):
  """Drops orbax's and asyncio's records (module docstring); everything else passes."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not _foreign(record)


_DROP = _DropForeign()


def _closed_loop(unraisable) -> bool:
  """Whether an unraisable exception is asyncio's 'Event loop is closed' (a callback from another thread, e.g.
  tensorstore's, into the loop orbax already closed)."""
  return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def quiet_logs() -> None:
  """Installs the log filters and the unraisable-exception hook of the module docstring (once)."""
  for name in ("absl", "asyncio", "orbax"):
    logger = logging.getLogger(name)
    if _DROP not in logger.filters:
      logger.addFilter(_DROP)
  previous = sys.unraisablehook
  if getattr(previous, "_remixer_quiet", False):
    return

  def hook(unraisable):
    if not _closed_loop(unraisable):
      previous(unraisable)

  hook._remixer_quiet = True
  sys.unraisablehook = hook


# C++ reprs that pybind11-wrapped libraries (tensorstore, orbax, XLA) put in their messages: what they say
# beside them is the readable part.
_REPRS = [
  (re.compile(r"\s*\[(?:tensorstore_spec|source locations)(?:\[\d+\])?='.*?'\]", re.S), ""),
  (re.compile(r"<(?:built-in method|bound method|function|method) ([\w.]+)[^<>]*>"), r"\1"),
  (re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>"), r"\1"),
]
# What gin appends to an exception raised inside a configurable or a parse: where, not what.
_GIN_CONTEXT = re.compile(r"^\s+In (?:call to configurable|file|bindings string)\b")


def one_line(message: str, limit: int = 600) -> str:
  """An exception's message as one line: C++ reprs trimmed (`_REPRS`), gin's context lines dropped, its other
  lines joined ("; ", or " " after a colon), up to `limit` characters; a longer message keeps its first line
  and counts the lines left out."""
  for pattern, repl in _REPRS:
    message = pattern.sub(repl, message)
  lines, skip = [], False
  for line in message.splitlines():
    if skip:  # the source line gin quotes under its "In file"/"In bindings string" line
      skip = False
      continue
    if _GIN_CONTEXT.match(line):
      skip = not line.lstrip().startswith("In call to configurable")
      continue
    if line.strip():
      lines.append(line.strip())
  if not lines:
    return ""
  text = lines[0]
  for i, line in enumerate(lines[1:], 1):
    joined = text + (" " if text.endswith(":") else "; ") + line
    if len(joined) > limit:
      return f"{text} (+{len(lines) - i} more lines)"
    text = joined
  return text


def configure() -> bool:
  """Installs the hooks (module docstring) for the modules of QUIET_MODULES not yet imported and the log
  filters, unless $REMIXER_T5_VERBOSE is set; returns whether TensorFlow's import hook is in place."""
  global installed
  if verbose():
    return False
  quiet_logs()
  if "tensorflow" in sys.modules:
    return False
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if not installed:
    for name in QUIET_MODULES:
      if name not in sys.modules and importlib.util.find_spec(name) is not None:
        sys.meta_path.insert(0, _QuietImportFinder(name))
    installed = True
  return True
