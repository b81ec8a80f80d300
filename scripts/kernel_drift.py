"""Whether a kernel and plain JAX compute the same training, step by step: rounding or a fault.

Two train steps of one workload (`remixer-t5 bench kernels`' workloads and batch), one with an implementation
field at its default (`auto`), one with it at `xla`, each compiled right after its config is parsed (gin binds
the mixers when the step is traced). Both run the same steps from the same state and batch. Each step prints
- both losses;
- `trajectory`: the largest relative difference of any parameter between the two runs so far;
- `one step`: the same after one step of each implementation from the *reference's* state.
A fault in the kernel shows in `one step` (it grows, or jumps at some step); rounding stays at float32's
1e-7-1e-5 there while `trajectory` may still grow, when training amplifies small differences.

  python scripts/kernel_drift.py [--workload cogs:hypermixer] [--field hypermixing] [--steps 40] [--out rows.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rel_diff(a, b) -> float:
  """Largest over parameters of max |a - b| / max |b|."""
  import jax
  import numpy as np
  out = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    out = max(out, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workload", default="cogs:hypermixer")
  p.add_argument("--field", default="hypermixing", help="the implementation field set to `xla` in the reference")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--out", help="append the JSON rows to this file")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error("--steps must be at least 1")
  sys.path.insert(0, str(REPO))
  from remixer_t5 import gin_utils, runtime
  from remixer_t5.bench import env as bench_env, kernels as bench_kernels, train as bench_train
  if args.field not in bench_kernels.fields() or args.workload not in bench_kernels.WORKLOADS:
    p.error(f"--field {args.field!r} / --workload {args.workload!r}: expected one of "
            f"{sorted(bench_kernels.fields())} / {sorted(bench_kernels.WORKLOADS)}")
  bench_env.set_xla_flags(None)
  runtime.configure()
  import jax

  from remixer_t5.training import partitioning, programs
  files, bindings, batch_size, lengths = bench_kernels.WORKLOADS[args.workload]
  part = partitioning.partitioner("1x1", jax.devices()[:1], rules="data")
  progs, host, data = {}, None, None
  for name, extra in (("default", []), ("xla", [f"{bench_kernels.fields()[args.field]}='xla'"])):
    gin_utils.parse_gin(files, bindings + extra, macro_defaults={"MODEL_DIR": "None"})
    setup = bench_train.from_gin(batch_size, lengths)  # the trainer's programs, each traced with its bindings
    prog = programs.build(setup["model"], setup["optimizer"], setup["feature_lengths"], part)
    if host is None:
      host = jax.device_get(prog.init_state(0))
      data = jax.device_put(bench_train.random_batch(setup["model"].module.config.vocab_size, setup["batch_size"],
                                                     setup["feature_lengths"]), prog.batch_sharding)
    compiled = prog.compile(prog.train_step, prog.state, data)
    # the step donates its state: each call gets its own copy of a host state, and its result comes back
    progs[name] = lambda st, d, c=compiled, sh=prog.shardings: jax.device_get(c(jax.device_put(st, sh), d))
  steps, state = progs, host
  out = open(args.out, "a") if args.out else None
  kernel, ref = state, state
  print(f"{'step':>4} {'loss (default)':>15} {'loss (xla)':>12} {'trajectory':>11} {'one step':>9}", file=sys.stderr)
  for i in range(args.steps):
    from_ref, _ = steps["default"](ref, data)
    kernel, m_kernel = steps["default"](kernel, data)
    ref, m_ref = steps["xla"](ref, data)
    row = {"workload": args.workload, "field": args.field, "step": i + 1,
           "loss_sum_default": float(m_kernel["loss_sum"]), "loss_sum_xla": float(m_ref["loss_sum"]),
           "trajectory_rel_diff": rel_diff(kernel.params, ref.params),
           "one_step_rel_diff": rel_diff(from_ref.params, ref.params)}
    print(f"{i + 1:>4} {row['loss_sum_default']:>15.4f} {row['loss_sum_xla']:>12.4f} "
          f"{row['trajectory_rel_diff']:>11.2e} {row['one_step_rel_diff']:>9.2e}", file=sys.stderr, flush=True)
    if out:
      out.write(json.dumps({**row, **({"env": bench_env.environment()} if i == 0 else {})}) + "\n")
  if out:
    out.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
