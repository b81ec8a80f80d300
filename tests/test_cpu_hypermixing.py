"""remixer_t5/cpu_hypermixing.py: HyperMixing's causal and packed (segmented) forms as fused C++ loops on CPU.

The numerical checks run in a fresh process (custom calls are registered once per process, and the suite's own
processes have 8 host devices, where the kernels are off by design) against numpy loops over every query (the
equations themselves) and against the layer's own XLA forms."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_util import run_py, xla_flags

from remixer_t5 import cpu_hypermixing

REPO = Path(__file__).resolve().parents[1]
HAS_CXX = bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="needs a C++ compiler (c++, g++ or $CXX)")


@pytest.fixture
def fresh(monkeypatch):
  """The module's process-wide state, restored after the test."""
  for name, value in (("armed", False), ("mode", "off"), ("_log", None), ("_environ", None), ("_state", {})):
    monkeypatch.setattr(cpu_hypermixing, name, value)
  return cpu_hypermixing


def test_bad_mode_off_and_non_cpu_runs(fresh):
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPU_HYPERMIXING='fast': expected one of auto, on, off"):
    fresh.configure(environ={"REMIXER_T5_CPU_HYPERMIXING": "fast"}, cpu_only=True)
  assert fresh.configure(environ={"REMIXER_T5_CPU_HYPERMIXING": "off"}, cpu_only=True) is False
  assert fresh.configure(environ={"REMIXER_T5_CPU_HYPERMIXING": "on"}, cpu_only=False) is False  # TPU or GPU
  assert fresh.armed is False and fresh.describe() is None
  assert fresh.usable("float32") is False  # not armed: the scan, and nothing is built


@pytest.mark.skipif(not shutil.which("false"), reason="no `false` program to stand in for a failing compiler")
def test_failing_build_falls_back_in_one_line_or_is_an_error(fresh, tmp_path):
  env = {"CXX": shutil.which("false"), "REMIXER_T5_CACHE_DIR": str(tmp_path)}
  logs = []
  assert fresh.configure(log=logs.append, environ=env, cpu_only=True) is True  # armed; built when first needed
  assert fresh._register() is False and fresh._register() is False  # tried once
  assert len([m for m in logs if "XLA's forms" in m]) == 1
  assert logs[-1].startswith("HyperMixing: XLA's forms (building hypermixing.cc with") and \
      "failed (exit 1)" in logs[-1]
  assert list((tmp_path / "cpu_hypermixing").iterdir()) == []  # nothing half-written in the cache
  fresh._state.clear()
  assert fresh.configure(environ={**env, "REMIXER_T5_CPU_HYPERMIXING": "on"}, cpu_only=True) is True
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPU_HYPERMIXING=on: building hypermixing.cc .* failed"):
    fresh._register()
  with pytest.raises(fresh.cpu_ffi.Unavailable, match=r"no C\+\+ compiler \(\$CXX='/nonexistent/cxx'"):
    fresh.build(environ={"CXX": "/nonexistent/cxx"}, out_dir=tmp_path)


CHECK = """
import json, math, types
import jax, jax.numpy as jnp, numpy as np
from remixer_t5 import cpu_hypermixing
from remixer_t5.mixers import hypermixer
logs = []
armed = cpu_hypermixing.configure(log=logs.append)


def numpy_causal(w1, x, w2, mask, seg, length_normalize):
  # The equation over every prefix: out_i = W2[i] GELU(sum_{j<=i, same segment, real} W1[j]^T x_j (/ count)).
  erf = np.vectorize(math.erf)
  b, n, _ = w1.shape
  out = np.zeros(x.shape)
  for r in range(b):
    for i in range(n):
      j0 = i
      while j0 > 0 and seg[r, j0 - 1] == seg[r, i]:
        j0 -= 1
      m = mask[r, j0:i + 1].astype(np.float64)
      s = np.einsum("j,jh,jd->hd", m, w1[r, j0:i + 1], x[r, j0:i + 1])
      if length_normalize:
        s = s / max(m.sum(), 1.0)
      out[r, i] = w2[r, i] @ (0.5 * s * (1 + erf(s / math.sqrt(2))))
  return out


def numpy_segmented(w1, x, w2, mask, q_seg, kv_seg, length_normalize):
  # Query i of id >= 1 reads GELU(sum_{j: kv id = its id} m_j W1[j]^T x_j (/ sum m_j)); padding queries read 0.
  erf = np.vectorize(math.erf)
  out = np.zeros((w2.shape[0], w2.shape[1], x.shape[-1]))
  for r in range(w2.shape[0]):
    for i in range(w2.shape[1]):
      if q_seg[r, i] < 1:
        continue
      m = mask[r] * (kv_seg[r] == q_seg[r, i])
      s = np.einsum("j,jh,jd->hd", m.astype(np.float64), w1[r], x[r])
      if length_normalize:
        s = s / max(m.sum(), 1.0)
      out[r, i] = w2[r, i] @ (0.5 * s * (1 + erf(s / math.sqrt(2))))
  return out


def segmented_layer(length_normalize, segment_block=4):
  self = types.SimpleNamespace(segment_block=segment_block, length_normalize=length_normalize,
                               config=types.SimpleNamespace(dtype="float32"))
  self._block_segmented = lambda *a: hypermixer.HyperMixing._block_segmented(self, *a)
  return (lambda *a: hypermixer.HyperMixing._segmented(self, *a)), self._block_segmented


def layer(length_normalize, chunk_size=8):
  self = types.SimpleNamespace(chunk_size=chunk_size, length_normalize=length_normalize,
                               config=types.SimpleNamespace(dtype="float32"))
  self._scan_causal = lambda *a: hypermixer.HyperMixing._scan_causal(self, *a)
  return (lambda *a: hypermixer.HyperMixing._causal(self, *a)), self._scan_causal


rng = np.random.default_rng(0)
results = []
for b, n, h, d, block, ln in ((3, 37, 20, 16, 8, True), (1, 9, 7, 5, 1, False), (5, 26, 12, 24, 3, False),
                              (2, 40, 16, 8, 64, True)):
  cpu_hypermixing.BLOCK = block
  seg = np.zeros((b, n), np.int32)
  for r in range(b):  # packed rows: segments of random lengths, then padding (id 0)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False))
    for k, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, n])):
      seg[r, lo:hi] = k + 1
    seg[r, n - 1 - r % 3:] = 0
  mask = (seg > 0).astype(np.float32)
  w1 = (rng.standard_normal((b, n, h)) * 1.5).astype(np.float32) * mask[..., None]
  w2 = rng.standard_normal((b, n, h)).astype(np.float32)
  x = rng.standard_normal((b, n, d)).astype(np.float32)
  g = rng.standard_normal((b, n, d)).astype(np.float32)
  fn, scan = layer(ln)
  def with_grads(f):
    def run(w1, x, w2):
      out, vjp = jax.vjp(lambda a, c, e: f(a, c, e, jnp.asarray(mask), jnp.asarray(seg)), w1, x, w2)
      return (out, *vjp(jnp.asarray(g)))
    return jax.jit(run)(jnp.asarray(w1), jnp.asarray(x), jnp.asarray(w2))
  ours, ref = with_grads(fn), with_grads(scan)
  rel = lambda a, c: float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(c)))
  exact = numpy_causal(w1, x, w2, mask, seg, ln)
  hlo = jax.jit(jax.grad(lambda a: jnp.sum(fn(a, jnp.asarray(x), jnp.asarray(w2), jnp.asarray(mask),
                                               jnp.asarray(seg)))))
  lowered = hlo.trace(jnp.asarray(w1))
  results.append({"case": [b, n, h, d, block, ln], "vs_numpy": rel(ours[0], exact),
                  "scan_vs_numpy": rel(ref[0], exact), "vs_scan": [rel(a, c) for a, c in zip(ours, ref)],
                  "cpu_calls": lowered.lower().as_text().count("@remixer_hypermixing_causal"),
                  "tpu_calls": lowered.lower(lowering_platforms=("tpu",)).as_text().count("remixer_hypermixing"),
                  "state_max": float(np.max(np.abs(np.cumsum(w1[..., :, None] * x[..., None, :], axis=1))))})
segmented = []
for b, nq, nk, h, d, ln in ((3, 29, 13, 10, 6, False), (2, 40, 40, 16, 8, True), (1, 7, 30, 5, 12, True)):
  q_seg, kv_seg = np.zeros((b, nq), np.int32), np.zeros((b, nk), np.int32)
  for r in range(b):  # ids 1..k in order on both sides (as seqio packs), some without queries or keys, padding
    k = 1 + r % 4
    q_seg[r, :nq - 2] = 1 + np.arange(nq - 2) * k // (nq - 2)
    kv_seg[r, :nk - 1] = 1 + np.arange(nk - 1) * (k + 1) // (nk - 1)  # one more id than the queries have
    kv_seg[r, kv_seg[r] == 2] = 0 if r == 1 else 2  # row 1: id 2 has queries but no keys
  mask = (kv_seg > 0).astype(np.float32)
  w1 = (rng.standard_normal((b, nk, h)) * 1.5).astype(np.float32) * mask[..., None]
  w2 = rng.standard_normal((b, nq, h)).astype(np.float32)
  x = rng.standard_normal((b, nk, d)).astype(np.float32)
  g = rng.standard_normal((b, nq, d)).astype(np.float32)
  fn, blocks = segmented_layer(ln)
  args = [jnp.asarray(a) for a in (mask, q_seg, kv_seg)]
  def with_grads(f):
    def run(w1, x, w2):
      out, vjp = jax.vjp(lambda a, c, e: f(a, c, e, *args), w1, x, w2)
      return (out, *vjp(jnp.asarray(g)))
    return jax.jit(run)(jnp.asarray(w1), jnp.asarray(x), jnp.asarray(w2))
  ours, ref = with_grads(fn), with_grads(blocks)
  rel = lambda a, c: float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(c)))
  lowered = jax.jit(jax.value_and_grad(lambda a: jnp.sum(fn(a, jnp.asarray(x), jnp.asarray(w2), *args)))).trace(
      jnp.asarray(w1))
  segmented.append({"case": [b, nq, nk, h, d, ln], "vs_numpy": rel(ours[0], numpy_segmented(w1, x, w2, mask, q_seg, kv_seg, ln)),
                    "vs_xla": [rel(a, c) for a, c in zip(ours, ref)],
                    "cpu_calls": lowered.lower().as_text().count("@remixer_hypermixing_segmented"),
                    "tpu_calls": lowered.lower(lowering_platforms=("tpu",)).as_text().count("remixer_hypermixing")})
print(json.dumps({"armed": armed, "logs": logs, "devices": jax.device_count(), "describe": cpu_hypermixing.describe(),
                  "results": results, "segmented": segmented}))
"""


@needs_cxx
def test_kernel_matches_the_equation_and_the_scan_and_tpu_keeps_the_scan(tmp_path):
  proc = run_py(CHECK, {"REMIXER_T5_CPU_HYPERMIXING": "on", "REMIXER_T5_CACHE_DIR": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["armed"] is True and r["devices"] == 1 and r["describe"] == "fused C++ loops via FFI"
  assert any("building hypermixing.cc" in m for m in r["logs"])  # built into the given cache, once
  assert len(list((tmp_path / "cpu_hypermixing").glob("hypermixing-*.so"))) == 1
  for case in r["results"]:
    # Packed rows (segments restart the sum, padding adds nothing), length normalisation on and off, lengths
    # that are not a multiple of the block, blocks of 1 and longer than the row, more rows than threads.
    assert case["state_max"] > 5, case  # states large enough to reach the GELU's tails
    assert case["vs_numpy"] < 2e-6 and case["scan_vs_numpy"] < 2e-6, case
    assert max(case["vs_scan"]) < 2e-6, case  # output, dW1, dX, dW2
    # Under grad the CPU program calls the forward and the backward once each; a TPU lowering has neither.
    assert case["cpu_calls"] == 2 and case["tpu_calls"] == 0, case
  for case in r["segmented"]:
    # Packed rows of 1-4 examples, ids with keys but no queries and with queries but no keys, padding on both
    # sides, queries longer and shorter than the keys, length normalisation on and off.
    assert case["vs_numpy"] < 2e-6, case
    assert max(case["vs_xla"]) < 2e-6, case  # output, dW1, dX, dW2
    assert case["cpu_calls"] == 2 and case["tpu_calls"] == 0, case


@pytest.mark.integration
@needs_cxx
def test_several_devices_keep_the_scan(tmp_path):
  proc = run_py(CHECK, {"REMIXER_T5_CPU_HYPERMIXING": "on", "REMIXER_T5_CACHE_DIR": str(tmp_path),
                        "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["armed"] is True and r["devices"] == 2 and r["describe"] is None
  assert all(c["cpu_calls"] == 0 and c["vs_scan"] == [0.0] * 4 for c in r["results"])
  assert all(c["cpu_calls"] == 0 and c["vs_xla"] == [0.0] * 4 for c in r["segmented"])
  assert not list(tmp_path.glob("**/*.so"))  # never needed, never built


TRAIN = """
import json, jax, jax.numpy as jnp, numpy as np
from remixer_t5 import bench_train, cpu_hypermixing, gin_utils
armed = cpu_hypermixing.configure()
gin_utils.parse_gin(["models/hypermixer/tiny.gin"], ["DROPOUT_RATE=0.0"])
lengths = {"inputs": 24, "targets": 20}
built = bench_train.from_gin(4, lengths)
model = built["model"]
batch = bench_train.random_batch(model.module.config.vocab_size, 4, lengths)
params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
ids = lambda n, cuts: np.searchsorted(np.asarray(cuts), np.arange(n), side="right").astype(np.int32)
pos = lambda seg: np.array([i - np.argmax(seg == s) for i, s in enumerate(seg)], np.int32)  # from each start
es, ds = ids(24, [0, 9, 17, 22]), ids(20, [0, 7, 15, 19])  # 3 examples a row, then padding (id 4 -> 0)
es[es == 4], ds[ds == 4] = 0, 0
batch.update(encoder_segment_ids=np.tile(es, (4, 1)), decoder_segment_ids=np.tile(ds, (4, 1)),
             encoder_positions=np.tile(pos(es), (4, 1)), decoder_positions=np.tile(pos(ds), (4, 1)))
batch = {k: jnp.asarray(v) for k, v in batch.items()}
step = lambda: jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0]))
cpu_hypermixing.armed = False
ref_loss, ref_grads = step()(params)
cpu_hypermixing.armed = armed
loss, grads = step()(params)
hlo = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, None)[0])).lower(params).as_text()
diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)),
                                     grads, ref_grads))
from remixer_t5 import mfu, trainer
shapes = trainer.batch_shapes(lengths, 4, pack=True)  # model FLOPs drop the segment ids: the causal kernel's case
cpu_hypermixing.armed = False
ref_flops = mfu.model_flops_per_step(model, shapes)
cpu_hypermixing.armed = armed
flops = mfu.model_flops_per_step(model, shapes)
print(json.dumps({"armed": armed, "loss": float(loss), "ref_loss": float(ref_loss), "worst_grad": max(diffs),
                  "calls": hlo.count("@remixer_hypermixing_causal"), "segmented": hlo.count("@remixer_hypermixing_segmented"),
                  "flops": flops, "ref_flops": ref_flops}))
"""


@needs_cxx
def test_hypermixer_loss_and_gradients_match_the_scan(tmp_path):
  """A HyperMixer tiny train step on packed rows: its loss and every parameter's gradient through the kernels
  (causal decoder self-mixing; segmented encoder self-mixing and cross-mixing) match XLA's forms."""
  proc = run_py(TRAIN, {"REMIXER_T5_CPU_HYPERMIXING": "on", "REMIXER_T5_CACHE_DIR": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  # forward and backward in each of the 2 decoder layers; and in the 2 encoder layers and 2 cross slots
  assert r["armed"] is True and r["calls"] >= 4 and r["segmented"] >= 8, r
  assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
  assert r["worst_grad"] < 1e-4
  # XLA's cost analysis counts a custom call as no FLOPs: model FLOPs are counted on the scan (flop_count.py)
  assert r["flops"] == r["ref_flops"] > 0, r


def _gcc() -> str | None:
  """The compiler cpu_ffi would build with, if it is GCC."""
  from remixer_t5 import cpu_ffi
  try:
    cxx = cpu_ffi.compiler(os.environ, cpu_hypermixing.SOURCE)
  except cpu_ffi.Unavailable:
    return None
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  return cxx if ("GCC" in version or "Free Software Foundation" in version) else None


@pytest.mark.skipif(not (_gcc() and __import__("platform").machine() == "x86_64"),
                    reason="needs GCC on x86-64 (its -fopt-info report)")
def test_every_simd_loop_vectorises_with_avx2(tmp_path):
  """Every `#pragma omp simd` loop of csrc/hypermixing.cc is vectorised under the module's flags for an AVX2 CPU
  (-march=x86-64-v3 for -march=native, whatever CPU runs this): GCC's report names a vectorised loop within 3
  lines of each pragma. Without -fno-trapping-math the GELU loops of the causal forward and the segmented form
  ran scalar on AVX2 CPUs (AVX-512's masks hid it), 5.6x slower on a Zen 3."""
  import re

  import jax
  flags = [("-march=x86-64-v3" if f == "-march=native" else f) for f in cpu_hypermixing.flags()
           if not f.startswith("-mprefer-vector-width")]
  source = cpu_hypermixing.SOURCE
  proc = subprocess.run([_gcc(), *flags, "-std=c++17", "-shared", "-fPIC", "-w", f"-I{source.parent}",
                         f"-I{jax.ffi.include_dir()}", "-fopt-info-vec-optimized", str(source), "-o",
                         str(tmp_path / "h.so")], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  done = {int(m) for m in re.findall(re.escape(source.name) + r":(\d+):\d+: optimized: loop vectorized",
                                      proc.stdout + proc.stderr)}
  pragmas = [i for i, line in enumerate(source.read_text().splitlines(), 1) if "#pragma omp simd" in line]
  assert len(pragmas) >= 8
  scalar = [p for p in pragmas if not any(p <= v <= p + 3 for v in done)]
  assert not scalar, f"#pragma omp simd loops GCC left scalar at lines {scalar} of {source.name}"


@pytest.mark.integration
@needs_cxx
def test_benchmark_script_runs_both_variants(tmp_path):
  """scripts/bench_hypermixing_cpu.py (docs/benchmarks.md's figures) on its tiny config: every measurement in both
  variants, the kernel variants' programs calling the kernels and XLA's not, rows appended to --out."""
  out = tmp_path / "rows.jsonl"
  proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_hypermixing_cpu.py"), "--config", "tiny",
                         "--rounds", "1", "--steps", "1", "--warmup", "0", "--out", str(out)],
                        capture_output=True, text=True, timeout=600, cwd=REPO,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "REMIXER_T5_CACHE_DIR": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["measurement"], r["variant"]) for r in rows} == {
      (m, v) for m in ("layer", "step_packed", "step_unpacked") for v in ("kernel", "xla")}
  for r in rows:
    assert r["median_s"] > 0 and r["cpu_hypermixing"] == "fused C++ loops via FFI" and r["git_commit"]
    assert (r["kernel_calls"] > 0) == (r["variant"] == "kernel"), r
  assert [r["kernel_calls"] for r in rows if r["variant"] == "kernel" and r["measurement"] == "step_packed"] == [12]
  assert proc.stdout.count("kernel/XLA") == 3


@pytest.mark.integration
@needs_cxx
def test_the_cli_arms_the_kernels_for_a_hypermixer_run(tmp_path, embedded_cache):
  """`remixer-t5 train` of a HyperMixer on packed demo rows, in a one-device CPU process: the CLI arms the
  kernels, builds them once, says so in one line, and the run trains and checkpoints."""
  model_dir = tmp_path / "run"
  cmd = [sys.executable, "-m", "remixer_t5", "train", "--gin_file=models/hypermixer/tiny.gin",
         "--gin_file=runs/demo.gin", "--gin.BATCH_SIZE=4", "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 16}",
         "--gin.network.T5Config.emb_dim=32", "--gin.network.T5Config.mlp_dim=48", "--gin.LOG_PERIOD=2",
         "--gin.EVAL_PERIOD=0", "--gin.TRAIN_STEPS=4", f"--gin.MODEL_DIR={model_dir}"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "REMIXER_T5_CACHE_DIR": str(embedded_cache.root),
         "REMIXER_T5_CPU_HYPERMIXING": "auto"}
  env["XLA_FLAGS"] = xla_flags()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert sum("HyperMixing: fused C++ loops on CPU" in line for line in lines) == 1, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if r.get("split") == "train"]
  assert losses and all(0 < loss < 100 for loss in losses)
  assert list((embedded_cache.root / "cpu_hypermixing").glob("hypermixing-*.so"))
