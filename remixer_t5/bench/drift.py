"""`remixer-t5 bench drift`: whether a kernel and plain JAX compute the same training, step by step.

Two train steps of one `bench kernels` workload (its model, batch and trainer programs), one with an
implementation field at its default (`auto`), one with it at `xla`, each compiled right after its config is
parsed (gin binds the mixers when the step is traced). Both run the same steps from the same state and batch;
each step gives both losses and
- `trajectory`: the largest relative difference of any parameter between the two runs so far;
- `one step`: the same after one step of each implementation from the *reference's* state.
A fault in the kernel shows in `one step` (it grows, or jumps at some step); rounding stays at float32's
1e-7-1e-5 there while `trajectory` may still grow, when training amplifies small differences.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import jax
import numpy as np

from remixer_t5 import gin_utils
from remixer_t5.bench import env as bench_env, kernels as bench_kernels, train as bench_train
from remixer_t5.commands import common
from remixer_t5.training import partitioning, programs


def rel_diff(a, b) -> float:
  """Largest over parameters of max |a - b| / max |b|."""
  out = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    out = max(out, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
  return out


def steps_both_ways(workload: str, field: str):
  """({'default', 'xla'}: host state, batch -> (host state, metrics)), the initial host state, the batch."""
  files, bindings, batch_size, lengths = bench_kernels.WORKLOADS[workload]
  part = partitioning.partitioner("1x1", jax.devices()[:1], rules="data")
  steps, host, data = {}, None, None
  for name, extra in (("default", []), ("xla", [f"{bench_kernels.fields()[field]}='xla'"])):
    gin_utils.parse_gin(files, bindings + extra, macro_defaults={"MODEL_DIR": "None"})
    setup = bench_train.from_gin(batch_size, lengths)  # the trainer's programs, each traced with its bindings
    prog = programs.build(setup["model"], setup["tx"], setup["feature_lengths"], part)
    if host is None:
      host = jax.device_get(prog.init_state(0))
      data = jax.device_put(bench_kernels.batch(workload, setup), prog.batch_sharding)
    compiled = prog.compile(prog.train_step, prog.state, data)
    # the step donates its state: each call gets its own copy of a host state, and its result comes back
    steps[name] = lambda st, d, c=compiled, sh=prog.shardings: jax.device_get(c(jax.device_put(st, sh), d))
  return steps, host, data


def run(workload: str, field: str, steps: int, log: Callable[[str], None]) -> list[dict]:
  """One row per step: both losses, the trajectories' and one step's largest relative parameter difference."""
  if field not in bench_kernels.fields() or workload not in bench_kernels.WORKLOADS or steps < 1:
    raise ValueError(
      f"bench drift: --field {field!r}, --workloads {workload!r}, --steps {steps}: expected one of "
      f"{sorted(bench_kernels.fields())}, one of {sorted(bench_kernels.WORKLOADS)}, steps >= 1"
    )
  step, host, data = steps_both_ways(workload, field)
  kernel = ref = host
  rows = []
  log(f"{'step':>4} {'loss (default)':>15} {'loss (xla)':>12} {'trajectory':>11} {'one step':>9}")
  for i in range(steps):
    from_ref, _ = step["default"](ref, data)
    kernel, m_kernel = step["default"](kernel, data)
    ref, m_ref = step["xla"](ref, data)
    rows.append(
      {
        "workload": workload,
        "field": field,
        "step": i + 1,
        "loss_sum_default": float(m_kernel["loss_sum"]),
        "loss_sum_xla": float(m_ref["loss_sum"]),
        "trajectory_rel_diff": rel_diff(kernel.params, ref.params),
        "one_step_rel_diff": rel_diff(from_ref.params, ref.params),
      }
    )
    r = rows[-1]
    log(
      f"{i + 1:>4} {r['loss_sum_default']:>15.4f} {r['loss_sum_xla']:>12.4f} {r['trajectory_rel_diff']:>11.2e} "
      f"{r['one_step_rel_diff']:>9.2e}"
    )
  return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--workloads", default="cogs:hypermixer", help="one of bench kernels' workloads (default cogs:hypermixer)"
  )
  p.add_argument(
    "--field",
    default="hypermixing",
    help="the implementation field (attention, dropout, hypermixing) set to xla in the reference (default hypermixing)",
  )
  p.add_argument("--steps", type=int, default=40, help="steps (default 40)")
  p.add_argument("--json", action="store_true", help="one JSON object per step on stdout")


def main(args: argparse.Namespace) -> int:
  rows = run(args.workloads, args.field, steps=args.steps, log=common.stderr)
  if args.json:
    rows[0]["env"] = bench_env.environment()
    print("".join(json.dumps(row) + "\n" for row in rows), end="", flush=True)
  return 0
