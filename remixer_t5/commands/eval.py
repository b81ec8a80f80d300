"""`remixer-t5 eval`: a checkpoint of MODEL_DIR evaluated: validation loss, and the task's metrics on decoded
outputs (trainer.evaluate_checkpoint; its own options, e.g. infer_split, bound in gin)."""

from __future__ import annotations

import argparse
import json

import gin

from remixer_t5.commands import common
from remixer_t5.training import best, trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--checkpoint",
    metavar="best|latest|STEP",
    help="which step of MODEL_DIR (default latest; best: the KEEP_BEST_BY step)",
  )
  common.add_run_arguments(p)


def main(args: argparse.Namespace) -> int:
  run = common.start_run(args, run=True, first=("commands/eval.gin",))
  common.check_checkpoint_source(run.model_dir, "MODEL_DIR")
  step = {}
  if args.checkpoint not in (None, "latest"):  # 'best' or a step number
    step = {"checkpoint_step": int(best.checkpoint_dir(run.model_dir, args.checkpoint).name)}
  common.start_line("eval")
  try:
    evaluate = gin.get_configurable(trainer.evaluate_checkpoint)  # with the config's bindings of its options
  except ValueError:  # nothing binds it
    evaluate = trainer.evaluate_checkpoint
  print(json.dumps(evaluate(run, **step)))
  return 0
