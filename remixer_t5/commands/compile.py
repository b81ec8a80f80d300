"""`remixer-t5 compile`: the run's train step (and optionally its eval and decode steps) compiled for a TPU slice
or GPUs on this host, no accelerator needed (remixer_t5/aot_compile.py)."""

from __future__ import annotations

import argparse
import sys

from remixer_t5 import aot_compile
from remixer_t5.commands import common


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--topology",
    required=True,
    help="a Cloud TPU slice: v3-8, v3-32, v3-128, ..., v2-8.., "
    "v4-8.., v5p-8.., v5e-1.., v6e-1.. (v2/v3/v4/v5p count cores, v5e/v6e chips); or one "
    "process's GPUs: h100, h100x8, h200, a100x8, ... (needs `make gpu-compile-env`)",
  )
  p.add_argument("--num_slices", "--num-slices", type=int, default=1, help="slices joined over the data axis")
  p.add_argument("--mesh", help="override the run's mesh: a preset (tpu_v3_32, ...) or DATAxMODEL")
  p.add_argument("--rules", choices=["data", "data_model", "fsdp"], help="override the run's rule set")
  p.add_argument("--all_steps", "--all-steps", action="store_true", help="also compile the eval and decode steps")
  p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def main(args: argparse.Namespace) -> int:
  common.load_gin(args, required=True)
  steps = ["train"] + (["eval", "decode"] if args.all_steps else [])
  try:
    return aot_compile.main(
      args.topology, num_slices=args.num_slices, mesh=args.mesh, rules=args.rules, steps=steps, as_json=args.json
    )
  except aot_compile.CompilerMissing as e:
    print(f"remixer-t5 compile: {e}", file=sys.stderr)
    return 2
