"""`remixer-t5 infer`: predictions of a checkpoint for a task's split or a file of inputs, as JSONL
(training/inference.py)."""

from __future__ import annotations

import argparse
import json

from remixer_t5 import storage
from remixer_t5.commands import common
from remixer_t5.model import decoding
from remixer_t5.training import best, inference


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--inputs",
    help="a file of inputs: one text a line, or JSONL rows with an 'inputs' field (default: the run's task, --split)",
  )
  p.add_argument("--output", help="the JSONL to write (default: MODEL_DIR/infer/<inputs stem or task-split>.jsonl)")
  p.add_argument("--split", default="validation", help="the task's split, labelled or not (default validation)")
  p.add_argument(
    "--checkpoint",
    help="where the parameters come from: a path, or best|latest|STEP of MODEL_DIR (default: MODEL_DIR's latest)",
  )
  p.add_argument("--beam_size", "--beam-size", type=int, default=1, help="beams (default 1: greedy)")
  p.add_argument("--temperature", type=float, help="sample at this temperature (0: greedy)")
  p.add_argument("--top_k", "--top-k", type=int, help="sample from the k most likely tokens")
  p.add_argument("--top_p", "--top-p", type=float, help="sample from the nucleus of probability p")
  p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
  p.add_argument("--max_examples", "--max-examples", type=int, help="predict only the first N inputs")
  common.add_run_arguments(p)


def main(args: argparse.Namespace) -> int:
  run = common.start_run(args, run=False)
  if args.checkpoint in ("best", "latest") or str(args.checkpoint).isdigit():  # a step of MODEL_DIR
    args.checkpoint = str(best.checkpoint_dir(run.model_dir, args.checkpoint))
  common.check_checkpoint_source(args.checkpoint or run.model_dir, "--checkpoint" if args.checkpoint else "MODEL_DIR")
  if args.inputs and not storage.run_path(args.inputs).is_file():
    raise FileNotFoundError(f"--inputs {args.inputs}: no such file")
  common.start_line("infer")
  sampling = None
  if args.temperature is not None or args.top_k or args.top_p is not None:
    sampling = decoding.Sampling(
      temperature=1.0 if args.temperature is None else args.temperature,
      top_k=args.top_k or 0,
      top_p=1.0 if args.top_p is None else args.top_p,
      seed=args.seed,
    )
  request = inference.Request(
    inputs=args.inputs,
    output=args.output,
    split=args.split,
    checkpoint=args.checkpoint,
    beam_size=args.beam_size,
    sampling=sampling,
    max_examples=args.max_examples,
  )
  print(json.dumps(inference.infer(run, request, progress=common.stderr)))
  return 0
