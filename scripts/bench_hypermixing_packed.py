"""Time HyperMixing's XLA packed (segmented) form, one layer's forward + backward, in one or more checkouts.

The XLA form (`HyperMixing._block_segmented`, called directly here) is what TPUs and GPUs run, and CPUs with
`HyperMixing.impl='xla'` or more than one device. To compare two commits, give both checkouts: each round runs
every checkout in its own process (alternating, so drift in the machine's speed falls on both), and the rows print
each checkout's commit and median.

  python scripts/bench_hypermixing_packed.py --repos OLD_CHECKOUT NEW_CHECKOUT [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from remixer_t5.bench import env as bench_env

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import json, os, time
import jax, jax.numpy as jnp, numpy as np
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers.hypermixer import HyperMixing
b, n, h, d, calls = {b}, {n}, {h}, {d}, {calls}
rng = np.random.default_rng(0)
mixer = HyperMixing(T5Config(dtype="float32"))
out = {{}}
for pieces in {pieces}:
  ids = np.ones((b, n), np.int32)
  for r in range(b):
    ends = np.sort(rng.choice(np.arange(1, n), size=pieces - 1, replace=False))
    ids[r] = 1 + (np.arange(n)[None, :] >= ends[:, None]).sum(0)
  seg, mask = jnp.asarray(ids), jnp.ones((b, n), jnp.float32)
  w1, x, w2 = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, n, h), (b, n, d), (b, n, h)))
  g = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
  f = jax.jit(jax.value_and_grad(lambda w1, x, w2: jnp.sum(mixer._block_segmented(w1, x, w2, mask, seg, seg) * g),
                                 argnums=(0, 1, 2)))
  jax.block_until_ready(f(w1, x, w2))
  t = time.perf_counter()
  for _ in range(calls):
    jax.block_until_ready(f(w1, x, w2))
  out[str(pieces)] = (time.perf_counter() - t) / calls
print(json.dumps(out))
"""


def commit(repo: Path) -> str:
  return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                        text=True).stdout.strip() or "?"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repos", nargs="+", default=[str(ROOT)], help="checkouts to time (default: this one)")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--shape", default="8,512,512,256", help="batch,length,d',d")
  ap.add_argument("--segments", default="1,5", help="segments a row, comma-separated")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  b, n, h, d = (int(v) for v in args.shape.split(","))
  pieces = [int(v) for v in args.segments.split(",")]
  code = textwrap.dedent(ONE.format(b=b, n=n, h=h, d=d, calls=args.calls, pieces=pieces))
  repos = [Path(r).resolve() for r in args.repos]
  times = {str(r): {str(p): [] for p in pieces} for r in repos}
  for rnd in range(args.rounds):
    for repo in repos:
      env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
      proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=repo)
      if proc.returncode:
        sys.exit(f"{repo}: {proc.stderr[-2000:]}")
      for p, t in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        times[str(repo)][p].append(t)
      print(f"round {rnd + 1}/{args.rounds} {repo.name} ({commit(repo)}): "
            + ", ".join(f"{p} segment(s) {1e3 * v[-1]:.1f} ms" for p, v in times[str(repo)].items()),
            file=sys.stderr, flush=True)
  for repo in repos:
    for p, v in times[str(repo)].items():
      row = {"repo": repo.name, "commit": commit(repo), "shape": [b, n, h, d], "segments": int(p),
             "median_ms": round(1e3 * statistics.median(v), 2), "ms": [round(1e3 * t, 2) for t in v],
             "cpu_model": bench_env.cpu_model(), "cpus": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
             "load": os.getloadavg()[0]}
      print(json.dumps(row) if args.json else
            f"{repo.name} ({row['commit']}), {p} segment(s) a row: {row['median_ms']} ms (rounds {row['ms']})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
