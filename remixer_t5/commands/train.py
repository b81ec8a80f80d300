"""`remixer-t5 train`: trains the run the gin flags configure, resuming from its MODEL_DIR (training/trainer.py)."""

from __future__ import annotations

import argparse

import gin

from remixer_t5.commands import common
from remixer_t5.training import trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--profile_steps",
    "--profile-steps",
    metavar="FIRST:LAST",
    help="a profiler trace of these train steps under MODEL_DIR/profile/ (run_config.Schedule."
    "profile_steps; a running train also reads MODEL_DIR/PROFILE at its log steps)",
  )
  common.add_run_arguments(p)


def main(args: argparse.Namespace) -> int:
  profile = (f"run_config.Schedule.profile_steps={args.profile_steps!r}",) if args.profile_steps else ()
  run = common.start_run(args, run=True, bindings=profile)
  common.start_line("train")
  trainer.train(run, config_text=gin.config_str())
  return 0
