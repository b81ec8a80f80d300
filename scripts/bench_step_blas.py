"""Our whole CPU train step with layers.Dense's products through an external BLAS, against XLA:CPU's own dots.

docs/benchmarks.md found our step behind HF's PyTorch step on a Cascade Lake (config A 1.10x and B 1.14x with
both in one process; 1.01x and 1.07x with the reference in its own) and XLA:CPU's products slower than MKL's
alone (scripts/bench_gemm_rates.py). This asks whether calling a faster BLAS from inside the step closes the
gap: every `layers.Dense` product (forward, dX = dY W^T and dW = X^T dY) becomes an XLA FFI custom call (the library's remixer_t5/csrc/cpu_sgemm.cc, compiled here with $CXX or c++
against jaxlib's FFI headers into a temporary folder) to one of:

  xla            XLA:CPU's own dots, with the CLI's flag (YNNPACK) - the baseline
  openblas-pool  numpy's bundled OpenBLAS, single-threaded, each product cut into blocks run on XLA's pool
  openblas       numpy's bundled OpenBLAS, one call a product, its own threads (as many as the process's cores;
                 started when numpy loaded it, so they likely do not flush subnormals as XLA's threads do)
  mkl            Intel MKL's cblas_sgemm_64 (`pip install mkl`, libmkl_rt in the venv), one call a product,
                 its own threads on the GNU OpenMP layer (Intel's OpenMP threads spin and slowed XLA's ops)
  onednn         oneDNN's dnnl_sgemm (`pip install onednn-cpu-gomp`: oneDNN 3.2, 39 MB, GNU OpenMP; the
                 vendor-neutral library PyTorch's CPU kernels come from), one call a product, its own threads
  mkl-pool       MKL single-threaded, cut into blocks on XLA's pool (no OpenMP team beside XLA's threads)
  onednn-pool    oneDNN the same way

Each variant runs in its own process (a custom call is registered once per process), the variants take turns
for `--rounds` rounds, and each round prints one JSON row: the median of `--steps` timed steps after the first
(compiling) step and `--warmup` more, the largest relative difference from XLA's own product over test
products cut into blocks by rows and by columns and their gradients (`check_rel_err`), how many custom calls
the traced step holds (`custom_calls_in_step`; 0 would mean the swap did not take), the machine (bench_env), the load average and the commit. A summary line per variant gives the
median over rounds and the ratio to `xla`. Configs as scripts/bench_cpu_vs_hf.sh (A, B), plus `tiny` for the
test. Unlike the library's route (remixer_t5/cpu_blas.py: MKL on its own threads, products of at least
MIN_FLOPS), every product goes to the variant's sgemm. Results: docs/benchmarks.md.

  python scripts/bench_step_blas.py --config A --rounds 3 [--variants xla,openblas-pool,mkl] [--out rows.jsonl]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("xla", "openblas-pool", "openblas", "mkl", "mkl-pool", "onednn", "onednn-pool")
TARGET = "remixer_step_sgemm"
CHILD_TIMEOUT_S = 3600  # one variant's process: compile and every step of a round
# name: (gin bindings on models/t5_1_1/small.gin, batch size, input length, target length)
CONFIGS = {
    "A": (["network.T5Config.emb_dim=256", "network.T5Config.num_encoder_layers=4",
           "network.T5Config.num_decoder_layers=4", "network.T5Config.mlp_dim=1024", "network.T5Config.num_heads=4",
           "network.T5Config.head_dim=64"], 16, 128, 32),
    "B": ([], 8, 512, 114),
    "tiny": (["network.T5Config.emb_dim=64", "network.T5Config.num_encoder_layers=1",
              "network.T5Config.num_decoder_layers=1", "network.T5Config.mlp_dim=128", "network.T5Config.num_heads=2",
              "network.T5Config.head_dim=32", "network.T5Config.vocab_size=512"], 2, 16, 8),
}


def compile_handler(out_dir: str) -> str:
  """The library's handler (remixer_t5/csrc/cpu_sgemm.cc), built into out_dir; SystemExit saying why not."""
  sys.path.insert(0, str(REPO))
  from remixer_t5 import cpu_blas
  try:
    return str(cpu_blas.build(out_dir=Path(out_dir)))
  except cpu_blas.Unavailable as e:
    raise SystemExit(f"bench_step_blas: {e}") from None


def _address(fn) -> ctypes.c_void_p:
  return ctypes.c_void_p(ctypes.cast(fn, ctypes.c_void_p).value)


def load_blas(variant: str) -> tuple[object, object, int, bool, str]:
  """(sgemm, set-this-thread's-threads function, threads per call (0: blocks on XLA's pool), whether the sgemm
  is oneDNN's, description)."""
  import numpy as np

  from remixer_t5 import cpu_blas
  cores = cpu_blas.cores()
  if variant.startswith("openblas"):
    root = Path(np.__file__).resolve().parent
    libs = glob.glob(str(root.parent / "numpy.libs" / "libscipy_openblas64_*.so*")) + glob.glob(
        str(root / ".dylibs" / "libscipy_openblas64_*.dylib"))
    if not libs:
      raise SystemExit(f"bench_step_blas: numpy {np.__version__} carries no scipy-openblas64 library")
    blas = ctypes.CDLL(libs[0])
    blas.scipy_openblas_get_config64_.restype = ctypes.c_char_p
    what = f"numpy's {blas.scipy_openblas_get_config64_().decode()}"
    return (_address(blas.scipy_cblas_sgemm64_), _address(blas.openblas_set_num_threads_local),
            0 if variant == "openblas-pool" else cores, False, what)
  per_call = 0 if variant.endswith("-pool") else cores
  if variant.startswith("onednn"):
    libs = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libdnnl.so*")))
    if not libs:
      raise SystemExit(f"bench_step_blas: no libdnnl in {sys.prefix}/lib: pip install onednn-cpu-gomp")
    dnnl = ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
    dnnl.dnnl_version.restype = ctypes.POINTER(ctypes.c_int * 3)
    v = dnnl.dnnl_version().contents
    return (_address(dnnl.dnnl_sgemm), _address(ctypes.CDLL("libgomp.so.1").omp_set_num_threads), per_call, True,
            f"oneDNN {v[0]}.{v[1]}.{v[2]} dnnl_sgemm, GNU OpenMP")
  try:  # mkl, mkl-pool: as the library finds and sets it up (remixer_t5/cpu_blas.py)
    sgemm, set_threads, what = cpu_blas.find_sgemm("mkl")
  except cpu_blas.Unavailable as e:
    raise SystemExit(f"bench_step_blas: {e}") from None
  return sgemm, set_threads, per_call, False, what


TRACED_CALLS = [0]  # custom calls put into traced programs so far (each trace of a product adds one)


# [M, K] x [K, N] test products: unblocked, cut by rows (M >= N) and by columns, into blocks that do not divide
# evenly; their gradients add the transposed cases (dX = dY W^T, dW = X^T dY).
CHECK_SHAPES = ((300, 70, 130), (1037, 256, 515), (515, 256, 1037))


def check_rel_err(matmul) -> float:
  """Largest relative difference of the products and both gradients from XLA's jnp.dot over CHECK_SHAPES."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(0)
  worst = 0.0
  for m, k, n in CHECK_SHAPES:
    x, w, g = (jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in ((m, k), (k, n), (m, n)))
    ours = jax.jit(lambda x, w, g: (matmul(x, w), *jax.vjp(matmul, x, w)[1](g)))(x, w, g)
    ref = jax.jit(lambda x, w, g: (jnp.dot(x, w), *jax.vjp(jnp.dot, x, w)[1](g)))(x, w, g)
    worst = max(worst, *(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(ours, ref)))
  return worst


def child(args) -> int:
  sys.path.insert(0, str(REPO))
  from remixer_t5 import bench_env, host_memory
  host_memory.configure()  # the CLI's malloc policy, before JAX starts threads
  bench_env.set_xla_flags(None)  # the CLI's CPU flag
  import jax

  from remixer_t5 import bench_train, cpu_blas, gin_utils
  row = {"variant": args.child, "config": args.config}
  if args.child != "xla":
    sgemm, set_threads, per_call, is_dnnl, what = load_blas(args.child)
    handler = ctypes.CDLL(args.handler)
    handler.remixer_set_blas(sgemm, set_threads, ctypes.c_int(per_call), ctypes.c_int(int(is_dnnl)))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler.RemixerSgemm), platform="cpu")
    matmul = cpu_blas.make_matmul(TARGET, on_trace=lambda: TRACED_CALLS.__setitem__(0, TRACED_CALLS[0] + 1))
    row.update(blas=what, threads_per_call=per_call or "blocks on XLA's pool",
               check_rel_err=check_rel_err(matmul))
    # layers.Dense's products through this variant's call: every float32 product, whatever its size
    cpu_blas.route, cpu_blas.applied, cpu_blas.MIN_FLOPS = matmul, True, 0
  bindings, batch, inputs, targets = CONFIGS[args.config]
  gin_utils.parse_gin(["models/t5_1_1/small.gin"], ["DROPOUT_RATE=0.0", *bindings])
  built = bench_train.from_gin(batch, {"inputs": inputs, "targets": targets})
  vocab = built["model"].module.config.vocab_size
  run = bench_train.ours(built["model"], built["optimizer"],
                         bench_train.random_batch(vocab, batch, {"inputs": inputs, "targets": targets}))
  load_start = bench_env.loadavg()
  TRACED_CALLS[0] = 0  # from here: the calls traced into the step (the model's init, above, traced some too)
  t0 = time.perf_counter()
  run()
  row["first_step_s"] = round(time.perf_counter() - t0, 2)
  if args.child != "xla":
    row["custom_calls_in_step"] = TRACED_CALLS[0]  # traced while the first step compiled
  times, _ = bench_train.time_calls(run, args.steps, args.warmup)
  row.update(step_s=round(statistics.median(times), 4), steps=args.steps, warmup=args.warmup,
             times=[round(t, 4) for t in times], tag=args.tag, **bench_env.environment(),
             load_average_start=load_start, load_average_end=bench_env.loadavg())
  print(json.dumps(row), flush=True)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", choices=sorted(CONFIGS), default="A")
  p.add_argument("--variants", default="xla,openblas-pool,mkl",
                 help=f"comma-separated, from {', '.join(VARIANTS)} (default: xla,openblas-pool,mkl)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--out", default=None, help="append the rows to this JSONL file")
  p.add_argument("--tag", default=None, help="a label copied into every row")
  p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
  p.add_argument("--handler", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for name in ("rounds", "steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name} {getattr(args, name)}: expected at least 1")
  if args.warmup < 0:
    p.error(f"--warmup {args.warmup}: expected 0 or more")
  if args.child:
    return child(args)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown or not variants or len(set(variants)) != len(variants):
    p.error(f"--variants {args.variants!r}: unknown {unknown} or repeated; expected some of {', '.join(VARIANTS)}, "
            "each once")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    handler = compile_handler(tmp) if set(variants) - {"xla"} else ""
    for r in range(args.rounds):
      for v in variants:
        cmd = [sys.executable, __file__, "--child", v, "--handler", handler, "--config", args.config,
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tag", args.tag] if args.tag else [])
        try:
          proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
          print(f"bench_step_blas: {v} did not finish in {CHILD_TIMEOUT_S} s", file=sys.stderr)
          return 1
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
          print(f"bench_step_blas: {v} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
          return 1
        row = json.loads(lines[-1])
        row["round"] = r + 1
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
          with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
  base = statistics.median(r["step_s"] for r in rows if r["variant"] == "xla") if "xla" in variants else None
  for v in variants:
    steps = [r["step_s"] for r in rows if r["variant"] == v]
    ratio = f", {statistics.median(steps) / base:.3f}x xla" if base else ""
    print(f"# {v}: median {statistics.median(steps):.4f} s/step over rounds {steps}{ratio}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
