"""HyperMixing on CPU: the fused C++ loops of remixer_t5/kernels/cpu/hypermixing.py against the layer's XLA forms.

Two measurements, each with both variants compiled in this one process and timed in alternating rounds (this
machine's speed moves by up to 25% between minutes; only interleaved timings compare). The variants are the
layer's implementation choice: `kernel` is `HyperMixing.impl='cpu'`, `xla` is `impl='xla'`.

  layer  causal HyperMixing's forward + backward (`HyperMixing._causal`, the decoder's self-mixing) on packed
         rows: the kernel against the chunked scan
  step   a whole HyperMixer train step (loss and gradients, jitted, no optimizer) of `repro cogs`'s model
         (models/hypermixer/cogs.gin, batch 4, 64/320, dropout off) on packed rows (7 examples a row, as COGS
         packs) and on unpacked ones: every HyperMixing form through the kernels against XLA's

Each round prints one JSON row per (measurement, variant): the median of `--steps` timed calls after `--warmup`
untimed ones, the machine (bench_env.environment(): CPU, flags, threads, commit), the load average. A summary
gives the median over rounds and each kernel/XLA ratio. `--config tiny` is the test's (tests/test_cpu_hypermixing.py).
Results: docs/benchmarks.md ("HyperMixing on CPU").

  python scripts/bench_hypermixing_cpu.py --rounds 3 [--out docs/data/bench_hypermixing_cpu.jsonl]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name: (layer shape b, n, d', d; step model bindings, batch, input and target lengths, examples per row)
CONFIGS = {
    "cogs": ((4, 320, 288, 128), [], 4, 64, 320, 7),
    "tiny": ((2, 24, 16, 8), ["network.T5Config.emb_dim=32", "network.T5Config.mlp_dim=48",
                             "network.T5Config.num_heads=2", "network.T5Config.head_dim=16"], 2, 16, 24, 3),
}
VARIANTS = {"kernel": "cpu", "xla": "xla"}  # variant: HyperMixing.impl


def packed_ids(batch: int, length: int, examples: int, pad: int):
  """Segment ids 1..examples of near-equal contiguous lengths, then `pad` padding positions (id 0), and the
  positions within each segment: what seqio's packing gives."""
  import numpy as np
  seg = np.zeros((batch, length), np.int32)
  pos = np.zeros((batch, length), np.int32)
  cuts = np.linspace(0, length - pad, examples + 1).astype(int)
  for s in range(examples):
    seg[:, cuts[s]:cuts[s + 1]] = s + 1
    pos[:, cuts[s]:cuts[s + 1]] = np.arange(cuts[s + 1] - cuts[s])
  return seg, pos


def timed(fn, steps: int, warmup: int) -> float:
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def build(config: str):
  """{(measurement, variant): a no-argument call running it}, each compiled once, and {(measurement, variant):
  the custom calls to the kernels in its program} (0 for every `xla` variant, else the choice did not take)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from remixer_t5.bench import train as bench_train
  from remixer_t5 import gin_utils
  from remixer_t5.model.config import T5Config
  from remixer_t5.model.mixers import hypermixer
  (b, n, h, d), bindings, batch_size, inputs, targets, examples = CONFIGS[config]
  calls, kernel_calls = {}, {}

  # The layer: HyperMixing's causal form on its own, packed rows, gradient of a random projection of the output.
  rng = np.random.default_rng(0)
  seg, _ = packed_ids(b, n, examples, 10 if n > 40 else 2)
  mask = (seg > 0).astype(np.float32)
  w1 = jnp.asarray(rng.standard_normal((b, n, h)).astype(np.float32) * 0.3 * mask[..., None])
  w2 = jnp.asarray(rng.standard_normal((b, n, h)).astype(np.float32) * 0.1)
  x = jnp.asarray(rng.standard_normal((b, n, d)).astype(np.float32))
  g = jnp.asarray(rng.standard_normal((b, n, d)).astype(np.float32))
  for variant, impl in VARIANTS.items():
    # The layer's causal form outside a model (an unbound module: _causal reads only its fields, HyperMixing's
    # defaults but the implementation).
    mixer = hypermixer.HyperMixing(T5Config(dtype="float32"), impl=impl)
    fn = jax.jit(jax.grad(lambda w1, x, w2, mixer=mixer: jnp.sum(
        mixer._causal(w1, x, w2, jnp.asarray(mask), jnp.asarray(seg)) * g), argnums=(0, 1, 2)))
    fn(w1, x, w2)
    calls[("layer", variant)] = lambda fn=fn: fn(w1, x, w2)
    kernel_calls[("layer", variant)] = fn.lower(w1, x, w2).as_text().count("@remixer_hypermixing")

  # The step: the repro's model, loss and gradients, its HyperMixing layers built with each variant's
  # implementation (bound in gin, and compiled while that config is in force).
  lengths = {"inputs": inputs, "targets": targets}
  params = datas = None
  for variant, impl in VARIANTS.items():
    gin_utils.parse_gin(["models/hypermixer/cogs.gin"],
                        ["DROPOUT_RATE=0.0", *bindings, f"hypermixer.HyperMixing.impl='{impl}'"])
    model = bench_train.from_gin(batch_size, lengths)["model"]
    if params is None:  # the same parameters and batches for both variants
      batch = bench_train.random_batch(model.module.config.vocab_size, batch_size, lengths)
      es, ep = packed_ids(batch_size, inputs, examples, 4 if inputs > 20 else 1)
      ds, dp = packed_ids(batch_size, targets, examples, 10 if targets > 40 else 2)
      packed = dict(batch, encoder_segment_ids=es, decoder_segment_ids=ds, encoder_positions=ep,
                    decoder_positions=dp)
      params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
      datas = {rows: {k: jnp.asarray(v) for k, v in data.items()} for rows, data in (("packed", packed),
                                                                                    ("unpacked", batch))}
    for rows, data in datas.items():
      fn = jax.jit(jax.value_and_grad(lambda p, b, model=model: model.loss_fn(p, b, None)[0]))
      fn(params, data)
      calls[(f"step_{rows}", variant)] = lambda fn=fn, data=data: fn(params, data)
      kernel_calls[(f"step_{rows}", variant)] = fn.lower(params, data).as_text().count("@remixer_hypermixing")
  return calls, kernel_calls


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", choices=sorted(CONFIGS), default="cogs")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out", help="append the rows to this JSONL file")
  parser.add_argument("--tag", default="")
  args = parser.parse_args(argv)
  sys.path.insert(0, str(REPO))
  from remixer_t5.bench import env as bench_env
  from remixer_t5 import runtime
  runtime.configure(log=lambda m: print(m, file=sys.stderr, flush=True))  # as the CLI does before JAX starts
  import jax
  from remixer_t5.kernels.cpu import hypermixing as cpu_hypermixing
  if jax.default_backend() != "cpu" or not cpu_hypermixing.usable("float32"):
    raise SystemExit("the kernels need JAX on one CPU device (JAX_PLATFORMS=cpu) and a C++ compiler: "
                     f"{jax.device_count()} {jax.default_backend()} device(s); {cpu_hypermixing.describe()}")
  calls, kernel_calls = build(args.config)
  env = bench_env.environment()
  medians: dict = {}
  for r in range(args.rounds):
    order = sorted(calls) if r % 2 == 0 else sorted(calls, reverse=True)  # alternate who goes first
    for key in order:
      load = bench_env.loadavg()
      seconds = timed(calls[key], args.steps, args.warmup)
      medians.setdefault(key, []).append(seconds)
      row = dict(bench="hypermixing_cpu", config=args.config, measurement=key[0], variant=key[1], round=r + 1,
                 median_s=round(seconds, 5), steps=args.steps, kernel_calls=kernel_calls[key], tag=args.tag, load_average_start=load,
                 load_average_end=bench_env.loadavg(), **env)
      print(json.dumps(row), flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
  for measurement in sorted({k[0] for k in calls}):
    kernel = statistics.median(medians[(measurement, "kernel")])
    xla = statistics.median(medians[(measurement, "xla")])
    print(f"{measurement}: kernel {kernel * 1000:.1f} ms, XLA {xla * 1000:.1f} ms, kernel/XLA {kernel / xla:.3f} "
          f"(median over {args.rounds} rounds)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
