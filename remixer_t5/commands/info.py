"""`remixer-t5 info`: a model's parameter count, per-module breakdown and FLOPs per token, and optionally its
sharding on a mesh, from shapes alone (remixer_t5/info.py)."""

from __future__ import annotations

import argparse
import json

from remixer_t5 import info
from remixer_t5.commands import common
from remixer_t5.gin_utils import macro


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--json", action="store_true", help="end with one JSON line")
  p.add_argument(
    "--show-sharding",
    action="store_true",
    help="each parameter's shape, logical axes, partition spec and per-device shard, and bytes per device",
  )
  p.add_argument(
    "--mesh",
    help="for --show-sharding: a preset (cpu, tpu_v3_8, tpu_v3_32, tpu_v3_128, gpu_8) or "
    "DATAxMODEL, e.g. 4x2; no devices needed (default: the host's devices, data-parallel)",
  )
  p.add_argument("--rules", choices=["data", "data_model", "fsdp"], help="logical axis rules for --show-sharding")
  p.add_argument("--lengths", help="INPUTS,TARGETS lengths for FLOPs (default: TASK_FEATURE_LENGTHS or 512,114)")


def main(args: argparse.Namespace) -> int:
  common.load_gin(args, required=True)
  model = common.model()
  lengths = common.parse_lengths(args.lengths) or macro("TASK_FEATURE_LENGTHS") or {"inputs": 512, "targets": 114}
  report = info.model_info(model, lengths)
  print(info.format_report(report))
  if args.show_sharding:
    print(info.format_sharding(model, lengths, mesh=args.mesh, rules=args.rules))
  if args.json:
    print(json.dumps(report))
  return 0
