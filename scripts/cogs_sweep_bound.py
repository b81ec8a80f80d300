"""How fast `repro cogs`'s default sweep could be on this machine: each model's train step against its matmuls alone.

The aim is the full default sweep (4 models x 3 seeds x 12,000 steps) in about 2 hours on 2 cores. This
measures how far that is from what the machine can do at all. For each model it traces the trainer's whole
jitted step (`programs.make_train_step`: loss, gradients, the run's optimizer update) of the sweep's config
(models/<model>/cogs.gin + runs/cogs_scratch.gin: batch 4, 64/320, dropout 0.1, random unpacked tokens as
`bench train` uses), collects every `dot_general` of the traced step (forward, backward and optimizer, loops
multiplied out), and times each distinct one alone: jitted by itself on random operands of its shapes, the
fastest of `--rounds` interleaved medians of `--repeats` calls, less the dispatch of an almost empty jitted
call. Their sum is the time the step's matmuls take when nothing else runs: no elementwise work, softmax,
normalisation, dropout's random bits, HyperMixing's C++ loops (FFI calls, not dots) or optimizer arithmetic.
With these matmul kernels no implementation of the same step beats it without fewer FLOPs, so
`seeds x steps x matmuls alone`, summed over the models, is a lower bound on the sweep's training time;
`seeds x steps x step` (the whole step, timed in the same process) is what the sweep takes with the current
code, decoding not included.

  python scripts/cogs_sweep_bound.py [--models t5_1_1,remixer,mixer_encdec,hypermixer] [--steps 12000]
      [--seeds 3] [--repeats 30] [--rounds 3] [--gin BINDING ...] [--top N] [--json] [--out FILE.jsonl]

Run it on idle cores. Prints one line per model and the totals; `--json` / `--out` add one JSON row per model
with the machine (bench_env) and the load average. Results: docs/reproductions.md ("What 2 cores can do").
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("t5_1_1", "remixer", "mixer_encdec", "hypermixer")
TARGET_HOURS = 2.0  # the aim: the full default sweep in about 2 hours on 2 idle cores


def step_dots(fn, *args) -> tuple[dict[tuple, int], int]:
  """({(lhs shape, rhs shape, dimension numbers, lhs dtype, rhs dtype, preferred type): how many times one call of
  `fn(*args)` runs it}, while loops): every dot_general of the traced program, including those inside
  sub-programs (jit, custom derivatives) and scans (times their length). Of a cond's branches the one with the
  fewest dot FLOPs counts (a lower bound whichever runs). A while loop's body counts once (its trip count is not
  known from the trace), so the count is then a lower bound too; `while_loops` in the row says how many."""
  import jax
  from jax.extend import core as jcore
  loops = [0]

  def sub_jaxprs(value):
    if isinstance(value, jcore.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
      yield value
    elif isinstance(value, (tuple, list)):
      for v in value:
        yield from sub_jaxprs(v)

  def walk(jaxpr, times: int, counts: dict) -> dict:
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "dot_general":
        lhs, rhs = (v.aval for v in eqn.invars)
        key = (tuple(lhs.shape), tuple(rhs.shape), eqn.params["dimension_numbers"], str(lhs.dtype),
               str(rhs.dtype), str(eqn.params.get("preferred_element_type")))
        counts[key] = counts.get(key, 0) + times
      elif name == "cond":
        branches = [walk(branch.jaxpr, times, {}) for branch in eqn.params["branches"]]
        for k, n in min(branches, key=lambda c: sum(n * dot_flops(k) for k, n in c.items())).items():
          counts[k] = counts.get(k, 0) + n
      else:
        loops[0] += name == "while"
        inner = times * int(eqn.params.get("length", 1)) if name == "scan" else times
        for value in eqn.params.values():
          for sub in sub_jaxprs(value):
            walk(sub, inner, counts)
    return counts

  counts = walk(jax.make_jaxpr(fn)(*args).jaxpr, 1, {})
  return counts, loops[0]


def dot_flops(key: tuple) -> float:
  """2 x the product of the output's free dims, the batch dims and the contracted dims."""
  import math
  lhs, rhs, ((lc, rc), (lb, rb)), *_ = key
  batch = math.prod(lhs[d] for d in lb)
  contract = math.prod(lhs[d] for d in lc)
  lhs_free = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
  rhs_free = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
  return 2.0 * batch * contract * lhs_free * rhs_free


def median_call_s(call, repeats: int) -> float:
  """Median seconds of `repeats` calls after two untimed ones."""
  from remixer_t5.bench import train as bench_train
  return statistics.median(bench_train.time_calls(call, repeats, warmup=2)[0])


def dot_call(key: tuple, rng):
  """A no-argument call running the dot alone (its own jitted program, operands already on the device)."""
  import functools
  import jax
  import jax.numpy as jnp
  lhs, rhs, dims, lt, rt, pet = key
  a = jnp.asarray(rng.standard_normal(lhs), dtype=lt)
  b = jnp.asarray(rng.standard_normal(rhs), dtype=rt)
  f = jax.jit(functools.partial(jax.lax.dot_general, dimension_numbers=dims,
                                preferred_element_type=None if pet == "None" else jnp.dtype(pet)))
  return lambda: f(a, b).block_until_ready()


def dispatch_s(repeats: int) -> float:
  """Median seconds of an almost empty jitted call: what a dot_call's time carries besides the dot."""
  import jax
  import jax.numpy as jnp
  x = jnp.zeros((1,), jnp.float32)
  f = jax.jit(lambda v: v + 1)
  return median_call_s(lambda: f(x).block_until_ready(), repeats * 4)


def measure(name: str, repeats: int, rounds: int, step_repeats: int, bindings: list[str]) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from remixer_t5.bench import train as bench_train
  from remixer_t5 import gin_utils
  from remixer_t5.training import mfu, programs, train_state
  gin_utils.parse_gin([f"models/{name}/cogs.gin", "runs/cogs_scratch.gin"], bindings,
                      macro_defaults={"MODEL_DIR": "None"})
  setup = bench_train.from_gin()
  model, optimizer = setup["model"], setup["optimizer"]
  batch = bench_train.random_batch(model.module.config.vocab_size, setup["batch_size"], setup["feature_lengths"])
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  # Traced from shapes alone; bench_train.ours below builds and runs the real step.
  params = jax.eval_shape(lambda: model.init_variables(jax.random.PRNGKey(0),
                                                       {k: (1, v.shape[1]) for k, v in batch.items()})["params"])
  state = train_state.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                             opt_state=jax.eval_shape(optimizer.init, params), rng=jax.eval_shape(
                                 lambda: jax.random.PRNGKey(1)))
  dots, loops = step_dots(programs.make_train_step(model, optimizer, None), state, shapes)
  rng = np.random.default_rng(0)
  calls = {key: dot_call(key, rng) for key in dots}
  # The fastest of `rounds` interleaved medians (the machine's speed moves between seconds; a lower bound
  # wants the fastest it ran), less the fastest dispatch of an almost empty program.
  base = min(dispatch_s(repeats) for _ in range(rounds))
  each = {key: float("inf") for key in dots}
  for _ in range(rounds):
    for key, call in calls.items():
      each[key] = min(each[key], median_call_s(call, repeats))
  each = {key: max(t - base, 0.0) for key, t in each.items()}
  dot_s = sum(n * each[key] for key, n in dots.items())
  step_s = median_call_s(bench_train.ours(model, optimizer, batch), step_repeats)
  return {"model": name, "params": int(sum(x.size for x in jax.tree.leaves(params))),
          "model_flops_per_step": mfu.model_flops_per_step(model, shapes),
          "dot_flops_per_step": sum(n * dot_flops(k) for k, n in dots.items()),
          "distinct_dots": len(dots), "dots_per_step": sum(dots.values()), "while_loops": loops,
          "dispatch_ms": round(base * 1e3, 4), "dots_alone_ms": round(dot_s * 1e3, 3),
          "step_ms": round(step_s * 1e3, 3), "step_over_dots": round(step_s / dot_s, 3) if dot_s else None,
          "dots": sorted(({"lhs": k[0], "rhs": k[1], "contract": [list(k[2][0][0]), list(k[2][0][1])],
                           "batch": [list(k[2][1][0]), list(k[2][1][1])], "per_step": n,
                           "ms": round(each[k] * 1e3, 4), "gflop_s": round(dot_flops(k) / each[k] / 1e9, 1)
                           if each[k] else None} for k, n in dots.items()), key=lambda d: -d["per_step"] * d["ms"])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--steps", type=int, default=12000, help="training steps per run (repro cogs's default)")
  parser.add_argument("--seeds", type=int, default=3, help="runs per model (repro cogs's default)")
  parser.add_argument("--repeats", type=int, default=30, help="timed calls per distinct dot and round")
  parser.add_argument("--rounds", type=int, default=3, help="rounds over the distinct dots; each takes its fastest")
  parser.add_argument("--step_repeats", type=int, default=20, help="timed whole steps per model")
  parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                      help="a gin binding applied after each model's files, e.g. network.T5Config.emb_dim=64 "
                           "(repeatable; recorded in the rows)")
  parser.add_argument("--top", type=int, default=0, help="also print the N dots taking the most time a step")
  parser.add_argument("--json", action="store_true", help="also print each model's row as JSON")
  parser.add_argument("--out", help="append the rows to this JSONL file")
  args = parser.parse_args(argv)
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = sorted(set(models) - {p.parent.name for p in (REPO / "gin" / "models").glob("*/cogs.gin")})
  if unknown:
    parser.error(f"--models: no gin/models/<model>/cogs.gin for {', '.join(unknown)}")
  for flag in ("steps", "seeds", "repeats", "rounds", "step_repeats"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag} {getattr(args, flag)}: expected a positive count")
  sys.path.insert(0, str(REPO))
  from remixer_t5 import quiet
  quiet.configure()  # as the CLI: TensorFlow's, XLA's and libtpu's start-up lines hidden ($REMIXER_T5_VERBOSE=1)
  from remixer_t5.bench import env as bench_env
  from remixer_t5 import runtime
  log = lambda m: print(m, file=sys.stderr, flush=True)
  runtime.pin_cpu_without_tpu_chips()  # libtpu without TPU chips (the .[tpu] extra): no TPU runtime start
  # The host allocator policy, as the CLI sets it before JAX starts ($REMIXER_T5_HOST_MALLOC=off leaves malloc
  # alone). The kernels are the config's choice (`auto`: the CPU's, kernels/__init__.py), as in the sweep.
  runtime.configure(log=log)
  env = bench_env.environment()
  rows = []
  for name in models:
    load = bench_env.loadavg()
    row = measure(name, args.repeats, args.rounds, args.step_repeats, args.gin)
    runs = args.seeds * args.steps
    row.update(bench="cogs_sweep_bound", steps=args.steps, seeds=args.seeds, repeats=args.repeats, rounds=args.rounds,
               gin_bindings=args.gin,
               sweep_dots_alone_h=round(runs * row["dots_alone_ms"] / 3.6e6, 3),
               sweep_steps_h=round(runs * row["step_ms"] / 3.6e6, 3),
               load_average_start=load, load_average_end=bench_env.loadavg(), **env)
    rows.append(row)
    print(f"{name}: {row['params']:,} params; step {row['step_ms']:.1f} ms, its {row['dots_per_step']} matmuls "
          f"({row['distinct_dots']} distinct, {row['dot_flops_per_step'] / 1e9:.2f} GFLOP) alone "
          f"{row['dots_alone_ms']:.1f} ms ({row['dot_flops_per_step'] / row['dots_alone_ms'] / 1e6:.0f} GFLOP/s), "
          f"step/matmuls {row['step_over_dots']}; {args.seeds} x {args.steps:,} steps: "
          f">= {row['sweep_dots_alone_h']:.2f} h, now {row['sweep_steps_h']:.2f} h", flush=True)
    for d in row["dots"][:args.top]:
      print(f"  {d['per_step']} x {d['lhs']} . {d['rhs']} (contract {d['contract']}, batch {d['batch']}): "
            f"{d['ms']:.3f} ms, {d['gflop_s']} GFLOP/s", flush=True)
    if args.json:
      print(json.dumps(row), flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
  runs = args.seeds * args.steps
  matmul_flops = runs * sum(r["dot_flops_per_step"] for r in rows)
  best_rate = max(d["gflop_s"] for r in rows for d in r["dots"] if d["gflop_s"]) * 1e9
  print(f"sweep ({', '.join(models)}; {args.seeds} seeds x {args.steps:,} steps, training only): "
        f">= {runs * sum(r['dots_alone_ms'] for r in rows) / 3.6e6:.2f} h with nothing but the matmuls, "
        f"{runs * sum(r['step_ms'] for r in rows) / 3.6e6:.2f} h with the current step; target ~{TARGET_HOURS:g} h. "
        f"Its {matmul_flops / 1e12:,.0f} TFLOP of matmuls at the fastest rate any of them reached "
        f"({best_rate / 1e9:.0f} GFLOP/s): {matmul_flops / best_rate / 3600:.2f} h", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
