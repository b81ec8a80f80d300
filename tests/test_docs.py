"""The README and the manual under docs/ against the code, so they cannot rot.

Every `remixer-t5 <command>` they quote parses with the CLI's own argument parser (in-process: code blocks as
whole command lines, inline synopses flag by flag), every repository path they name exists, every image they
show is in the repository, every page is in mkdocs.yml's nav, the results pages stay within their line budgets
and no page reads as a diary. With MkDocs installed (the docs and test extras) the strict site build runs too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

LINE_BUDGETS = {README: 200, DOCS / "benchmarks.md": 400, DOCS / "reproductions.md": 400}
# Pages `repro` writes beside its rows (docs/data/): built by MkDocs but left out of the nav (mkdocs.yml).
GENERATED_TABLE = re.compile(r"^data/(.+/)?[^/]*_table\.md$")

# A diary in the docs: dated entries, numbered work periods, issue numbers, the process signals used while
# measuring, "this machine". A date may stand only on a table's "**Measured:**" line.
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
DIARY = {
  "a numbered work period": re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th))\s+"
    r"(session|measurement|lease|work period|call)s?\b",
    re.I,
  ),
  "an issue number": re.compile(r"\bissues?\s+#?\d+", re.I),
  "a process signal used while measuring": re.compile(r"\bSIG(STOP|CONT)\b"),
  "\"this machine\"": re.compile(r"\bthis machine\b", re.I),
}

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")
# Paths a page may name in backticks: under these folders of the repository, or gin files under gin/.
REPO_DIRS = ("remixer_t5", "tasks", "gin", "launch", "scripts", "tests", "docs")
GIN_DIRS = ("models", "runs", "partitioning", "t5x")
REPO_FILES = ("Makefile", "setup.py", "mkdocs.yml", "README.md")


def _rel(page: Path) -> str:
  return str(page.relative_to(ROOT))


def _text(page: Path) -> str:
  return page.read_text(encoding="utf-8")


def _fences(text: str):
  """(language, body) of each fenced code block."""
  return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)]


def _prose(text: str) -> str:
  """The page without its fenced code blocks (inline code spans and links are read from this)."""
  return FENCE.sub("", text)


def _shell_lines(body: str):
  """A shell block's logical lines: continuations joined, comments dropped."""
  for line in body.replace("\\\n", " ").splitlines():
    try:
      yield shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: not a command line we can read
      continue


OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "2>&1", "&"}


def _cli_argvs(tokens: list[str]):
  """The argument lists of every remixer-t5 command line in a token list: `remixer-t5 ...` (any path to the
  script), `python -m remixer_t5 ...`, and a launcher's `launch/*.sh ... -- ARGS`."""
  for i, tok in enumerate(tokens):
    start = None
    if Path(tok).name == "remixer-t5":
      start = i + 1
    elif Path(tok).name.startswith("python") and tokens[i + 1 : i + 3] == ["-m", "remixer_t5"]:
      start = i + 3
    elif tok.startswith("launch/") and tok.endswith(".sh") and "--" in tokens[i + 1 :]:
      start = tokens.index("--", i + 1) + 1
    if start is None:
      continue
    argv = []
    for t in tokens[start:]:
      if t in OPERATORS or t.startswith((">", "2>")):
        break
      argv.append(t)
    yield argv


@pytest.fixture(autouse=True)
def _fresh_data_dir():
  """Overrides conftest's, which resets the tasks' data directory after each test: these tests never set it, and
  need not import the tasks (seqio, TensorFlow) to say so."""
  yield


@pytest.fixture(scope="module")
def cli():
  from remixer_t5 import cli as module

  return module


def _full_parse(cli, argv: list[str]) -> str | None:
  """None when `argv` parses as the CLI parses it (gin flags split off first), else the parser's message."""
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      args, _ = cli.parse(argv)
  except SystemExit:
    return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"
  files, _, paths = args.gin
  missing = [f for f in files if not _gin_file_exists(f, paths)]
  return f"no gin file {missing}" if missing else None


def _gin_file_exists(name: str, search_paths) -> bool:
  name = name.strip("'\"")
  if "$" in name or "<" in name:
    return True
  roots = [ROOT, ROOT / "gin", *[Path(p) for p in (search_paths or [])]]
  return any((r / name).exists() for r in roots)


def _synopsis_problem(cli, span: str) -> str | None:
  """An inline synopsis (`remixer-t5 compile --topology T [--json]`, `bench mixing|input`): the command (each of
  its alternatives) and every flag it names must exist; values and placeholders are not checked."""
  text = re.sub(r"\[([^\]]*)\]", r" \1 ", span.replace("\\|", "|"))
  tokens = [t for t in text.split() if t not in ("...", "…")]
  words = [t for t in tokens if not t.startswith("-")]
  table, names = cli.COMMANDS, []
  while isinstance(table, dict):
    if not words[len(names) :]:
      return None if names else "no command"  # `remixer-t5 repro` alone names the group
    choices = words[len(names)].split("|")
    if any(c not in table for c in choices):
      return f"no `{' '.join([*names, choices[0]])}`: expected one of {sorted(table)}"
    names.append(choices[0])
    table = table[choices[0]]
  parsers = [cli.parser([*names[:-1], c])[0] for c in words[len(names) - 1].split("|")]
  for flag in (t.split("=")[0] for t in tokens if t.startswith("-") and t != "--"):
    if flag.startswith(("--gin.", "--gin_file", "--gin_search_paths")):
      continue
    if not any(flag in p._option_string_actions for p in parsers):  # noqa: SLF001
      return f"`{' '.join(names)}` has no flag {flag}"
  return None


def _commands():
  """(page, kind, text) of every remixer-t5 command the pages quote."""
  found = []
  for page in PAGES:
    text = _text(page)
    for lang, body in _fences(text):
      if lang in SHELL_LANGS:
        for tokens in _shell_lines(body):
          for argv in _cli_argvs(tokens):
            found.append((page, "line", argv))
    for span in INLINE.findall(_prose(text)):
      span = " ".join(span.split())
      if "<" in span:  # `remixer-t5 <command>`: a placeholder, not a command
        continue
      m = re.search(r"(?:^|[\s/])remixer-t5\s+(.*)$", span)
      if m:
        found.append((page, "synopsis", m.group(1)))
  return found


def test_quoted_commands_parse(cli):
  commands = _commands()
  assert len(commands) > 40, "the pages quote the CLI often; did the extraction break?"
  problems = []
  for page, kind, command in commands:
    problem = _full_parse(cli, command) if kind == "line" else _synopsis_problem(cli, command)
    if problem:
      shown = " ".join(command) if kind == "line" else command
      problems.append(f"{_rel(page)}: remixer-t5 {shown}\n    -> {problem}")
  assert not problems, "commands in the docs that the CLI does not take:\n" + "\n".join(problems)


def _named_paths(page: Path):
  """Repository paths a page names: link targets, image sources, and paths in inline code."""
  text = _prose(_text(page))
  for bang, target in LINK.findall(text):
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
      continue
    yield ("image" if bang else "link"), (page.parent / target.split("#")[0]).resolve()
  for span in INLINE.findall(text):
    for token in span.split():
      token = token.split("=")[-1].strip("'\"(),;:.")
      token = token.split("::")[0]
      if not token or any(c in token for c in "<>{}*$~…") or "://" in token:
        continue
      first = token.split("/")[0]
      if token in REPO_FILES or (first in REPO_DIRS and "/" in token):
        yield "path", ROOT / token
      elif first in GIN_DIRS and token.endswith(".gin"):
        yield "path", ROOT / "gin" / token


def test_named_paths_and_images_exist():
  missing = [
    f"{_rel(page)}: {kind} {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    for page in PAGES
    for kind, path in _named_paths(page)
    if not path.exists()
  ]
  assert not missing, "paths the docs name that the repository does not have:\n" + "\n".join(missing)


def _anchors(page: Path) -> set[str]:
  """The ids Python-Markdown's toc extension (MkDocs's) gives the page's headings."""
  from markdown.extensions.toc import slugify

  return {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _prose(_text(page)), re.M)}


def test_linked_anchors_exist():
  """README's links into the manual (MkDocs checks the manual's own, when it is installed)."""
  broken = []
  for page in PAGES:
    for _, target in LINK.findall(_prose(_text(page))):
      path, _, anchor = target.partition("#")
      if not anchor or re.match(r"^[a-z]+:", target):
        continue
      doc = (page.parent / path).resolve() if path else page
      if doc.suffix == ".md" and doc.exists() and anchor not in _anchors(doc):
        broken.append(f"{_rel(page)}: {target}")
  assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def test_every_page_is_in_the_nav():
  nav = _text(ROOT / "mkdocs.yml")
  listed = set(re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", nav, re.M))
  pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
  assert not listed - pages, f"mkdocs.yml lists pages that do not exist: {sorted(listed - pages)}"
  omitted = sorted(p for p in pages - listed if not GENERATED_TABLE.match(p))
  assert not omitted, f"pages missing from mkdocs.yml's nav: {omitted}"


@pytest.mark.parametrize("page", sorted(LINE_BUDGETS), ids=lambda p: p.name)
def test_line_budget(page):
  lines = len(_text(page).splitlines())
  assert lines <= LINE_BUDGETS[page], f"{_rel(page)} has {lines} lines, over its budget of {LINE_BUDGETS[page]}"


def test_no_diary():
  found = []
  for page in PAGES:
    for n, line in enumerate(_text(page).splitlines(), 1):
      if DATE.search(line) and not line.lstrip().startswith("**Measured:**"):
        found.append(f"{_rel(page)}:{n}: a date outside a table's **Measured:** line: {line.strip()[:100]}")
      for what, pattern in DIARY.items():
        if pattern.search(line):
          found.append(f"{_rel(page)}:{n}: {what}: {line.strip()[:100]}")
  assert not found, "the docs say what is, not how it was found (that is git log's):\n" + "\n".join(found)


def test_strict_site_build(tmp_path):
  if importlib.util.find_spec("mkdocs") is None:
    pytest.skip("MkDocs is not installed (pip install -e '.[docs]'): the strict site build is not checked")
  result = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, "mkdocs build --strict failed:\n" + result.stderr[-4000:]
