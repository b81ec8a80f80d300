"""What several commands share: the gin flags (split off the command line by cli.py, kept on `args.gin`), the
run they configure, the options of the commands that run one (train, eval, infer) and checkpoint arguments."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gin
import jax

from remixer_t5 import storage
from remixer_t5.gin_utils import GinError, gin_dir, macro, parse_gin
from remixer_t5.training import distributed, run_config

CUSTOM_GIN = "runs/custom.gin"  # MIXTURE_OR_TASK_NAME = @custom.register(); tasks/custom.py


def stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def load_gin(
  args: argparse.Namespace,
  *,
  required: bool = False,
  run: bool = False,
  first: tuple[str, ...] = (),
  bindings: tuple[str, ...] = (),
) -> None:
  """Parses the command's gin flags (after the package's gin files `first`, plus `bindings`). `run`: a command
  that reads or writes MODEL_DIR (train, eval), whose run files leave it `%gin.REQUIRED`; the others take a run's
  gin files with MODEL_DIR unset. `required`: a command that needs a config. Without flags any config an earlier
  call left is cleared."""
  files, given, paths = args.gin
  if files or given or bindings:
    parse_gin(
      [*(str(gin_dir() / f) for f in first), *files],
      [*given, *bindings],
      paths,
      macro_defaults=None if run else {"MODEL_DIR": "None"},
    )
  elif required:
    raise GinError(f"`{args.command}` needs a config: --gin_file=... (see gin/ for models and runs)")
  else:  # export-hf/plot then read the checkpoint's own gin, never a config left by an earlier main() call
    gin.clear_config()


def add_run_arguments(p: argparse.ArgumentParser) -> None:
  """The options of the commands that run a model from a config (train, eval, infer)."""
  p.add_argument(
    "--train_file",
    "--train-file",
    action="append",
    metavar="PATH",
    help="your own data: a TSV or JSONL file (or glob; local or gs://; repeatable) as the train "
    "split of the run's task (gin/runs/custom.gin; docs/data.md, \"Your own data\")",
  )
  p.add_argument(
    "--validation_file",
    "--validation-file",
    action="append",
    metavar="PATH",
    help="the validation split of that task, as --train_file",
  )
  p.add_argument(
    "--objective",
    choices=("inputs_targets", "span_corruption"),
    help="with --train_file/--validation_file: inputs/targets rows (default) or span corruption of a text field",
  )
  p.add_argument(
    "--coordinator_address",
    "--coordinator-address",
    help="HOST:PORT of process 0 for a multi-process run (or $REMIXER_T5_COORDINATOR)",
  )
  p.add_argument("--num_processes", "--num-processes", type=int, help="(or $REMIXER_T5_NUM_PROCESSES)")
  p.add_argument("--process_id", "--process-id", type=int, help="(or $REMIXER_T5_PROCESS_ID)")
  p.add_argument(
    "--distributed",
    action="store_true",
    help="let JAX detect the cluster (TPU VM slice, SLURM, Open MPI); or $REMIXER_T5_DISTRIBUTED=auto",
  )
  p.add_argument(
    "--verbose",
    "-v",
    action="store_true",
    help="say how the process was set up (host allocator, ...) besides the one start line",
  )


def start_run(args: argparse.Namespace, *, run: bool, first: tuple[str, ...] = (), bindings: tuple[str, ...] = ()):
  """train/eval/infer: joins the other processes, parses the config (with --train_file's task), checks a local
  MODEL_DIR and returns the run it configures (run_config.from_gin)."""
  distributed.maybe_initialize(args.coordinator_address, args.num_processes, args.process_id, args.distributed)
  args.gin = custom_data(args)
  load_gin(args, required=True, run=run, first=first, bindings=bindings)
  model_dir = macro("MODEL_DIR")
  if isinstance(model_dir, (str, os.PathLike)) and model_dir and not storage.is_bucket(model_dir):
    path = Path(model_dir).expanduser()  # checked before anything is built or compiled
    if path.exists() and not path.is_dir():
      raise NotADirectoryError(f"MODEL_DIR {model_dir} is a file; expected a folder (a new one, or a run's)")
  return run_config.from_gin()


def custom_data(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
  """The gin flags with --train_file/--validation_file/--objective as gin: runs/custom.gin after the user's files,
  and bindings of custom.register (paths made absolute, so MODEL_DIR/config.gin reads the same files from
  anywhere)."""
  files, bindings, paths = args.gin
  train, validation = args.train_file, args.validation_file
  if not (train or validation):
    if args.objective:
      raise GinError("--objective applies to --train_file / --validation_file; pass them too")
    return files, bindings, paths
  if any(b.partition("=")[0].strip() == "MIXTURE_OR_TASK_NAME" for b in bindings):
    raise GinError(
      "--train_file/--validation_file set MIXTURE_OR_TASK_NAME (the task 'custom'); drop --gin.MIXTURE_OR_TASK_NAME"
    )
  if (
    args.command == "train"
    and train
    and not validation
    and not any(b.startswith("custom.register.validation") for b in bindings)
  ):
    raise GinError("train evaluates on a validation split: pass --validation_file too")
  absolute = lambda values: [p.as_posix() if storage.is_bucket(p) else str(p) for p in map(storage.run_path, values)]
  added = [
    f"custom.register.{split}={absolute(values)!r}"
    for split, values in (("train", train), ("validation", validation))
    if values
  ]
  if args.objective:
    added.append(f"custom.register.objective={args.objective!r}")
  return files + [str(gin_dir() / CUSTOM_GIN)], added + bindings, paths


def start_line(command: str) -> None:
  """One line at the start of a run: the devices, and the kernel choices the config makes (kernels/)."""
  devices = jax.devices()
  kinds = sorted({d.device_kind for d in devices})
  chosen = [
    line.strip()
    for line in gin.config_str().splitlines()
    if any(k in line for k in ("attention_impl", "dropout_impl", "HyperMixing.impl")) and "'auto'" not in line
  ]
  try:
    out = f"; output: {macro('MODEL_DIR')}"
  except Exception:  # noqa: BLE001 - a config without MODEL_DIR: nothing to name
    out = ""
  stderr(
    f"remixer-t5 {command}: {len(devices)} {devices[0].platform} device(s) ({', '.join(kinds)}) in "
    f"{jax.process_count()} process(es); kernels: {'; '.join(chosen) or 'auto (by platform)'}{out}"
  )


def check_checkpoint_source(path, what: str) -> None:
  """A local checkpoint source (eval's MODEL_DIR, infer's --checkpoint or MODEL_DIR) that does not exist or is an
  empty folder is reported here, before the model is built (a bucket's is checked where it is read)."""
  if not path or storage.is_bucket(path):
    return
  folder = Path(path).expanduser()
  if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
    raise FileNotFoundError(
      f"no checkpoint in {path} ({what} {'is empty' if folder.exists() else 'does not exist'}):"
      " expected a training run's MODEL_DIR (checkpoints/), an import-hf output, a t5x "
      "checkpoint or a params checkpoint"
    )


def parse_lengths(text: str | None) -> dict[str, int] | None:
  """--lengths INPUTS[,TARGETS] -> feature lengths (TARGETS defaults to INPUTS); None when not given."""
  if not text:
    return None
  inputs, _, targets = text.partition(",")
  try:
    lengths = {"inputs": int(inputs), "targets": int(targets or inputs)}
  except ValueError:
    lengths = None
  if lengths is None or min(lengths.values()) < 1:
    raise ValueError(f"--lengths {text}: expected INPUTS[,TARGETS], positive integers (e.g. 512,114)")
  return lengths


def checkpoint_arg(text: str):
  """A checkpoint argument (a local path or gs://) as the run-path type, its bucket checked before any work."""
  path = storage.run_path(text)
  storage.check_bucket(path, "checkpoint")
  return path


def model():
  """MODEL from the gin flags (GinError when they bind none: every model file does)."""
  found = macro("MODEL")
  if found is None:
    raise GinError("the gin files define no MODEL; pass a model config, e.g. --gin_file=models/t5_1_1/small.gin")
  return found


def model_for_checkpoint(ckpt):
  """MODEL from the gin flags, else from the checkpoint's model.gin (import-hf) or config.gin (MODEL_DIR)."""
  found = macro("MODEL")
  if found is None:
    gin_file = ckpt / "model.gin" if (ckpt / "model.gin").exists() else ckpt / "config.gin"
    if not gin_file.exists():
      raise GinError(
        f"no model config: pass --gin_file=... or a directory holding model.gin "
        f"(import-hf output) or config.gin (a train MODEL_DIR); looked for {gin_file}"
      )
    parse_gin([str(gin_file)], ["MODEL_DIR=None"] if gin_file.name == "config.gin" else [])
    found = macro("MODEL")
  return found


def add_step_argument(p: argparse.ArgumentParser) -> None:
  """export-hf's and plot's --checkpoint: the step of a training MODEL_DIR given as their positional argument."""
  p.add_argument(
    "--checkpoint",
    dest="step",
    metavar="best|latest|STEP",
    help="which step of a training MODEL_DIR (default latest; best: the KEEP_BEST_BY step)",
  )
