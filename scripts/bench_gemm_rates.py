"""Float32 GEMM rates on this CPU: XLA:CPU (with the XLA flags given), PyTorch's sgemm and numpy's BLAS, alone.

The CPU training step's gap to HF's (docs/benchmarks.md, "CPU training step against PyTorch") sits in the matrix
products' kernels; this prints, for a few of config B's (T5.1.1-small, batch 8, 512/114) forward products, the
time, GFLOP/s and busy cores of each library at 2 threads, subnormals flushed, one line per library and shape.
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
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats}: expected at least 1")
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  from remixer_t5 import xla_cpu
  os.environ["XLA_FLAGS"] = xla_cpu.FLAG if args.xla_flags is None else args.xla_flags
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import numpy as np

  from remixer_t5 import bench_env
  rng = np.random.default_rng(0)
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
             "xla_flags": os.environ["XLA_FLAGS"] if lib == "xla" else None, "cpu": bench_env.cpu_model()}
      print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
