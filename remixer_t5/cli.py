"""`remixer-t5 <command>`: train, eval, info, import-hf, export-hf, with t5x-style gin flags.

  --gin_file=F          repeatable; looked up as given, then in --gin_search_paths, then in the package's gin/
  --gin.NAME=VALUE      a binding applied after the files (`--gin.MODEL_DIR="'/tmp/run'"`, `--gin.BATCH_SIZE=8`)
  --gin_search_paths=A,B
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from remixer_t5.checkpoints import IncompatibleModelDirError


def gin_dir() -> Path:
  """The gin configs: the repository's top-level gin/ in a checkout, remixer_t5/gin in an installed wheel."""
  here = Path(__file__).resolve().parent
  for candidate in (here / "gin", here.parent / "gin"):
    if candidate.is_dir():
      return candidate
  raise FileNotFoundError(f"gin configs not found next to {here}")


class GinError(ValueError):
  pass


def split_flags(argv: Sequence[str]) -> tuple[list[str], list[str], list[str], list[str]]:
  """(gin files, bindings 'NAME=VALUE', search paths, remaining args)."""
  files, bindings, paths, rest = [], [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    a = args[i]
    key, eq, val = a.partition("=")
    if key in ("--gin_file", "--gin_search_paths") and not eq:
      if i + 1 >= len(args):
        raise GinError(f"{key} needs a value")
      i += 1
      val, eq = args[i], "="
    if key == "--gin_file":
      files.append(val)
    elif key == "--gin_search_paths":
      paths.extend(p for p in val.split(",") if p)
    elif a.startswith("--gin.") and eq:
      bindings.append(f"{key[len('--gin.'):]}={val}")
    elif a.startswith("--gin.") or a == "--gin_bindings":
      raise GinError(f"malformed gin flag {a!r}; expected --gin.NAME=VALUE")
    else:
      rest.append(a)
    i += 1
  return files, bindings, paths, rest


def _resolve(path: str, search: Sequence[Path]) -> str:
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
  import ast
  v = value.strip()
  if v.startswith(("@", "%")) or v in ("None", "True", "False"):
    return v
  try:
    ast.literal_eval(v)
    return v
  except (ValueError, SyntaxError):
    return repr(value)


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
  namespace package, e.g. a `runs/` folder in the working directory; make its existence check safe.
  """
  import gin
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


def parse_gin(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
  """Parse gin files then bindings; unknown configurables/parameters and unknown macros are errors."""
  import logging

  import gin
  gin.clear_config()
  # gin logs an ERROR for every search path an include is not found in before the one it is found in.
  logging.getLogger().setLevel(logging.CRITICAL)
  search = [Path(p) for p in search_paths] + [gin_dir()]
  _set_gin_search_path(search)
  imports: list[str] = []
  for f in files:
    try:
      imports += _imports(gin.parse_config_file(_resolve(f, search)))
    except GinError:
      raise
    except (ValueError, KeyError, ImportError, NameError, IOError) as e:
      raise GinError(f"in gin file {f}: {e}") from e
  # Bindings see the files' imports, so `--gin.VOCABULARY=@vocab.get_vocabulary()` resolves as in the files.
  prelude = _import_lines(imports)
  macros = {name for (name, kind) in gin.config._CONFIG if kind == "gin.macro"}  # noqa: SLF001
  for b in bindings:
    name, _, value = b.partition("=")
    name = name.strip()
    if "." not in name and "/" not in name and name not in macros:
      raise GinError(f"unknown gin macro {name!r} in --gin.{b}; the loaded files define: "
                     f"{', '.join(sorted(macros)) or 'none'}")
    try:
      gin.parse_config(prelude + f"{name} = {_binding_value(value)}")
    except (ValueError, KeyError, ImportError, NameError) as e:
      raise GinError(f"bad gin binding --gin.{b}: {e}") from e
  try:
    gin.finalize()
  except ValueError as e:
    raise GinError(f"incomplete gin config: {e}") from e
  logging.getLogger().setLevel(logging.WARNING)


def _query(name: str, default=None):
  import gin
  try:
    return gin.query_parameter(name)
  except ValueError:
    return default


def _macro(name: str, default=None):
  """Evaluate a macro (resolving configurable references such as MODEL = @models.EncoderDecoderModel())."""
  import gin
  value = _query(f"%{name}", default)
  if isinstance(value, gin.config.ConfigurableReference):
    return value.scoped_configurable_fn()
  return value


# --- commands ------------------------------------------------------------------------------------------
def cmd_train(_: argparse.Namespace) -> int:
  import gin
  from remixer_t5 import trainer
  gin.get_configurable(trainer.train)(config_text=gin.config_str())
  return 0


def cmd_eval(_: argparse.Namespace) -> int:
  import gin
  from remixer_t5 import trainer
  metrics = gin.get_configurable(trainer.evaluate_checkpoint)()
  print(json.dumps(metrics))
  return 0


def cmd_info(args: argparse.Namespace) -> int:
  from remixer_t5 import info
  model = _macro("MODEL")
  if model is None:
    raise GinError("the gin files define no MODEL; pass a model config, e.g. --gin_file=models/t5_1_1/small.gin")
  lengths = _macro("TASK_FEATURE_LENGTHS") or {"inputs": 512, "targets": 114}
  report = info.model_info(model, lengths)
  print(info.format_report(report))
  if args.show_sharding:
    print(info.format_sharding(model, lengths))
  if args.json:
    print(json.dumps({k: v for k, v in report.items() if k != "modules_tree"}))
  return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
  from remixer_t5 import checkpoints, hf
  out = Path(args.out_dir)
  if out.exists() and any(out.iterdir()):
    raise FileExistsError(f"{out} exists and is not empty; choose a new OUT_DIR")
  module, params = hf.load_hf_t5(args.hf_dir)
  tmp = out.with_name(out.name + ".partial")
  if tmp.exists():
    import shutil
    shutil.rmtree(tmp)
  tmp.mkdir(parents=True)
  checkpoints.save_params(tmp / "checkpoint", params)
  (tmp / "model.gin").write_text(model_gin(module.config, source=str(args.hf_dir)))
  if out.exists():
    out.rmdir()
  tmp.rename(out)
  n = sum(int(p.size) for p in __import__("jax").tree_util.tree_leaves(params))
  print(f"wrote {out}/checkpoint ({n:,} params) and {out}/model.gin")
  return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
  from remixer_t5 import checkpoints, hf
  ckpt = Path(args.checkpoint)
  model = _macro("MODEL")
  if model is None:
    gin_file = ckpt / "model.gin" if (ckpt / "model.gin").exists() else ckpt / "config.gin"
    if not gin_file.exists():
      raise GinError(f"no model config: pass --gin_file=... or export a directory holding model.gin "
                     f"(import-hf output) or config.gin (a train MODEL_DIR); looked for {gin_file}")
    parse_gin([str(gin_file)], ["MODEL_DIR=None"] if gin_file.name == "config.gin" else [])
    model = _macro("MODEL")
  params = checkpoints.restore_any_params(ckpt)
  hf.write_hf_checkpoint(args.out_dir, model.module.config, params)
  print(f"wrote Hugging Face T5 v1.1 checkpoint to {args.out_dir}")
  return 0


def model_gin(cfg, source: str = "") -> str:
  """A standalone model gin file for a T5Config (written by import-hf)."""
  lines = [f"# T5.1.1 model imported from {source}" if source else "# T5.1.1 model",
           "from __gin__ import dynamic_registration", "from remixer_t5 import models",
           "from remixer_t5 import network", "",
           "MODEL = @models.EncoderDecoderModel()",
           "models.EncoderDecoderModel.module = @network.Transformer()",
           "network.Transformer.config = @network.T5Config()"]
  import dataclasses
  for f in dataclasses.fields(cfg):
    lines.append(f"network.T5Config.{f.name} = {getattr(cfg, f.name)!r}")
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="remixer-t5", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  sub.add_parser("train", help="train (resumes from MODEL_DIR)")
  sub.add_parser("eval", help="evaluate the latest checkpoint in MODEL_DIR on the validation split")
  i = sub.add_parser("info", help="parameter count, per-module breakdown, FLOPs per token")
  i.add_argument("--json", action="store_true", help="end with one JSON line")
  i.add_argument("--show-sharding", action="store_true", help="each parameter's shape and partition spec")
  imp = sub.add_parser("import-hf", help="Hugging Face T5 v1.1 dir -> orbax checkpoint + model.gin")
  imp.add_argument("hf_dir")
  imp.add_argument("out_dir")
  exp = sub.add_parser("export-hf", help="checkpoint (import-hf output or MODEL_DIR) -> Hugging Face dir")
  exp.add_argument("checkpoint")
  exp.add_argument("out_dir")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    files, bindings, paths, rest = split_flags(argv)
    args = build_parser().parse_args(rest)
    if files or bindings:
      parse_gin(files, bindings, paths)
    elif args.command in ("train", "eval", "info"):
      raise GinError(f"`{args.command}` needs a config: --gin_file=... (see gin/ for models and runs)")
    handler = {"train": cmd_train, "eval": cmd_eval, "info": cmd_info, "import-hf": cmd_import_hf,
               "export-hf": cmd_export_hf}[args.command]
    return handler(args)
  except (GinError, FileNotFoundError, FileExistsError, IncompatibleModelDirError) as e:
    print(f"remixer-t5: error: {e}", file=sys.stderr)
    return 2
  except ValueError as e:  # bad values reach us from deep inside (configs, data rows, sizes)
    if os.environ.get("REMIXER_T5_TRACEBACK"):
      raise
    print(f"remixer-t5: error: {e}\n(set REMIXER_T5_TRACEBACK=1 for the full traceback)", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
