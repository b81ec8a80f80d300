"""`remixer-t5 bench kernels`: each platform kernel against plain JAX on the work it exists for, in one process.

A kernel (remixer_t5/kernels/) stays only if it makes one of these workloads at least 1.2x faster: the trainer's
whole jitted step (`bench_train.ours`: programs.build) of each COGS model (`models/<model>/cogs.gin` +
`runs/cogs_scratch.gin`: batch 4, 64/320, dropout 0.1) and of T5.1.1 configs A (d 256, 4+4 layers, batch 16,
128/32) and B (T5.1.1-small, batch 8, 512/114), dropout 0, on random unpacked tokens; `cogs:hypermixer:packed` is
HyperMixer's COGS step on packed rows (7 examples a row, as COGS packs: HyperMixing's packed and segmented causal
forms). Every variant is compiled in
this process from the same seed; rounds alternate the variants (a machine's speed drifts between minutes), each
the median of `steps` timed steps after `warmup`. Variants: `default` (every implementation field at `auto`),
`xla` (every field of the registry, kernels.OPERATIONS, that the workload exercises at `xla`) and `<field>=xla`
(that one alone) where it exercises more than one. The last losses agree: the kernels compute the same function.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable

import numpy as np

from remixer_t5 import gin_utils, kernels
from remixer_t5.bench import env as bench_env, train as bench_train
from remixer_t5.commands import common

COGS_MODELS = ("t5_1_1", "remixer", "mixer_encdec", "hypermixer")
SMALL = ["models/t5_1_1/small.gin"]
WORKLOADS = {  # name -> (gin files, bindings, batch size, feature lengths; None: the run file's)
  **{f"cogs:{m}": ([f"models/{m}/cogs.gin", "runs/cogs_scratch.gin"], [], None, None) for m in COGS_MODELS},
  "A": (
    SMALL,
    [
      "DROPOUT_RATE=0.0",
      "network.T5Config.emb_dim=256",
      "network.T5Config.num_encoder_layers=4",
      "network.T5Config.num_decoder_layers=4",
      "network.T5Config.mlp_dim=1024",
      "network.T5Config.num_heads=4",
      "network.T5Config.head_dim=64",
    ],
    16,
    {"inputs": 128, "targets": 32},
  ),
  "B": (SMALL, ["DROPOUT_RATE=0.0"], 8, {"inputs": 512, "targets": 114}),
}
WORKLOADS["cogs:hypermixer:packed"] = WORKLOADS["cogs:hypermixer"]
PACKED = {"cogs:hypermixer:packed": 7}  # workload -> examples a row


def pack(batch: dict, examples: int) -> dict:
  """`batch` as packed rows: `examples` contiguous segments of near-equal length a row (ids 1..examples), the
  positions counted within each, as seqio's packing gives."""
  out = dict(batch)
  for feature, tokens in (("encoder", "encoder_input_tokens"), ("decoder", "decoder_target_tokens")):
    rows, length = batch[tokens].shape
    cuts = np.linspace(0, length, examples + 1).astype(int)
    seg = np.repeat(np.arange(1, examples + 1), np.diff(cuts)).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in np.diff(cuts)]).astype(np.int32)
    out[f"{feature}_segment_ids"], out[f"{feature}_positions"] = np.tile(seg, (rows, 1)), np.tile(pos, (rows, 1))
  starts = out["decoder_positions"] == 0  # each segment's decoder input starts from 0
  out["decoder_input_tokens"] = np.where(starts, 0, np.roll(batch["decoder_target_tokens"], 1, axis=1))
  return out


def fields() -> dict[str, str]:
  """The registry's implementation fields by short name: attention, dropout, hypermixing."""
  short = lambda f: f.split(".")[-2].lower() if f.endswith(".impl") else f.rsplit(".", 1)[1].removesuffix("_impl")
  return {short(op.field): op.field for op in kernels.OPERATIONS}


def variants(name: str) -> dict[str, list[str]]:
  """Variant -> extra gin bindings: `default`, `xla` and each exercised field alone at `xla` (HyperMixer has no
  attention and the others no HyperMixing; configs A and B no dropout)."""
  files, bindings, _, _ = WORKLOADS[name]
  hyper = any("hypermixer" in f for f in files)
  exercised = {"attention": not hyper, "hypermixing": hyper, "dropout": "DROPOUT_RATE=0.0" not in bindings}
  used = {k: f for k, f in fields().items() if exercised[k]}
  out = {"default": [], "xla": [f"{f}='xla'" for f in used.values()]}
  if len(used) > 1:
    out.update({f"{k}=xla": [f"{f}='xla'"] for k, f in used.items()})
  return out


def step(name: str, extra: list[str]) -> tuple[Callable[[], object], dict]:
  """(a call running one of the trainer's jitted steps of workload `name` with bindings `extra`, its loss sum
  waited for; the model's settings), the config parsed afresh (gin binds the mixers when the step is traced)."""
  files, bindings, batch_size, lengths = WORKLOADS[name]
  gin_utils.parse_gin(files, bindings + extra, macro_defaults={"MODEL_DIR": "None"})
  setup = bench_train.from_gin(batch_size, lengths)
  return bench_train.ours(setup["model"], setup["tx"], batch(name, setup)), setup


def batch(name: str, setup: dict) -> dict:
  """Workload `name`'s batch of random tokens for `setup` (bench_train.from_gin), packed where `name` is packed."""
  out = bench_train.random_batch(setup["model"].module.config.vocab_size, setup["batch_size"], setup["feature_lengths"])
  return pack(out, PACKED[name]) if name in PACKED else out


def run(names: list[str], rounds: int, steps: int, warmup: int, log: Callable[[str], None]) -> list[dict]:
  """One row per (workload, variant, round): its median step, steps timed, last loss sum; a summary line per
  workload (each variant's median over rounds and its ratio to `default`) to `log`."""
  unknown = [n for n in names if n not in WORKLOADS]
  if unknown or rounds < 1 or steps < 1 or warmup < 0:
    raise ValueError(
      f"bench kernels: workloads {unknown or names} rounds {rounds} steps {steps} warmup {warmup}: "
      f"expected some of {', '.join(WORKLOADS)}, rounds and steps >= 1, warmup >= 0"
    )
  env, rows = bench_env.environment(), []
  for name in names:
    calls = {variant: step(name, extra)[0] for variant, extra in variants(name).items()}
    n = max(1, steps // 3) if name == "B" else steps
    medians: dict[str, list[float]] = {v: [] for v in calls}
    for r in range(rounds):
      for variant, call in calls.items():
        times, loss = bench_train.time_calls(call, n, warmup)
        medians[variant].append(statistics.median(times))
        rows.append(
          {
            "workload": name,
            "variant": variant,
            "round": r,
            "s_per_step": medians[variant][-1],
            "steps": n,
            "last_loss_sum": float(loss),
            "load_average": list(os.getloadavg()),
            **env,
          }
        )
    base = statistics.median(medians["default"])
    log(
      f"# {name}: "
      + "; ".join(
        f"{v} {statistics.median(m) * 1e3:.1f} ms ({statistics.median(m) / base:.3f}x)" for v, m in medians.items()
      )
    )
  return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--workloads",
    default="cogs:t5_1_1,cogs:remixer,cogs:mixer_encdec,cogs:hypermixer,A,B",
    help="comma-separated, of cogs:<model>, cogs:hypermixer:packed and the T5.1.1 configs A and B",
  )
  p.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10; B a third of them)")
  p.add_argument("--rounds", type=int, default=3, help="rounds, the variants alternating (default 3)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
  p.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")


def main(args: argparse.Namespace) -> int:
  rows = run(args.workloads.split(","), rounds=args.rounds, steps=args.steps, warmup=args.warmup, log=common.stderr)
  for row in rows:
    print(
      json.dumps(row)
      if args.json
      else f"{row['workload']} {row['variant']} round {row['round']}: {row['s_per_step'] * 1e3:.1f} ms/step",
      flush=True,
    )
  return 0
