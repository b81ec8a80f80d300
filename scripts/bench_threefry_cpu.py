"""Dropout's keep masks on CPU: `T5Config.dropout_impl` 'xla' (JAX's bernoulli) against 'cpu' (kernels/cpu/threefry.py).

For each model, the trainer's whole jitted step (`programs.make_train_step`: loss, gradients, the run's optimizer
update) of `repro cogs`'s config (models/<model>/cogs.gin + runs/cogs_scratch.gin: batch 4, 64/320, dropout 0.1)
on random unpacked tokens, compiled twice in this one process, with the dropout implementation bound in gin:
`xla`, `jax.random.bernoulli`, whose hash XLA:CPU runs as JAX's rolled loop (a 5-iteration while loop per mask);
`cpu`, the same bits from the unrolled hash, large masks computed once a step (`threefry.materialize`). Both
start from the same state and batch and take the same number of steps, alternating rounds (this machine's speed
moves between minutes; only interleaved timings compare), and the script checks that their last losses agree:
the dropout masks are the same bits, but XLA fuses the programs differently, which can move a loss in its last
float bits (exit status 1 beyond 1e-5 relative).

Each round prints one JSON row per (model, variant): the median of `--steps` timed steps after `--warmup`
untimed ones, the compile time, the while loops left in the optimised program, the masks computed once, the
machine (bench_env), the load average. A summary gives each model's cpu/xla ratio (medians over rounds).
`--config tiny` (with `--unroll_min`, as its masks are small) is the test's (tests/test_cpu_threefry.py).
Results: docs/benchmarks.md ("Dropout's random bits on CPU").

  python scripts/bench_threefry_cpu.py --rounds 3 [--models t5_1_1,remixer] [--out docs/data/bench_threefry_cpu.jsonl]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("t5_1_1", "remixer", "mixer_encdec", "hypermixer")
TINY = ["network.T5Config.emb_dim=32", "network.T5Config.mlp_dim=48", "network.T5Config.num_heads=2",
        "network.T5Config.head_dim=16", "BATCH_SIZE=2", "TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 24}"]


VARIANTS = ("xla", "cpu")  # T5Config.dropout_impl


def stepper(model, optimizer, batch):
  """(a no-argument call running one jitted train step and returning its loss sum, compile seconds, while loops
  and materialized masks in the optimised program). The state is donated and carried from call to call."""
  import jax
  import jax.numpy as jnp
  from remixer_t5.training import programs, train_state
  params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
  state = train_state.TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=optimizer.init(params),
                             rng=jax.random.PRNGKey(1))
  data = {k: jnp.asarray(v) for k, v in batch.items()}
  t0 = time.perf_counter()
  compiled = jax.jit(programs.make_train_step(model, optimizer, None), donate_argnums=0).lower(state, data).compile()
  seconds = time.perf_counter() - t0
  holder = {"state": state}

  def run():
    holder["state"], metrics = compiled(holder["state"], data)
    return jax.block_until_ready(metrics["loss_sum"])
  text = compiled.as_text()
  return run, seconds, text.count(" while("), text.count('custom_call_target="remixer_materialize"')


def timed(fn, steps: int, warmup: int) -> tuple[float, float]:
  """(median seconds of `steps` calls after `warmup` untimed ones, the last call's loss)."""
  from remixer_t5.bench import train as bench_train
  times, loss = bench_train.time_calls(fn, steps, warmup)
  return statistics.median(times), float(loss)


def build(models, config: str):
  """{(model, variant): (call, compile seconds, while loops, materialized masks)} for each of VARIANTS: the model
  built with that dropout implementation (bound in gin) and its step compiled while that config is in force."""
  from remixer_t5.bench import train as bench_train
  from remixer_t5 import gin_utils
  steps = {}
  for name in models:
    batch = None
    for variant in VARIANTS:
      gin_utils.parse_gin([f"models/{name}/cogs.gin", "runs/cogs_scratch.gin"],
                          [*(TINY if config == "tiny" else []), f"network.T5Config.dropout_impl='{variant}'"],
                          macro_defaults={"MODEL_DIR": "None"})
      setup = bench_train.from_gin()
      if batch is None:  # the same batch for both variants
        batch = bench_train.random_batch(setup["model"].module.config.vocab_size, setup["batch_size"],
                                         setup["feature_lengths"])
      steps[(name, variant)] = stepper(setup["model"], setup["optimizer"], batch)
  return steps


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--config", choices=("cogs", "tiny"), default="cogs")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out", help="append the rows to this JSONL file")
  parser.add_argument("--unroll_min", type=int, default=None,
                      help="threefry.UNROLL_MIN, the smallest mask the cpu variant hashes unrolled (default: the "
                           "module's)")
  parser.add_argument("--tag", default="")
  args = parser.parse_args(argv)
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = sorted(set(models) - set(MODELS))
  if unknown:
    parser.error(f"--models: unknown {', '.join(unknown)}; expected some of {', '.join(MODELS)}")
  sys.path.insert(0, str(REPO))
  from remixer_t5.bench import env as bench_env
  from remixer_t5 import runtime
  runtime.configure(log=lambda m: print(m, file=sys.stderr, flush=True))  # as the CLI does before JAX starts
  import jax
  from remixer_t5.kernels.cpu import threefry
  if jax.default_backend() != "cpu":
    raise SystemExit("dropout_impl='cpu' is for CPU programs: run with JAX_PLATFORMS=cpu")
  if args.unroll_min is not None:
    threefry.UNROLL_MIN = args.unroll_min  # read when a mask is traced
  steps = build(models, args.config)
  env = bench_env.environment()
  describe = {"xla": None, "cpu": threefry.describe()}  # bench_env's field: what each variant's masks ran
  medians: dict = {}
  losses: dict = {}
  for r in range(args.rounds):
    order = sorted(steps) if r % 2 == 0 else sorted(steps, reverse=True)  # alternate who goes first
    for key in order:
      call, compile_s, loops, _ = steps[key]
      load = bench_env.loadavg()
      seconds, losses[key] = timed(call, args.steps, args.warmup)
      medians.setdefault(key, []).append(seconds)
      row = dict(bench="threefry_cpu", config=args.config, model=key[0], variant=key[1], round=r + 1,
                 median_s=round(seconds, 5), steps=args.steps, compile_s=round(compile_s, 2), while_loops=loops,
                 unroll_min=threefry.UNROLL_MIN, materialized=steps[key][3],
                 loss_sum=losses[key], tag=args.tag, load_average_start=load, load_average_end=bench_env.loadavg(),
                 **{**env, "cpu_threefry": describe[key[1]]})  # the variant's, not the process's
      print(json.dumps(row), flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
  agree = True
  for name in models:
    med = {v: statistics.median(medians[(name, v)]) for v in VARIANTS}
    a, b = losses[(name, "xla")], losses[(name, "cpu")]
    agree &= abs(a - b) / max(abs(a), 1e-30) <= 1e-5
    print(f"{name}: " + ", ".join(f"{v} {med[v] * 1000:.1f} ms" for v in VARIANTS)
          + f"; cpu/xla {med['cpu'] / med['xla']:.3f} (medians over {args.rounds} rounds); compile "
          + " -> ".join(f"{steps[(name, v)][1]:.1f}" for v in VARIANTS) + " s; while loops "
          + " -> ".join(str(steps[(name, v)][2]) for v in VARIANTS) + "; masks computed once "
          + str(steps[(name, "cpu")][3]) + "; last loss " + " / ".join(repr(losses[(name, v)]) for v in VARIANTS),
          flush=True)
  return 0 if agree else 1


if __name__ == "__main__":
  sys.exit(main())
