"""`remixer-t5 compare`: several runs side by side (compare.png, .md, .csv; remixer_t5/compare.py), and with
--group_by_seed their statistics over seeds (remixer_t5/study.py)."""

from __future__ import annotations

import argparse
import sys

from remixer_t5 import compare, study


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="train MODEL_DIRs (each with metrics.jsonl)")
  p.add_argument("--out", default=".", help="directory for compare.png, compare.md, compare.csv (default: current)")
  p.add_argument("--names", help="comma-separated run names, one per MODEL_DIR (default: the directories' names)")
  p.add_argument(
    "--group_by_seed",
    "--group-by-seed",
    action="store_true",
    help="also group runs whose config.gin differ only in the seed: per group the mean, standard "
    "deviation and t interval of each metric, Welch's t-test between the best two "
    "(sweep.csv, sweep.md, sweep.png under --out)",
  )


def main(args: argparse.Namespace) -> int:
  names = [n.strip() for n in args.names.split(",")] if args.names else None
  runs, written = compare.compare(args.model_dirs, args.out, names, group_by_seed=args.group_by_seed)
  print(compare.markdown_table(runs), end="")
  paths = list(written.values())
  if args.group_by_seed:
    summary, written_study = study.report(
      compare.seed_points(runs), ["group"], args.out, title="runs grouped over seeds"
    )
    print("\n" + study.markdown_table(summary, "runs grouped over seeds"), end="")
    paths += written_study
  for path in paths:
    print(f"wrote {path}", file=sys.stderr)
  return 0
