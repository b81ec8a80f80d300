"""`remixer-t5 bench input`: the training input pipeline's throughput per process, the cost of restoring a
position, and whether one host can feed a TPU slice at a given step rate.

Everything goes through the trainer's own input function (input_pipeline.get_batches: preprocessing, packing,
this process's share of the global batch, prefetch) with the run's gin values (`from_gin`).

Measured, for process `process_index` of `process_count` (default 0 of `hosts`: one host's share):
  * first_batch_s: pipeline built and the first batch ready (file listing, vocabulary, tf.data warm-up);
  * rows_per_s: model rows (packed sequences) per second over `batches` batches after `warmup`; examples_per_s
    counts the task examples packed into them (segments); tokens_per_s the non-padding tokens (inputs +
    targets), padded_tokens_per_s all positions;
  * with `position` N > 0: reach_s (consuming N batches once: what a `skip`-based resume replays), save_s and
    state_bytes (the tf.data iterator checkpoint at N), restore_s (a fresh pipeline restored to N with its
    first batch ready: what a resume costs; independent of N).
Feeding a slice: a host must deliver steps_per_s * BATCH_SIZE / hosts rows per second (T5.1.1-base on a
v3-32, Remixer paper Table 1: 9 steps/s, batch 128, 16 chips = 4 hosts: 288 rows/s per host); keeps_up
compares the measured rows/s with it. The numbers depend on the host's free cores (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any, Callable, Mapping

import numpy as np

from remixer_t5.bench import env as bench_env
from remixer_t5.commands import common
from remixer_t5.data import input_pipeline
from remixer_t5.training import run_config, trainer

# Remixer paper (Tay et al.), Table 1: T5.1.1-base trains at 9 steps/s; §4.1: batch 128, 16 TPU-v3 chips
# (a v3-32 slice: 4 hosts of 4 chips).
PAPER_STEPS_PER_S = 9.0
PAPER_HOSTS = 4


def _segments(batch: Mapping[str, np.ndarray]) -> int:
  """Task examples in a batch: packed rows count each segment, unpacked rows with any target count one."""
  if "decoder_segment_ids" in batch:
    seg = batch["decoder_segment_ids"]
    return int(sum(len(np.unique(row[row > 0])) for row in seg))
  return int((batch["decoder_target_tokens"] > 0).any(axis=1).sum())


def bench_input(
  task,
  data,
  *,
  seed: int = 0,
  batches: int = 50,
  warmup: int = 5,
  position: int = 0,
  process_index: int = 0,
  process_count: int = PAPER_HOSTS,
  steps_per_s: float = PAPER_STEPS_PER_S,
  hosts: int | None = None,
  log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """One measurement of `task`'s batches as the run's `data` (run_config.Data: lengths, global batch, packing,
  shuffling) makes them (see the module docstring); returns a flat dict of numbers and settings."""
  log = log or (lambda msg: None)
  hosts = process_count if hosts is None else hosts
  feature_lengths, batch_size, pack, shuffle = data.feature_lengths, data.batch_size, data.pack, data.shuffle

  def build(skip=0):
    return input_pipeline.get_batches(
      task,
      feature_lengths,
      "train",
      batch_size,
      seed=seed,
      shuffle=shuffle,
      repeat=True,
      pack=pack,
      skip_batches=skip,
      process_index=process_index,
      process_count=process_count,
    )

  t0 = time.perf_counter()
  it = build()
  first = next(it)
  first_batch_s = time.perf_counter() - t0
  rows_per_batch = int(first["decoder_target_tokens"].shape[0])
  for _ in range(warmup):
    next(it)
  log(f"timing {batches} batches of {rows_per_batch} rows (process {process_index} of {process_count})")
  rows = examples = tokens = padded = 0
  t0 = time.perf_counter()
  for _ in range(batches):
    b = next(it)
    rows += b["decoder_target_tokens"].shape[0]
    examples += _segments(b)
    tokens += int((b["encoder_input_tokens"] > 0).sum() + (b["decoder_target_tokens"] > 0).sum())
    padded += b["encoder_input_tokens"].size + b["decoder_target_tokens"].size
  dt = time.perf_counter() - t0
  need_rows = steps_per_s * batch_size / hosts
  out: dict[str, Any] = {
    "task": task.name,
    "feature_lengths": dict(feature_lengths),
    "batch_size": batch_size,
    "pack": pack,
    "shuffle": shuffle,
    "process_index": process_index,
    "process_count": process_count,
    "rows_per_batch": rows_per_batch,
    "batches": batches,
    "first_batch_s": first_batch_s,
    "seconds": dt,
    "batches_per_s": batches / dt,
    "rows_per_s": rows / dt,
    "examples_per_s": examples / dt,
    "tokens_per_s": tokens / dt,
    "padded_tokens_per_s": padded / dt,
    "steps_per_s_target": steps_per_s,
    "hosts": hosts,
    "rows_per_s_needed": need_rows,
    "tokens_per_s_needed": need_rows * tokens / max(rows, 1),
    "keeps_up": rows / dt >= need_rows,
    "headroom": (rows / dt) / need_rows,
    "cpu_count": os.cpu_count(),
    "load_avg_1m": (bench_env.loadavg() or [None])[0],
  }
  if position:
    log(f"reaching position {position} once (what a skip-based resume replays)")
    t0 = time.perf_counter()
    it = build()
    for _ in range(position):
      next(it)
    out["reach_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.perf_counter()
      prefix = it.save(os.path.join(tmp, "iterator"))
      out["save_s"] = time.perf_counter() - t0
      out["state_bytes"] = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
      want = next(it)
      t0 = time.perf_counter()
      fresh = build()
      fresh.restore(prefix, position)
      got = next(fresh)
      out["restore_s"] = time.perf_counter() - t0
    out["position"] = position
    out["restored_batch_matches"] = all(np.array_equal(want[k], got[k]) for k in want)
  return out


def format_report(r: Mapping[str, Any]) -> str:
  lines = [
    f"{r['task']}  lengths {r['feature_lengths']}  batch {r['batch_size']} (process {r['process_index']} of "
    f"{r['process_count']}: {r['rows_per_batch']} rows/batch)  pack={r['pack']}",
    f"  first batch {r['first_batch_s']:.2f}s; {r['batches']} batches in {r['seconds']:.2f}s: "
    f"{r['rows_per_s']:.1f} rows/s, {r['examples_per_s']:.1f} examples/s, {r['tokens_per_s']:,.0f} tokens/s "
    f"({r['padded_tokens_per_s']:,.0f} with padding)",
    f"  a host must feed {r['rows_per_s_needed']:.1f} rows/s ({r['tokens_per_s_needed']:,.0f} tokens/s) for "
    f"{r['steps_per_s_target']:g} steps/s x batch {r['batch_size']} over {r['hosts']} hosts: "
    f"{'keeps up' if r['keeps_up'] else 'DOES NOT keep up'} ({r['headroom']:.2f}x) on {r['cpu_count']} "
    f"cores (1-min load {r['load_avg_1m']})",
  ]
  if "position" in r:
    lines.append(
      f"  position {r['position']}: reaching it {r['reach_s']:.2f}s (a skip replay); iterator state "
      f"{r['state_bytes'] / 1e6:.2f} MB saved in {r['save_s']:.2f}s; restore + first batch "
      f"{r['restore_s']:.2f}s (batch matches: {r['restored_batch_matches']})"
    )
  return "\n".join(lines)


def from_gin() -> dict[str, Any]:
  """bench_input's task, data and seed from the parsed gin config: the run's (run_config.from_gin), as `train`
  reads them."""
  try:
    run = run_config.from_gin()
  except ValueError as e:
    raise ValueError(f"bench input reads the run's data: {e}") from None
  _, task, _, _ = trainer.task_and_vocabulary(run.data.task, run.data.vocabulary, run.data.data_dir, None)
  return {"task": task, "data": run.data, "seed": run.training.random_seed}


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--batches", type=int, default=50, help="batches timed (after --warmup)")
  p.add_argument("--warmup", type=int, default=5, help="untimed batches first (default 5)")
  p.add_argument(
    "--position",
    type=int,
    default=0,
    help="also reach batch N once, save the iterator state and time a fresh restore to N",
  )
  p.add_argument("--hosts", type=int, default=PAPER_HOSTS, help="hosts sharing the batch (default 4: a v3-32)")
  p.add_argument(
    "--steps_per_s",
    "--steps-per-s",
    type=float,
    default=PAPER_STEPS_PER_S,
    help="the step rate to feed (default 9: T5.1.1-base, Remixer paper Table 1)",
  )
  p.add_argument("--process_index", "--process-index", type=int, default=0, help="which shard to read")
  p.add_argument("--process_count", "--process-count", type=int, help="shards (default: --hosts)")
  p.add_argument("--json", action="store_true", help="the report as one JSON object on stdout")


def main(args: argparse.Namespace) -> int:
  common.load_gin(args, required=True)
  report = bench_input(
    **from_gin(),
    batches=args.batches,
    warmup=args.warmup,
    position=args.position,
    process_index=args.process_index,
    process_count=args.process_count or args.hosts,
    hosts=args.hosts,
    steps_per_s=args.steps_per_s,
    log=lambda m: common.stderr(f"bench input: {m}"),
  )
  print(json.dumps(report) if args.json else format_report(report), flush=True)
  return 0
