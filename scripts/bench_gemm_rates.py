"""Float32 GEMM rates on this CPU: XLA:CPU (with the XLA flags given), PyTorch's sgemm and numpy's BLAS.

The CPU training step's gap to HF's (docs/benchmarks.md, "CPU training step against PyTorch") sits mostly in
the matrix products' kernels; this times, for a few of config B's (T5.1.1-small, batch 8, 512/114) forward
products, each library's product alone (the libraries take turns per shape in one process, so a pair is
measured under the same load), and prints one JSON line per library and shape: time, GFLOP/s, busy cores, the
commit, the library's version and `--tag`. Thread counts: XLA's and numpy's BLAS use their defaults (every core
of the process), PyTorch is set to 2 threads with subnormals flushed, as `bench train --reference hf` runs it.
XLA's flags are read once per process, so compare XLA's routes in separate runs:

  python scripts/bench_gemm_rates.py                                   # the CLI's CPU flag (YNNPACK dots)
  python scripts/bench_gemm_rates.py --xla_flags=""                     # XLA's default (Eigen)
  python scripts/bench_gemm_rates.py --xla_flags="--xla_cpu_use_onednn=true" --only xla

Needs the .[hf] extra for the PyTorch lines (skipped without it).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

SHAPES = [(2048, 512, 2048), (4096, 512, 1024), (4096, 1024, 512), (912, 512, 32128)]


def rate(call, m: int, k: int, n: int, repeats: int) -> dict:
  call()
  u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  for _ in range(repeats):
    call()
  dt = time.perf_counter() - t0
  u1 = resource.getrusage(resource.RUSAGE_SELF)
  cpu = u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime
  return {"ms": round(dt / repeats * 1e3, 2), "gflops": round(2 * m * k * n * repeats / dt / 1e9, 1),
          "cores_busy": round(cpu / dt, 2)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--xla_flags", default=None, help="XLA_FLAGS for the XLA lines (default: the CLI's CPU flag)")
  p.add_argument("--only", choices=("xla", "torch", "numpy"), help="one library only")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--tag", default=None, help="a label copied into every row (e.g. which run of several)")
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats}: expected at least 1")
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  from remixer_t5 import bench_env
  bench_env.set_xla_flags(args.xla_flags)
  import numpy as np

  rng = np.random.default_rng(0)
  commit, cpu = bench_env.git_commit(), bench_env.cpu_model()
  libs = [args.only] if args.only else ["xla", "torch", "numpy"]
  try:
    import torch
    bench_env.set_torch_flush_denormal(True)
    torch.set_num_threads(2)
  except ImportError:
    if "torch" in libs:
      print("torch: not installed (pip install -e '.[hf]'); its lines are skipped", file=sys.stderr)
      libs.remove("torch")
  import jax
  import jax.numpy as jnp
  versions = {"xla": f"jaxlib {jax.lib.__version__}", "numpy": f"numpy {np.__version__}",
              "torch": f"torch {torch.__version__}" if "torch" in libs else None}
  matmul = jax.jit(jnp.matmul)
  for m, k, n in SHAPES:
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    for lib in libs:
      if lib == "xla":
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        call = lambda: matmul(ja, jb).block_until_ready()  # noqa: E731
      elif lib == "torch":
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        call = lambda: torch.matmul(ta, tb)  # noqa: E731
      else:
        call = lambda: a @ b  # noqa: E731
      row = {"lib": lib, "shape": [m, k, n], **rate(call, m, k, n, args.repeats),
             "xla_flags": os.environ["XLA_FLAGS"] if lib == "xla" else None, "version": versions[lib],
             "cpu": cpu, "commit": commit, "tag": args.tag}
      print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
