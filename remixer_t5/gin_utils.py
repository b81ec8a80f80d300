"""Gin at the boundary: config files, t5x-style bindings, search paths and clear errors.

Used by the CLI and by `models.from_gin`; the library itself never reads gin.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import io
import logging
import re
import tokenize
from pathlib import Path
from typing import Mapping, Sequence

import gin

from remixer_t5 import storage
from remixer_t5.gin_names import MACROS, MOVED


def _moved_hint(message: str, binding: str = "") -> str:
  """For an import of a module that moved when the package was divided, or a binding of a run setting on the
  trainer's functions (now run_config's; in a file, or on the command line, where the run files no longer import
  the trainer), the line to write instead (gin_names.MOVED)."""
  m = re.search(r"No module named '(remixer_t5\.\w+)'", message)
  if m and m.group(1) in MOVED:
    old, (head, _, tail) = m.group(1), MOVED[m.group(1)].rpartition(".")
    name = old.rpartition(".")[2]
    where = f"from {head} import {tail}" + (f" as {name}" if tail != name else "")
    return f" ({old} has moved: write `{where}` (a gin file's bindings such as {name}.X.y stay as they are))"
  m = re.search(
    r"Configurable '(?:[\w.]*\.)?(?:train|evaluate_checkpoint)' doesn't have a parameter named "
    r"'(\w+)'",
    message,
  )
  m = m or re.match(r"\s*trainer\.(?:train|evaluate_checkpoint)\.(\w+)\s*=", binding)
  if not m or f"trainer.{m.group(1)}" not in MOVED:
    return ""
  where = MOVED[f"trainer.{m.group(1)}"]
  field = where.rpartition(".")[2]
  macro = f" (the macro {MACROS[field]})" if field in MACROS else ""
  return f"; a run's settings moved to remixer_t5/training/run_config.py: bind {where}{macro} instead"


def gin_dir() -> Path:
  """The gin configs: the repository's top-level gin/ in a checkout, remixer_t5/gin in an installed wheel."""
  here = Path(__file__).resolve().parent
  for candidate in (here / "gin", here.parent / "gin"):
    if candidate.is_dir():
      return candidate
  raise FileNotFoundError(f"gin configs not found next to {here}")


class GinError(ValueError):
  pass


def _closest(name: str, candidates, prefix: str = "") -> str:
  """' (did you mean PREFIX.X?)' for the candidate nearest `name`, '' when none is near."""
  match = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
  return f" (did you mean {prefix + '.' if prefix else ''}{match[0]}?)" if match else ""


def _parameters(fn) -> list[str]:
  """The keyword parameters gin can bind on `fn` (a class: its constructor's)."""
  try:
    signature = inspect.signature(inspect.unwrap(fn))
  except (TypeError, ValueError):
    return []
  return [
    p.name
    for p in signature.parameters.values()
    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
  ]


def _imported(alias: str, imports: Sequence[str]):
  """The module an import of the parsed files binds to `alias` (dynamic registration: its last component)."""
  for name in imports:
    if name != "__gin__.dynamic_registration" and (name == alias or name.rpartition(".")[2] == alias):
      try:
        return importlib.import_module(name)
      except ImportError:
        return None
  return None


def _unknown_name(message: str, imports: Sequence[str]) -> str | None:
  """For gin's errors about a name it does not know (a configurable, a parameter, an import), what is unknown
  and the closest known name; None for any other error."""
  m = re.search(r"Couldn't resolve selector ([\w.]+); .* has no attribute (\w+)", message)
  if m:  # dynamic registration: `module.Name` where the module has no Name
    selector, attr = m.groups()
    parts = selector.split(".")
    depth = parts.index(attr) if attr in parts else len(parts) - 1
    parent = _imported(parts[0], imports)
    for part in parts[1:depth]:
      parent = getattr(parent, part, None)
    known = [n for n in dir(parent) if not n.startswith("_")] if parent is not None else []
    return f"unknown configurable {selector!r}" + _closest(attr, known, ".".join(parts[:depth]))
  m = re.search(r"No configurable matching (?:reference )?'@?([\w./]+?)(?:\(\))?'", message)
  if m:  # a configurable registered by name (gin.configurable) that is not
    selector = m.group(1).rpartition("/")[2]
    registered = [c.selector for _, c in gin.config._REGISTRY.items()]  # noqa: SLF001
    tails = [".".join(sel.split(".")[-(selector.count(".") + 1) :]) for sel in registered]
    return f"unknown configurable {selector!r}" + _closest(selector, tails)
  m = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", message)
  if m:
    selector, name = m.groups()
    try:
      configurable = gin.config._REGISTRY.get_match(selector)  # noqa: SLF001
    except (KeyError, ValueError):
      configurable = None
    known = _parameters(configurable.wrapped) if configurable is not None else []
    return f"{selector} has no parameter {name!r}" + _closest(name, known)
  m = re.search(r"'(\w+)' was not provided by an import statement", message)
  if m:
    aliases = [n.rpartition(".")[2] for n in imports if n != "__gin__.dynamic_registration"]
    return f"{m.group(1)!r} was not imported by the gin files" + _closest(m.group(1), aliases)
  return None


def _file_error(f: str, e: BaseException, imports: Sequence[str]) -> GinError:
  """One line for an error gin raised parsing file `f`: its file and line where gin says them, and what is
  unknown (with the closest known name) where a name is."""
  text = str(e)
  where = re.search(r'In file "([^"]+)", line (\d+)', text)
  place = f"{where.group(1)}, line {where.group(2)}" if where else f"gin file {f}"
  what = _unknown_name(text, imports) or text.splitlines()[0].rstrip(".")
  return GinError(f"in {place}: {what}{_moved_hint(text)}")


def split_flags(argv: Sequence[str]) -> tuple[list[str], list[str], list[str], list[str]]:
  """(gin files, bindings 'NAME=VALUE', search paths, remaining args)."""
  files, bindings, paths, rest = [], [], [], []
  args = iter(argv)
  for a in args:
    key, eq, val = a.partition("=")
    if key in ("--gin_file", "--gin_search_paths") and not eq:
      val, eq = next(args, None), "="
      if val is None:
        raise GinError(f"{key} needs a value")
    if key == "--gin_file":
      files.append(val)
    elif key == "--gin_search_paths":
      paths.extend(p for p in val.split(",") if p)
    elif a.startswith("--gin.") and eq:
      bindings.append(f"{key[len('--gin.') :]}={val}")
    elif a.startswith("--gin.") or a == "--gin_bindings":
      raise GinError(f"malformed gin flag {a!r}; expected --gin.NAME=VALUE")
    else:
      rest.append(a)
  return files, bindings, paths, rest


def _resolve(path: str, search: Sequence[Path]) -> str:
  if storage.is_bucket(path):  # a run's config.gin or an import-hf model.gin in a bucket: gin reads local files
    try:
      return storage.local_copy(path)
    except FileNotFoundError:
      raise GinError(f"gin file {path!r} not found") from None
  p = Path(path).expanduser()
  if p.is_file():
    return str(p)
  for root in search:
    if (root / path).is_file():
      return str(root / path)
  looked = [str(p.absolute())] + [str(r / path) for r in search]
  raise GinError(f"gin file {path!r} not found; looked in:\n  " + "\n  ".join(looked))


def _binding_value(value: str) -> str:
  """The gin value as given; a bare word that is no Python literal or gin reference (a path) becomes a string."""
  v = value.strip()
  if v.startswith(("@", "%", "(", "[", "{", "'", '"')) or v in ("None", "True", "False"):
    return v  # a reference, or a literal meant as one (a broken one is reported, not read as a string)
  try:
    ast.literal_eval(v)
    return v
  except (ValueError, SyntaxError):
    return repr(value)


def _unclosed(text: str) -> tuple[str, int] | None:
  """The bracket (or string) left open at the end of `text` and its line: what Python's tokenizer (which gin
  uses) reports only as 'EOF in multi-line statement' at the end of the file."""
  stack: list[tuple[str, int]] = []
  try:
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type == tokenize.OP and tok.string in "([{":
        stack.append((tok.string, tok.start[0]))
      elif tok.type == tokenize.OP and tok.string in ")]}" and stack:
        stack.pop()
  except (tokenize.TokenError, SyntaxError, IndentationError) as e:
    if isinstance(e, SyntaxError) and e.lineno:  # an unterminated triple-quoted string
      return ("string", e.lineno)
  return stack[-1] if stack else None


def _included(path: str, search: Sequence[Path], seen: set | None = None) -> list[str]:
  """`path` and, depth first, the files its `include` lines name (resolved as gin resolves them)."""
  seen = set() if seen is None else seen
  if path in seen or not Path(path).is_file():
    return []
  seen.add(path)
  out = [path]
  for name in re.findall(r"^\s*include\s+['\"]([^'\"]+)['\"]", Path(path).read_text(), flags=re.M):
    try:
      out += _included(_resolve(name, search), search, seen)
    except GinError:
      pass  # gin reports a missing include itself
  return out


def _syntax_error(e: BaseException, where: str, path: str | None = None, search: Sequence[Path] = ()) -> GinError:
  """One line naming the file (or binding), the line and what is wrong, for gin's SyntaxError and the
  tokenize.TokenError it lets through for an unclosed bracket (without a file name or, from an include, any
  message)."""
  if isinstance(e, SyntaxError):
    place = f"{e.filename or where}, line {e.lineno}" if e.lineno else (e.filename or where)
    text = (e.text or "").strip()
    return GinError(
      f"gin syntax error in {place}: {(e.msg or 'invalid syntax').rstrip('.')}" + (f": {text}" if text else "")
    )
  for name in _included(path, search) if path else []:
    found = _unclosed(Path(name).read_text())
    if found:
      kind, line = found
      what = "string" if kind == "string" else f"'{kind}'"
      return GinError(f"gin syntax error in {name}, line {line}: unclosed {what} (the file ends inside it)")
  return GinError(f"gin syntax error in {where}: an unclosed bracket or string")


def _imports(parsed) -> list[str]:
  """Module names imported by a parsed gin file and everything it includes."""
  out = list(parsed.imports)
  for inc in parsed.includes:
    out += _imports(inc)
  return out


def _import_lines(modules: Sequence[str]) -> str:
  dynamic = "__gin__.dynamic_registration" in modules
  lines = ["from __gin__ import dynamic_registration"] if dynamic else []
  for m in dict.fromkeys(modules):
    if m == "__gin__.dynamic_registration":
      continue
    head, _, tail = m.rpartition(".")
    lines.append(f"from {head} import {tail}" if (dynamic and head) else f"import {m}")
  return "".join(line + "\n" for line in lines)


def _set_gin_search_path(search: Sequence[Path]) -> None:
  """Includes resolve in --gin_search_paths, then the package's gin/, then the working directory.

  gin also asks a package-resource reader, which crashes (TypeError) when the first path component names a
  namespace package, e.g. a `runs/` folder in the working directory; make its existence check safe."""
  gin.config._LOCATION_PREFIXES[:] = [str(p) for p in search] + [""]  # noqa: SLF001

  def safe(check):
    if getattr(check, "_remixer_safe", False):
      return check

    def exists(path):
      try:
        return bool(check(path))
      except Exception:  # noqa: BLE001 - any failure means "not readable by this reader"
        return False

    exists._remixer_safe = True
    return exists

  gin.config._FILE_READERS[:] = [(r, safe(c)) for r, c in gin.config._FILE_READERS]  # noqa: SLF001


def parse_gin(
  files: Sequence[str],
  bindings: Sequence[str],
  search_paths: Sequence[str] = (),
  macro_defaults: Mapping[str, str] | None = None,
) -> None:
  """Parse gin files then bindings; unknown configurables/parameters and unknown macros are errors.

  `macro_defaults` {NAME: gin value} binds those macros the files define (e.g. a run's `MODEL_DIR =
  %gin.REQUIRED`) before the user's bindings, which still override them; names the files lack are ignored."""
  # gin logs an ERROR for every search path an include is not found in before the one it is found in.
  root = logging.getLogger()
  level = root.level
  root.setLevel(logging.CRITICAL)
  try:
    _parse(files, bindings, search_paths, macro_defaults)
  finally:
    root.setLevel(level)


def _file_imports(path: str) -> list[str]:
  """The modules a gin file imports (its own lines only), for naming what a failed parse of it knew."""
  try:
    text = Path(path).read_text()
  except OSError:
    return []
  return [
    m.group(1) or f"{m.group(2)}.{m.group(3)}"
    for m in re.finditer(r"^\s*(?:import\s+([\w.]+)|from\s+([\w.]+)\s+import\s+(\w+))", text, flags=re.M)
  ]


def _parse(files, bindings, search_paths, macro_defaults) -> None:
  gin.clear_config()
  search = [Path(p) for p in search_paths] + [gin_dir()]
  _set_gin_search_path(search)
  imports: list[str] = []
  for f in files:
    path = _resolve(f, search)
    try:
      imports += _imports(gin.parse_config_file(path))
    except GinError:
      raise
    except (SyntaxError, tokenize.TokenError) as e:
      raise _syntax_error(e, f"{f} (or a file it includes)", path, search) from e
    except (ValueError, KeyError, ImportError, NameError, AttributeError, IOError) as e:
      raise _file_error(f, e, imports + _file_imports(path)) from e
  # Bindings see the files' imports, so `--gin.VOCABULARY=@vocab.get_vocabulary()` resolves as in the files.
  prelude = _import_lines(imports)
  macros = {name for (name, kind) in gin.config._CONFIG if kind == "gin.macro"}  # noqa: SLF001
  defaults = [f"{k}={v}" for k, v in (macro_defaults or {}).items() if k in macros]
  for b in defaults + list(bindings):
    name, _, value = b.partition("=")
    name = name.strip()
    if "." not in name and "/" not in name and name not in macros:
      if name in MACROS.values():  # a run's setting, and no run file among the files
        raise GinError(
          f"--gin.{b} sets a run's {name}, and no run config is loaded: add a run config, e.g. "
          "--gin_file=runs/pretrain.gin beside the model config"
        )
      raise GinError(
        f"unknown gin macro {name!r} in --gin.{b}{_closest(name, macros)}; the loaded files "
        f"define: {', '.join(sorted(macros)) or 'none'}"
      )
    try:
      gin.parse_config(prelude + f"{name} = {_binding_value(value)}")
    except (SyntaxError, tokenize.TokenError) as e:
      raise GinError(
        f"bad gin binding --gin.{b}: not a gin value (an unclosed bracket or string, or a stray character)"
      ) from e
    except (ValueError, KeyError, ImportError, NameError, AttributeError) as e:
      what = _unknown_name(str(e), imports) or str(e).splitlines()[0].rstrip(".")
      raise GinError(f"bad gin binding --gin.{b}: {what}{_moved_hint(str(e), b)}") from e
  try:
    gin.finalize()
  except ValueError as e:
    required = re.match(r"(\w+)/macro\.value set to `%gin\.REQUIRED`", str(e))
    if required:
      name = required.group(1)
      example = "\"'/path/to/run'\"" if name == "MODEL_DIR" else "VALUE"
      raise GinError(f"the gin files require {name}: pass --gin.{name}={example}") from e
    unbound = re.match(r"No bindings specified for '(\w+)/gin\.macro'", str(e))
    if unbound and unbound.group(1) == "MODEL":  # every model file defines it: none was given
      raise GinError(
        "the gin config uses %MODEL, which no file defines: pass a model config before the run "
        "config, e.g. --gin_file=models/t5_1_1/small.gin"
      ) from e
    if unbound:
      name = unbound.group(1)
      raise GinError(
        f"the gin config uses %{name}, which no file or binding defines{_closest(name, macros)}; "
        f"define it in a gin file or pass --gin.{name}=VALUE"
      ) from e
    raise GinError(f"incomplete gin config: {str(e).splitlines()[0]}") from e


def macro(name: str, default=None):
  """A macro's value, `default` when the config has none; a configurable reference is called (`@f()`, so MODEL =
  @models.EncoderDecoderModel() gives the model) or given as the function (`@f`), as gin would pass it."""
  try:
    value = gin.query_parameter(f"%{name}")
  except ValueError:
    return default
  if isinstance(value, gin.config.ConfigurableReference):
    return value.scoped_configurable_fn() if value.evaluate else value.scoped_configurable_fn
  return value
