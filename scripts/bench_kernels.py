"""Each platform kernel against plain JAX, on the work it exists for, side by side in one process.

A kernel (remixer_t5/kernels/) stays only if it makes one of these workloads at least 1.2x faster: the trainer's
whole jitted step (`programs.make_train_step`: loss, gradients, the run's optimizer update) of
- each COGS model (`models/<model>/cogs.gin` + `runs/cogs_scratch.gin`: batch 4, 64/320, dropout 0.1), and
- config A (T5.1.1, d 256, 4+4 layers, batch 16, 128/32) and config B (T5.1.1-small, batch 8, 512/114) of
  `scripts/bench_cpu_vs_hf.sh`, dropout 0,
on random unpacked tokens. Per workload, every variant is compiled in this one process from the same state and
batch; rounds alternate the variants (a machine's speed drifts between minutes; only interleaved timings
compare), each round the median of `--steps` timed steps after `--warmup`. Variants:
- `default`: every implementation field at `auto` (what a run compiles on this platform);
- `xla`: every field at `xla` (`T5Config.attention_impl`, `T5Config.dropout_impl`, `HyperMixing.impl`);
- `<field>=xla`: that field alone at `xla`, the rest `auto`, where the workload exercises more than one.
One JSON row per (workload, variant, round) and a summary line per workload: each variant's median over rounds
and its ratio to `default`. The last losses are printed too (the kernels compute the same function).

  python scripts/bench_kernels.py [--workloads cogs:t5_1_1,cogs:remixer,A,B] [--rounds 3] [--out rows.jsonl]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COGS_MODELS = ("t5_1_1", "remixer", "mixer_encdec", "hypermixer")
CONFIGS = {  # scripts/bench_cpu_vs_hf.sh's configs
    "A": (["models/t5_1_1/small.gin"], ["DROPOUT_RATE=0.0", "network.T5Config.emb_dim=256",
                                         "network.T5Config.num_encoder_layers=4", "network.T5Config.num_decoder_layers=4",
                                         "network.T5Config.mlp_dim=1024", "network.T5Config.num_heads=4",
                                         "network.T5Config.head_dim=64"], 16, {"inputs": 128, "targets": 32}),
    "B": (["models/t5_1_1/small.gin"], ["DROPOUT_RATE=0.0"], 8, {"inputs": 512, "targets": 114}),
}
IMPL_FIELDS = {"attention": "network.T5Config.attention_impl", "dropout": "network.T5Config.dropout_impl",
               "hypermixing": "hypermixer.HyperMixing.impl"}


def workload(name: str):
  """(gin files, bindings, batch size or None, feature lengths or None) of a workload name."""
  if name.startswith("cogs:"):
    model = name.split(":", 1)[1]
    if model not in COGS_MODELS:
      raise SystemExit(f"bench_kernels: unknown COGS model {model!r}; expected one of {COGS_MODELS}")
    return [f"models/{model}/cogs.gin", "runs/cogs_scratch.gin"], [], None, None
  if name not in CONFIGS:
    raise SystemExit(f"bench_kernels: unknown workload {name!r}; expected cogs:<model> or one of {sorted(CONFIGS)}")
  return CONFIGS[name]


def variants(files: list[str], bindings: list[str]) -> dict[str, list[str]]:
  """Variant name -> extra gin bindings: `default`, `xla`, and each field alone at `xla` where the workload
  exercises it (no dropout in configs A and B; HyperMixer has no attention)."""
  hyper = any("hypermixer" in f for f in files)
  fields = {k: f for k, f in IMPL_FIELDS.items() if (k != "hypermixing" or hyper) and (k != "attention" or not hyper)}
  if "DROPOUT_RATE=0.0" in bindings:
    fields.pop("dropout")
  out = {"default": [], "xla": [f"{f}='xla'" for f in fields.values()]}
  if len(fields) > 1:
    out.update({f"{k}=xla": [f"{f}='xla'"] for k, f in fields.items()})
  return out


def build(files, bindings, batch_size, lengths):
  """(model, optimizer, batch size, feature lengths) from gin, as `remixer-t5 bench train` reads them."""
  import gin

  from remixer_t5.bench import train as bench_train
  from remixer_t5 import gin_utils
  gin.clear_config()
  gin_utils.parse_gin(files, bindings, [], macro_defaults={"MODEL_DIR": "None"})
  got = bench_train.from_gin(batch_size, lengths)
  return got["model"], got["optimizer"], got["batch_size"], got["feature_lengths"]


def start(model, optimizer, batch):
  """(the train state every variant starts from: parameters of seed 0, step 0, rng 1; the batch as arrays)."""
  import jax
  import jax.numpy as jnp

  from remixer_t5.training import train_state
  params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
  state = train_state.TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=optimizer.init(params),
                                 rng=jax.random.PRNGKey(1))
  return state, {k: jnp.asarray(v) for k, v in batch.items()}


def stepper(model, optimizer, batch):
  """(a no-argument call running one jitted train step, returning its loss sum; compile seconds)."""
  import jax

  from remixer_t5.training import programs
  state, data = start(model, optimizer, batch)
  t0 = time.perf_counter()
  compiled = jax.jit(programs.make_train_step(model, optimizer, None), donate_argnums=0).lower(state, data).compile()
  seconds = time.perf_counter() - t0
  holder = {"state": state}

  def run():
    holder["state"], metrics = compiled(holder["state"], data)
    return jax.block_until_ready(metrics["loss_sum"])
  return run, seconds


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workloads", default=",".join([f"cogs:{m}" for m in COGS_MODELS] + ["A", "B"]))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=10, help="timed steps per round (config B: a third of it)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--out", help="append the JSON rows to this file")
  args = p.parse_args(argv)
  if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
    p.error("--rounds and --steps must be at least 1, --warmup at least 0")
  sys.path.insert(0, str(REPO))
  from remixer_t5.bench import env as bench_env
  from remixer_t5 import runtime
  bench_env.set_xla_flags(None)  # XLA's defaults, JAX_PLATFORMS=cpu unless set
  runtime.configure()  # as the CLI does before JAX starts (the host allocator policy on CPU)
  from remixer_t5.bench import train as bench_train
  env = bench_env.environment()
  out = open(args.out, "a") if args.out else None
  for name in args.workloads.split(","):
    files, bindings, batch_size, lengths = workload(name)
    runs, compile_s = {}, {}
    for variant, extra in variants(files, bindings).items():
      model, optimizer, bs, fl = build(files, bindings + extra, batch_size, lengths)
      batch = bench_train.random_batch(model.module.config.vocab_size, bs, fl)
      runs[variant], compile_s[variant] = stepper(model, optimizer, batch)
    steps = max(1, args.steps // 3) if name == "B" else args.steps
    medians = {v: [] for v in runs}
    losses = {}
    for r in range(args.rounds):
      for variant, run in runs.items():
        times, loss = bench_train.time_calls(run, steps, args.warmup)
        medians[variant].append(statistics.median(times))
        losses[variant] = float(loss)
        row = {"workload": name, "variant": variant, "round": r, "s_per_step": medians[variant][-1],
               "compile_s": round(compile_s[variant], 2), "steps": steps, "last_loss_sum": losses[variant],
               "load_average": list(__import__("os").getloadavg()), **env}
        print(json.dumps(row), flush=True)
        if out:
          out.write(json.dumps(row) + "\n")
    base = statistics.median(medians["default"])
    parts = [f"{v} {statistics.median(m) * 1e3:.1f} ms ({statistics.median(m) / base:.3f}x)" for v, m in medians.items()]
    print(f"# {name}: " + "; ".join(parts) + f" | last losses {losses}", file=sys.stderr, flush=True)
  if out:
    out.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
