"""`remixer-t5 tasks`: the registered tasks and mixtures, or one's preprocessed examples (data/inspect.py)."""
from __future__ import annotations

import argparse

from remixer_t5.commands import common
from remixer_t5.data import inspect
from remixer_t5.tasks import sources


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("name", nargs="?", help="a task or mixture: show its first examples as text and token ids")
  p.add_argument("--split", default="train")
  p.add_argument("--num", "-n", type=int, default=3, help="examples to show (default 3)")
  p.add_argument("--lengths", help="INPUTS,TARGETS truncation lengths (default: none)")
  p.add_argument("--data_dir", "--data-dir", help="local dataset files (default: $REMIXER_T5_DATA_DIR)")


def main(args: argparse.Namespace) -> int:
  common.load_gin(args)  # a gin file may register tasks of its own
  if args.data_dir:
    sources.set_data_dir(args.data_dir)
  print(inspect.show(args.name, split=args.split, num=args.num, feature_lengths=common.parse_lengths(args.lengths))
        if args.name else inspect.list_tasks())
  return 0
