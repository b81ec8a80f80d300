"""`remixer-t5 <command>`: the command line. Each command is a module with its own flags and `main`
(remixer_t5/commands/, and bench/ and repro/ for those groups' subcommands); this module only dispatches to the
one given, imported then, and turns what ends it into an exit code and one line (commands/errors.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Sequence

from remixer_t5 import quiet

quiet.configure()  # before anything imports JAX or TensorFlow: their native start-up lines hidden (quiet.py)
from remixer_t5 import runtime  # noqa: E402 - imports nothing heavy

try:  # $REMIXER_T5_CPUS: before any thread pool starts (numpy's, XLA's, TensorFlow's)
  _PINNED, _PIN_ERROR = runtime.pin_from_env(), None
except ValueError as _e:  # reported by main() like any bad input
  _PINNED, _PIN_ERROR = None, _e

from remixer_t5 import storage  # noqa: E402 - after quiet.configure()
from remixer_t5.commands import COMMANDS, GIN_FLAGS, GROUPS, Command, errors  # noqa: E402
from remixer_t5.gin_utils import split_flags  # noqa: E402


DESCRIPTION = (
  "seq2seq models that mix tokens (T5.1.1, MLP-Mixer, Remixer, HyperMixer, ...): `remixer-t5 COMMAND "
  "--help` lists a command's flags.\n\n" + GIN_FLAGS
)


class _Parser(argparse.ArgumentParser):
  """argparse's parser whose usage errors are one line, as every other error of the CLI (exit 2, its code)."""

  def __init__(self, **kwargs):
    super().__init__(allow_abbrev=False, **kwargs)  # a flag is named whole: none slips past as another's prefix

  def error(self, message: str):
    self.exit(2, f"remixer-t5: error: {message} (`{self.prog} --help` lists the options)\n")


def _menu(prog: str, table: dict, description: str, words: Sequence[str]) -> _Parser:
  """The parser of a level of the table: its commands with their help lines, none imported."""
  p = _Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", metavar="{" + ",".join(table) + "}", required=True)
  for name, entry in table.items():
    sub.add_parser(name, help=GROUPS[name] if isinstance(entry, dict) else entry.help, add_help=False)
  p.parse_args(words)  # --help, a missing or unknown command: argparse's usage and exit
  return p


def parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, Command, list[str]]:
  """(the parser of the command `argv` names, that command, the rest of `argv`) for a command line without its
  gin flags; only that command's module is imported."""
  words, prog, table, description = list(argv), "remixer-t5", COMMANDS, DESCRIPTION
  while isinstance(table, dict):
    if not words or words[0] not in table:
      _menu(prog, table, description, words[:1])
    name, words = words[0], words[1:]
    prog, table, description = f"{prog} {name}", table[name], GROUPS.get(name, "")
  command = table
  p = _Parser(
    prog=prog,
    description=command.help,
    epilog=GIN_FLAGS if command.gin else None,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  importlib.import_module(command.module).add_arguments(p)
  return p, command, words


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Command]:
  """A whole command line as `main` reads it: (its arguments, with `command`, `argv` and the gin flags as `gin`,
  the command). A usage error is argparse's: one line and SystemExit(2)."""
  files, bindings, paths, rest = split_flags(argv)
  p, command, words = parser(rest)
  args = p.parse_args(words)
  if (files or bindings or paths) and not command.gin:
    p.error(f"{p.prog} takes no gin flags (--gin_file, --gin.NAME=VALUE, --gin_search_paths)")
  args.command, args.argv, args.gin = p.prog.split(" ", 1)[1], list(argv), (files, bindings, paths)
  return args, command


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args, command = parse(argv)
    if _PIN_ERROR is not None:
      raise _PIN_ERROR
    if _PINNED:
      print(f"cores: this process runs on {','.join(map(str, _PINNED))} (${runtime.CPUS_ENV})", file=sys.stderr)
    runtime.pin_cpu_without_tpu_chips()  # libtpu without TPU chips (the .[tpu] extra): no TPU runtime start
    if command.runs:  # before JAX starts its threads: see runtime's docstring
      runtime.configure(log=lambda m: print(m, file=sys.stderr, flush=True), verbose=getattr(args, "verbose", False))
    return importlib.import_module(command.module).main(args)
  except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - mapped below; anything else keeps its traceback
    code = errors.exit_code(e)
    if code is None:  # not a cause the user can act on: a bug, shown whole
      raise
    if errors.traceback_wanted():
      traceback.print_exception(e)
    print(f"remixer-t5: error: {errors.error_line(e)}", file=sys.stderr, flush=True)
    return code


def console_main() -> int:
  """The `remixer-t5` command: `main`, then the process's exit. After a wait on storage was given up (its
  client's threads still blocked: storage.bounded) the interpreter would wait for them at exit, so the process
  ends at once with the code instead."""
  code = main()
  if storage.ABANDONED:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


if __name__ == "__main__":
  sys.exit(console_main())
