"""The matmuls of config A's train step (docs/benchmarks.md), timed alone: XLA:CPU against torch.matmul.

Config A (d 256, 4+4 layers, d_ff 1024, 4 x 64 heads, vocab 32128, batch 16, 128/32 tokens) runs each weight
matmul three ways a step: forward x @ W, input gradient dy @ W^T and kernel gradient x^T @ dy. This times the
three for every distinct shape (2,048 encoder rows, 512 decoder rows), weights them by how often a step runs
them, and prints one markdown row per shape plus the weighted totals, so that a step's gap to HF's can be split
into the matmul kernels and the rest. Both sides float32, subnormals flushed, 2 threads (the process's cores).

  python scripts/bench_matmul_shapes.py [--xla_flags="--xla_cpu_experimental_ynn_fusion_type=+individual_dot"]

The default XLA flags are the CLI's on CPU (remixer_t5/xla_cpu.py); pass --xla_flags= for XLA's own default.
Needs the .[hf] extra (PyTorch).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# (rows M, in D, out N, how many of them a step runs): attention q/k/v/o are 4 (self) and 4 (cross: q, o on the
# decoder's rows; k, v on the encoder's) per layer; the gated-GELU MLP's two wi and one wo per layer; the
# output layer once.
SHAPES = [(2048, 256, 1024, 8), (2048, 1024, 256, 4), (2048, 256, 256, 16 + 8), (512, 256, 1024, 8),
          (512, 1024, 256, 4), (512, 256, 256, 16 + 8), (512, 256, 32128, 1)]


def median_ms(call, repeats: int) -> float:
  call()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--xla_flags", default=None, help="XLA_FLAGS for our side (default: the CLI's CPU flag)")
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--json", action="store_true", help="also print the row as JSON")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats {args.repeats}: expected at least 1 timed call per measurement")
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  from remixer_t5 import bench_env
  bench_env.set_xla_flags(args.xla_flags)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch

  from remixer_t5 import quiet
  bench_env.set_torch_flush_denormal(True)  # before PyTorch's first operation (the mode is per thread)
  with quiet.native_stderr_hidden():  # libtpu's start-up lines where the .[tpu] extra is installed
    jax.devices()
  rng = np.random.default_rng(0)
  kinds = ("forward", "input grad", "kernel grad")
  ours = {"forward": jax.jit(lambda x, w: x @ w), "input grad": jax.jit(lambda g, w: g @ w.T),
          "kernel grad": jax.jit(lambda x, g: x.T @ g)}
  theirs = {"forward": lambda x, w: x @ w, "input grad": lambda g, w: g @ w.T, "kernel grad": lambda x, g: x.T @ g}
  totals = {side: dict.fromkeys(kinds, 0.0) for side in ("xla", "torch")}
  print(f"| [M, K] x [K, N] | per step | " + " | ".join(f"{k}: XLA / torch ms" for k in kinds) + " |")
  print("|---|---:|" + "---:|" * len(kinds))
  for m, d, n, count in SHAPES:
    x, w, g = (rng.standard_normal(s).astype(np.float32) for s in ((m, d), (d, n), (m, n)))
    operands = {"forward": (x, w), "input grad": (g, w), "kernel grad": (x, g)}
    cells = []
    for kind in kinds:
      a, b = operands[kind]
      ja, jb = jnp.asarray(a), jnp.asarray(b)
      ta, tb = torch.from_numpy(a), torch.from_numpy(b)
      ms_xla = median_ms(lambda: ours[kind](ja, jb).block_until_ready(), args.repeats)
      ms_torch = median_ms(lambda: theirs[kind](ta, tb), args.repeats)
      totals["xla"][kind] += count * ms_xla
      totals["torch"][kind] += count * ms_torch
      cells.append(f"{ms_xla:.2f} / {ms_torch:.2f}")
    print(f"| [{m}, {d}] x [{d}, {n}] | {count} | " + " | ".join(cells) + " |", flush=True)
  print("| **weighted total** | | " + " | ".join(f"**{totals['xla'][k]:.0f} / {totals['torch'][k]:.0f}**"
                                            for k in kinds) + " |")
  all_xla, all_torch = sum(totals["xla"].values()), sum(totals["torch"].values())
  print(f"\nall matmuls of a step: XLA {all_xla:.0f} ms, torch {all_torch:.0f} ms (XLA / torch {all_xla / all_torch:.2f});"
        f" XLA_FLAGS {os.environ['XLA_FLAGS']!r}, torch threads {torch.get_num_threads()}")
  env = bench_env.environment(with_torch=True)
  print(f"{env['cpu_model']} [{env['cpu_id']}], {env['cpus_usable']}/{env['cpu_count']} cores, "
        f"{' '.join(env['cpu_flags'])}; load {bench_env.loadavg()}; commit {env['git_commit']}")
  if args.json:
    print(json.dumps({"totals_ms": totals, "shapes": SHAPES, **env}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
