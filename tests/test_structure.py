"""The code's structure, read from its imports: every import at the top of its module except the few listed in
LAZY, and no import that runs back up (no module, and no part of the package, that imports one which imports it).
docs/architecture.md is the map these hold; docs/contributing.md says how to add a command."""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("remixer_t5", "tasks")

# The imports that stay inside functions, by the module imported, and why. Everything else is imported at the top
# of its module: an optional stack stays out of a command's start-up because the command module that needs it is
# imported only when that command is dispatched (remixer_t5/cli.py).
LAZY = {
  # Extras that a default install lacks, imported where a feature asks for them.
  "torch": "the hf extra: PyTorch checkpoints (import-hf), and bench's HF reference",
  "transformers": "the hf extra: bench's HF reference",
  "wandb": "the wandb extra: a run's rows in Weights & Biases, when asked for",
  "submitit": "the slurm extra: sweep --executor slurm",
  "t5x": "not a dependency: interop/t5x.py's rules, for t5x's own trainer when it runs our model",
  # Slow to import, and needed only on one path.
  "gcsfs": "storage.py, run_lock.py: close to a second to import, and needed only for a gs:// path",
  "fsspec": "run_lock.py: gcsfs's event loop, for a gs:// lock",
  "gensim": "data/embedded_corpus.py: over a second to import, and needed only to build the corpus from a dump",
  "scipy": "tasks/metrics.py: STS-B's correlation alone; scipy starts its own thread pool",
  "matplotlib": "training/plots.py's pyplot(): the Agg backend chosen when a figure is drawn, not when the module "
  "is imported (a notebook that imports it keeps its own backend)",
  # Kept out of the commands that run without TensorFlow (compile, info, import-hf): the model gin files import
  # data/vocab.py and word_vocab.py (their VOCABULARY), checkpoints import run_identity.py, and plot and sweep
  # read training/best.py.
  "seqio": "data/vocab.py, word_vocab.py, training/run_identity.py: only when a vocabulary or task is made",
  "tensorflow": "data/embedded_corpus.py and model/projection.py (pNLP-Mixer's hashing on the host), "
  "interop/hf.py (the tokenizer's files): only when used",
  "remixer_t5.tasks": "training/best.py (T5's SuperGLUE report) and run_identity.py (a task's own files)",
  # Start-up: runtime.py decides how JAX starts before JAX is imported (its docstring).
  "jax": "runtime.py: before JAX starts",
  "jax_plugins": "runtime.py: which platform JAX will pick, without starting it",
}
MAX_LAZY = 40


def _modules():
  for source in SOURCES:
    for path in sorted((ROOT / source).rglob("*.py")):
      rel = path.relative_to(ROOT).with_suffix("").parts
      parts = (["remixer_t5"] if rel[0] == "tasks" else []) + list(rel)
      yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _inner_imports(tree: ast.AST):
  """(line, module) of each import whose nearest enclosing scope is a function."""

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
        names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or "."]
        for name in names:
          yield child.lineno, name
      yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  yield from visit(tree, False)


def _lazy_reason(name: str) -> str | None:
  return next((why for module, why in LAZY.items() if name == module or name.startswith(module + ".")), None)


def test_imports_are_at_the_top_of_modules_except_the_listed_lazy_ones():
  inner = [
    (path.relative_to(ROOT), line, name)
    for _, path in _modules()
    for line, name in _inner_imports(ast.parse(path.read_text()))
  ]
  unlisted = [f"{path}:{line}: {name}" for path, line, name in inner if _lazy_reason(name) is None]
  assert not unlisted, "imports inside functions that LAZY does not list:\n" + "\n".join(unlisted)
  assert len(inner) <= MAX_LAZY, [f"{p}:{line}: {n}" for p, line, n in inner]


def _graph():
  """module -> the project modules it imports (anywhere in it), read from the source."""
  modules = dict(_modules())
  graph = collections.defaultdict(set)
  for name, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        found = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
      else:
        continue
      graph[name].update(m for m in found if m in modules and m != name)
  return graph


def _cycles(graph) -> list[list[str]]:
  """The strongly connected components of more than one node (Tarjan's algorithm)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))

  for v in list(graph):
    if v not in index:
      visit(v)
  return found


def _part(module: str) -> str:
  """The part of the package a module belongs to: its folder under remixer_t5/ (model, training, tasks, ...), or
  itself for a top-level module (cli, storage, ...)."""
  return module.split(".")[1] if module.count(".") else module


def test_no_import_runs_back_up():
  graph = _graph()
  assert not _cycles(graph), _cycles(graph)
  parts = collections.defaultdict(set)
  for module, imported in graph.items():
    parts[_part(module)].update(_part(m) for m in imported if _part(m) != _part(module))
  cycles = _cycles(parts)
  edges = [
    f"{a} -> {b}"
    for a, targets in graph.items()
    for b in targets
    if any(_part(a) in c and _part(b) in c for c in cycles) and _part(a) != _part(b)
  ]
  assert not cycles, f"parts that import each other: {cycles}\n" + "\n".join(sorted(edges))


def test_the_layers_hold():
  """The model side never imports the data side or training; training never imports interop/, the commands or
  the benchmarks; nothing below the command line imports it."""
  graph = _graph()
  rules = {
    "model": ("data", "tasks", "training", "interop", "commands", "bench", "repro", "cli"),
    "kernels": ("model", "data", "tasks", "training", "interop", "commands", "bench", "cli"),
    "training": ("interop", "commands", "bench", "repro", "cli", "sweep", "compare", "study"),
    "data": ("model", "training", "commands", "cli"),
    "gin_utils": ("training", "model", "commands", "cli"),
    "storage": ("training", "commands", "cli"),
  }
  wrong = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if _part(b) in rules.get(_part(a), ())]
  assert not wrong, wrong


def test_the_command_line_only_dispatches():
  """cli.py names the commands and dispatches; each command's flags and work live in its own module."""
  text = (ROOT / "remixer_t5" / "cli.py").read_text()
  assert len(text.splitlines()) <= 200
  assert "add_argument(" not in text


def test_starting_a_command_loads_only_what_it_needs():
  """`compile` and `info` (shapes alone) never load TensorFlow, seqio or PyTorch; `--help` loads no command."""
  code = (
    "import contextlib, io, sys; from remixer_t5 import cli\n"
    "for argv in (['--help'], ['bench', '--help']):\n"
    "  with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): cli.parser(argv)\n"
    "print(sorted(m for m in sys.modules if m.startswith('remixer_t5.commands.') and m != "
    "'remixer_t5.commands.common' and m != 'remixer_t5.commands.errors'))\n"
    "cli.parser(['compile']); cli.parser(['info'])\n"
    "print(sorted(m for m in ('tensorflow', 'seqio', 'torch', 'matplotlib') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
  assert out.split() == ["[]", "[]"], out
