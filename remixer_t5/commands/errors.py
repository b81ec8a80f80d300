"""What the CLI reports for an exception that ends a command: its exit code and one line (docs/cli.md, "Exit
codes"). An exception class of the project may carry its own code (`exit_code`); anything else that is not a cause
the user can act on (a bug) keeps its traceback."""

from __future__ import annotations

import os
import re

from remixer_t5 import quiet
from remixer_t5.storage import StorageError

EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_STORAGE, EXIT_OUT_OF_MEMORY, EXIT_INTERRUPTED = 2, 3, 4, 5, 130
TRACEBACK_ENV = "REMIXER_T5_TRACEBACK"
# Status codes (absl's, as XLA, TensorFlow and tensorstore spell them) of a store that did not answer or refused.
_STORAGE_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED", "ABORTED")
# TensorFlow's errors that are about what was read (a missing file, a malformed row), not about reading it.
_TF_INPUT_ERRORS = ("NotFoundError", "InvalidArgumentError", "DataLossError", "OutOfRangeError", "UnimplementedError")
# Clients of remote storage whose exceptions are not OSErrors.
_STORAGE_CLIENTS = ("gcsfs", "fsspec", "aiohttp", "google.auth", "google.api_core", "google.cloud", "requests")


def traceback_wanted() -> bool:
  return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _message(e: BaseException) -> str:
  """The exception's own text (TensorFlow's errors keep theirs in `.message`, without the op's context)."""
  message = getattr(e, "message", None)
  return message if isinstance(message, str) and message else str(e)


def exit_code(e: BaseException) -> int | None:
  """The exit code of an error the CLI reports in one line (docs/cli.md, "Exit codes"); None for anything else
  (a bug), which keeps its traceback."""
  code = getattr(e, "exit_code", None)
  if isinstance(code, int) and not isinstance(code, bool):
    return code
  if isinstance(e, KeyboardInterrupt):
    return EXIT_INTERRUPTED
  if isinstance(e, FloatingPointError):
    return EXIT_NON_FINITE
  name, module = type(e).__name__, type(e).__module__ or ""
  status = _message(e).lstrip().split(":", 1)[0]
  if isinstance(e, MemoryError) or status == "RESOURCE_EXHAUSTED" or name == "ResourceExhaustedError":
    return EXIT_OUT_OF_MEMORY
  if isinstance(e, StorageError) or status in _STORAGE_STATUS or module.startswith(_STORAGE_CLIENTS):
    return EXIT_STORAGE
  if module.startswith("tensorflow"):
    return EXIT_BAD_INPUT if name in _TF_INPUT_ERRORS else EXIT_STORAGE
  if isinstance(e, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)):
    return EXIT_BAD_INPUT  # a path given that is not what it should be
  if isinstance(e, OSError):  # a full disk, a refused write, an I/O error
    return EXIT_STORAGE
  if isinstance(e, (ValueError, ImportError)):  # GinError and IncompatibleModelDirError are ValueErrors
    return EXIT_BAD_INPUT
  if isinstance(e, TypeError) and _configurable(e):  # a value of the wrong type where gin builds an object
    return EXIT_BAD_INPUT
  return None


def _configurable(e: BaseException) -> str | None:
  """The configurable gin was calling when `e` was raised (gin appends "In call to configurable 'X'")."""
  found = re.search(r"In call to configurable '([\w.]+)'", str(e))
  return found.group(1) if found else None


def error_line(e: BaseException) -> str:
  """What `remixer-t5: error:` is followed by: the message as its raiser wrote it, on one line (quiet.one_line);
  a foreign storage client's error and a message-less one are named by their type."""
  if isinstance(e, KeyboardInterrupt):
    return "interrupted"
  text = quiet.one_line(_message(e))
  if not text:
    return type(e).__name__
  if isinstance(e, TypeError) and _configurable(e):  # the message alone does not say where
    return f"{text} (in {_configurable(e)}: a binding of the wrong type?)"
  return f"{type(e).__name__}: {text}" if (type(e).__module__ or "").startswith(_STORAGE_CLIENTS) else text
