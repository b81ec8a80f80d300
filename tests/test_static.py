"""Static checks over the library's source: names a module uses but never defines fail only when that line
runs, which a rarely taken branch (a plot, an error path) may not do under the suite; an import or a local
nothing reads is usually a leftover of an edit (an import kept for its side effect says so with `# noqa`)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_undefined_names_unused_imports_or_unread_locals_in_the_library():
  api = pytest.importorskip("pyflakes.api", reason="pyflakes is in the test extra: pip install -e '.[test]'")
  from pyflakes import messages, reporter

  found = []

  class Collect(reporter.Reporter):
    def __init__(self):
      super().__init__(None, None)

    def flake(self, message):
      if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
        found.append(str(message))
      elif isinstance(message, (messages.UnusedImport, messages.UnusedVariable)):
        line = Path(message.filename).read_text().splitlines()[message.lineno - 1]
        if "# noqa" not in line:
          found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
      found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
      found.append(f"{filename}: {msg}")

  files = sorted(str(p) for d in ("remixer_t5", "tasks", "launch", "scripts") for p in (ROOT / d).rglob("*.py"))
  assert len(files) > 50, files
  api.checkRecursive(files, Collect())
  assert not found, "\n".join(found)
