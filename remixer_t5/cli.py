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
from typing import NamedTuple, Sequence

from remixer_t5 import quiet

quiet.configure()  # before anything imports JAX or TensorFlow: their native start-up lines hidden (quiet.py)
from remixer_t5 import runtime  # noqa: E402 - imports nothing heavy

try:  # $REMIXER_T5_CPUS: before any thread pool starts (numpy's, XLA's, TensorFlow's)
  _PINNED, _PIN_ERROR = runtime.pin_from_env(), None
except ValueError as _e:  # reported by main() like any bad input
  _PINNED, _PIN_ERROR = None, _e

from remixer_t5 import storage  # noqa: E402 - after quiet.configure()
from remixer_t5.commands import errors  # noqa: E402
from remixer_t5.commands.common import GIN_FLAGS  # noqa: E402
from remixer_t5.gin_utils import split_flags  # noqa: E402


class Command(NamedTuple):
  module: str  # with add_arguments(parser) and main(args)
  help: str
  gin: bool = True  # takes the gin flags
  runs: bool = False  # runs steps on this host: its allocator is configured first (runtime.configure)


def _bench(kind: str, help: str, gin: bool = False) -> Command:
  return Command(f"remixer_t5.bench.{kind}", help, gin, runs=True)


def _repro(name: str, help: str) -> Command:
  return Command(f"remixer_t5.repro.{name}", help, gin=False, runs=True)


COMMANDS = {
    "train": Command("remixer_t5.commands.train", "train (resumes from MODEL_DIR)", runs=True),
    "eval": Command("remixer_t5.commands.eval", "evaluate the latest checkpoint in MODEL_DIR (a training run, an "
                    "import-hf output or a t5x checkpoint): validation loss, and the task's metrics on decoded "
                    "outputs (seqio Evaluator; JSON + TensorBoard in MODEL_DIR/inference_eval)", runs=True),
    "infer": Command("remixer_t5.commands.infer", "predictions of a checkpoint (MODEL_DIR or --checkpoint: a training "
                     "run, an import-hf output or a t5x checkpoint) for a task's split or a file of inputs, as JSONL",
                     runs=True),
    "compare": Command("remixer_t5.commands.compare", "several runs side by side: loss against step and tokens seen, "
                       "best validation loss, parameters, tokens/s, task metrics (compare.png, .md, .csv under "
                       "--out)", gin=False),
    "compile": Command("remixer_t5.commands.compile", "compile the train step (same gin flags as train) for a TPU "
                       "slice or GPUs on this host, no TPU or GPU needed: memory per device against HBM, FLOPs, "
                       "estimated step time"),
    "sweep": Command("remixer_t5.sweep", "train every point of a grid of gin settings at each seed (a folder per "
                     "point, resumable), then tabulate the metrics over seeds: mean, std, t interval at 95 per cent, Welch's "
                     "t-test (sweep.csv, sweep.md, sweep.png)"),
    "tasks": Command("remixer_t5.commands.tasks", "list registered tasks and mixtures, or show NAME's preprocessed "
                     "examples"),
    "info": Command("remixer_t5.commands.info", "parameter count, per-module breakdown, FLOPs per token"),
    "import-hf": Command("remixer_t5.commands.import_hf", "Hugging Face T5 v1.1 dir -> orbax checkpoint + model.gin",
                         gin=False),
    "export-hf": Command("remixer_t5.commands.export_hf", "checkpoint (import-hf output or MODEL_DIR) -> Hugging Face "
                         "dir"),
    "plot": Command("remixer_t5.commands.plot", "PNG maps of softmax(H), self-attention and HyperMixing "
                    "pseudo-attention", runs=True),
    "bench": {
        "mixing": _bench("mixing", "fwd+bwd time and FLOPs of one token-mixing layer against length"),
        "input": _bench("input", "the training input pipeline (same gin flags as train) per process, its restore "
                        "time, and whether a host keeps up", gin=True),
        "train": _bench("train", "the jitted train step on random tokens (same gin flags as train), optionally "
                        "beside HF transformers' PyTorch T5 or another commit", gin=True),
        "decode": _bench("decode", "greedy and beam-search decoding of random inputs through the evaluator's "
                         "decode, every position (same gin flags as train), optionally beside HF's generate",
                         gin=True),
        "kernels": _bench("kernels", "each kernel against plain JAX in the train steps it exists for (the 1.2x "
                          "rule)"),
        "drift": _bench("drift", "one workload's steps with a field at auto and at xla, from the same state: "
                        "rounding or a fault (docs/benchmarks.md)"),
    },
    "repro": {
        "hypermixer-synthetic": _repro("hypermixer_synthetic", "HyperMixer §4.7, Fig. 5: test MSE against "
                                       "training-set size and pseudo-attention maps"),
        "cogs": _repro("cogs", "Remixer paper §3.4: each model trained from scratch on COGS, exact match on dev, "
                       "test and every gen category"),
        "cogs-curve": _repro("cogs_curve", "one COGS run with a checkpoint every --every steps, each decoded: exact "
                             "match against steps"),
    },
}
DESCRIPTION = ("seq2seq models that mix tokens (T5.1.1, MLP-Mixer, Remixer, HyperMixer, ...): `remixer-t5 COMMAND "
               "--help` lists a command's flags.\n\n" + GIN_FLAGS)
GROUPS = {"bench": "measurements (JSON rows with --json; docs/benchmarks.md)",
          "repro": "reproduce a paper experiment on a CPU"}


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
  p = _Parser(prog=prog, description=command.help, epilog=GIN_FLAGS if command.gin else None,
              formatter_class=argparse.RawDescriptionHelpFormatter)
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
