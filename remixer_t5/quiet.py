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

`REMIXER_T5_VERBOSE=1` turns all of this off: everything is printed, and TensorFlow sees GPUs.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
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


def configure() -> bool:
  """Installs the hooks (module docstring) for the modules of QUIET_MODULES not yet imported, unless
  $REMIXER_T5_VERBOSE is set; returns whether TensorFlow's is in place."""
  global installed
  if verbose() or "tensorflow" in sys.modules:
    return False
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if not installed:
    for name in QUIET_MODULES:
      if name not in sys.modules and importlib.util.find_spec(name) is not None:
        sys.meta_path.insert(0, _QuietImportFinder(name))
    installed = True
  return True
