"""remixer_t5/kernels/cpu/hypermixing.py: HyperMixing's causal and packed (segmented) forms as fused C++ loops on CPU.

The numerical checks run in a fresh process (custom calls are registered once per process, and the kernels run only
in a process with one JAX device) against numpy loops over every query (the equations themselves) and against the
layer's own XLA forms: the kernels called directly, and the layer's forms through `HyperMixing.impl` 'cpu' and
'auto' against 'xla'."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from subprocess_util import run_py, xla_flags

from remixer_t5.kernels.cpu import ffi
from remixer_t5.kernels.cpu import hypermixing as cpu_hypermixing

REPO = Path(__file__).resolve().parents[1]
HAS_CXX = bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="needs a C++ compiler (c++, g++ or $CXX)")


@pytest.fixture
def fresh(monkeypatch):
  """The module's process-wide state (nothing built or registered yet), restored after the test."""
  monkeypatch.setattr(cpu_hypermixing, "_state", {})
  return cpu_hypermixing


def _args(b=2, n=5, h=3, d=4, dtype=jnp.float32):
  w1, x, w2 = (jnp.ones(s, dtype) for s in ((b, n, h), (b, n, d), (b, n, h)))
  return w1, x, w2, jnp.ones((b, n), jnp.float32), jnp.ones((b, n), jnp.int32)


def test_other_dtypes_take_the_reference_without_building(fresh):
  calls = []
  reference = lambda *a: calls.append(len(a)) or "reference"
  args = _args(dtype=jnp.bfloat16)
  assert fresh.causal(*args, reference=reference, length_normalize=False) == "reference"
  assert fresh.segmented(*args[:4], args[4], args[4], reference=reference, length_normalize=True) == "reference"
  assert calls == [5, 6]  # each reference gets the kernel's own arguments
  assert fresh.usable("bfloat16") is False and fresh._state == {} and fresh.describe() is None  # nothing built


def test_a_layer_naming_the_cpu_kernel_in_bfloat16_computes_xla_and_says_so_once(fresh, monkeypatch, caplog):
  """HyperMixing.impl='cpu' in bfloat16: the C++ loops do not take it, so the layer computes XLA's form (the same
  output as impl='xla') and the registry logs it once; impl='auto' takes the same form without a word."""
  import logging

  import jax
  from remixer_t5 import kernels
  from remixer_t5.model.config import T5Config
  from remixer_t5.model.mixers import hypermixer

  monkeypatch.setattr(kernels, "_SAID", set())
  w1, x, w2, mask, seg = _args(dtype=jnp.bfloat16)
  outs = {}
  with caplog.at_level(logging.WARNING, logger="remixer_t5.kernels"):
    for impl in ("cpu", "cpu", "auto", "xla"):
      layer = hypermixer.HyperMixing(T5Config(dtype="bfloat16"), impl=impl)
      outs[impl] = jax.jit(lambda *a, layer=layer: layer._causal(*a))(w1, x, w2, mask, seg)
  said = [r.getMessage() for r in caplog.records]
  assert said == [
    "hypermixer.HyperMixing.impl='cpu': " + fresh.UNUSABLE + "; computing the plain-JAX reference "
    "(hypermixer.HyperMixing.impl='xla') there"
  ], said
  assert (outs["cpu"] == outs["xla"]).all() and (outs["auto"] == outs["xla"]).all()


@pytest.mark.skipif(not shutil.which("false"), reason="no `false` program to stand in for a failing compiler")
def test_a_failing_build_takes_the_reference_once_and_says_why(fresh, tmp_path, monkeypatch):
  monkeypatch.setenv("CXX", shutil.which("false"))
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(jax, "device_count", lambda *a: 1)  # the kernels' one-device condition, whatever this process has
  reference = lambda *a: "reference"
  assert fresh.causal(*_args(), reference=reference, length_normalize=False) == "reference"
  assert fresh.usable("float32") is False  # tried once: the failure is remembered
  assert (
    fresh.describe().startswith("XLA's forms (building hypermixing.cc with") and "failed (exit 1)" in fresh.describe()
  )
  assert list((tmp_path / "cpu_hypermixing").iterdir()) == []  # nothing half-written in the cache
  with pytest.raises(ffi.Unavailable, match=r"no C\+\+ compiler \(\$CXX='/nonexistent/cxx'"):
    fresh.build(environ={"CXX": "/nonexistent/cxx"}, out_dir=tmp_path)


def test_several_devices_take_the_reference_without_building(fresh, monkeypatch):
  monkeypatch.setattr(jax, "device_count", lambda *a: 2)
  assert fresh.causal(*_args(), reference=lambda *a: "reference", length_normalize=True) == "reference"
  assert fresh._state == {} and fresh.describe() is None


CHECK = """
import json, math, os
import jax, jax.numpy as jnp, numpy as np
from remixer_t5.model.config import T5Config
from remixer_t5.kernels.cpu import hypermixing as cpu_hypermixing
from remixer_t5.model.mixers.hypermixer import HyperMixing
import sys; sys.path.insert(0, "tests")
from jaxpr_util import lowered_for
# The kernels called directly (they must not hand back to the reference), unless CHECK_DIRECT=0; the layer's forms.
KERNELS = ("direct", "cpu", "auto") if os.environ.get("CHECK_DIRECT", "1") == "1" else ("cpu", "auto")


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


def layer(impl, length_normalize):
  # HyperMixing's causal and packed forms through `impl`, unbound (they read only the module's fields).
  mixer = HyperMixing(T5Config(dtype="float32"), length_normalize=length_normalize, chunk_size=8, segment_block=4,
                      impl=impl)
  return mixer._causal, mixer._segmented


def unused(*args):
  raise AssertionError("the kernel handed back to the reference")


rng = np.random.default_rng(0)
results = []
for b, n, h, d, block, ln in ((3, 37, 20, 16, 8, True), (1, 9, 7, 5, 1, False), (5, 26, 12, 24, 3, False),
                              (2, 40, 16, 8, 64, True)):
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
  # The kernel called directly (with this case's checkpoint block), and the layer's form through impl='cpu'
  # (the default block) and 'auto', against impl='xla' (the chunked scan).
  direct = lambda *a: cpu_hypermixing.causal(*a, reference=unused, length_normalize=ln, block=block)
  forms = {"direct": direct, **{impl: layer(impl, ln)[0] for impl in ("cpu", "auto", "xla")}}
  forms = {k: f for k, f in forms.items() if k in KERNELS + ("xla",)}
  def with_grads(f):
    def run(w1, x, w2):
      out, vjp = jax.vjp(lambda a, c, e: f(a, c, e, jnp.asarray(mask), jnp.asarray(seg)), w1, x, w2)
      return (out, *vjp(jnp.asarray(g)))
    return jax.jit(run)(jnp.asarray(w1), jnp.asarray(x), jnp.asarray(w2))
  got = {name: with_grads(f) for name, f in forms.items()}
  rel = lambda a, c: float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(c)))
  exact = numpy_causal(w1, x, w2, mask, seg, ln)
  def calls(f, platform):
    hlo = jax.jit(jax.grad(lambda a: jnp.sum(f(a, jnp.asarray(x), jnp.asarray(w2), jnp.asarray(mask),
                                                   jnp.asarray(seg)))))
    return lowered_for(platform, hlo, jnp.asarray(w1)).count("@remixer_hypermixing_causal")
  results.append({"case": [b, n, h, d, block, ln], "scan_vs_numpy": rel(got["xla"][0], exact),
                  **{f"{k}_vs_numpy": rel(got[k][0], exact) for k in KERNELS},
                  **{f"{k}_vs_scan": [rel(a, c) for a, c in zip(got[k], got["xla"])] for k in KERNELS},
                  "cpu_calls": {k: calls(f, "cpu") for k, f in forms.items()},
                  "tpu_calls": calls(forms["auto"], "tpu"),
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
  args = [jnp.asarray(a) for a in (mask, q_seg, kv_seg)]
  direct = lambda *a: cpu_hypermixing.segmented(*a, reference=unused, length_normalize=ln)
  forms = {"direct": direct, **{impl: layer(impl, ln)[1] for impl in ("cpu", "auto", "xla")}}
  forms = {k: f for k, f in forms.items() if k in KERNELS + ("xla",)}
  def with_grads(f):
    def run(w1, x, w2):
      out, vjp = jax.vjp(lambda a, c, e: f(a, c, e, *args), w1, x, w2)
      return (out, *vjp(jnp.asarray(g)))
    return jax.jit(run)(jnp.asarray(w1), jnp.asarray(x), jnp.asarray(w2))
  got = {name: with_grads(f) for name, f in forms.items()}
  rel = lambda a, c: float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(c)))
  exact = numpy_segmented(w1, x, w2, mask, q_seg, kv_seg, ln)
  def calls(f, platform):
    hlo = jax.jit(jax.value_and_grad(lambda a: jnp.sum(f(a, jnp.asarray(x), jnp.asarray(w2), *args))))
    return lowered_for(platform, hlo, jnp.asarray(w1)).count("@remixer_hypermixing_segmented")
  segmented.append({"case": [b, nq, nk, h, d, ln], "xla_vs_numpy": rel(got["xla"][0], exact),
                    **{f"{k}_vs_numpy": rel(got[k][0], exact) for k in KERNELS},
                    **{f"{k}_vs_xla": [rel(a, c) for a, c in zip(got[k], got["xla"])] for k in KERNELS},
                    "cpu_calls": {k: calls(f, "cpu") for k, f in forms.items()},
                    "tpu_calls": calls(forms["auto"], "tpu")})
print(json.dumps({"devices": jax.device_count(), "describe": cpu_hypermixing.describe(), "results": results,
                  "segmented": segmented}))
"""


@needs_cxx
def test_kernels_match_the_equations_and_xla_and_tpu_keeps_xla():
  proc = run_py(CHECK, {})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["devices"] == 1 and r["describe"] == "fused C++ loops via FFI"
  built = Path(os.environ["REMIXER_T5_CACHE_DIR"]) / "cpu_hypermixing"  # the run's cache (tests/conftest.py)
  assert len(list(built.glob("hypermixing-*.so"))) == 1  # built into $REMIXER_T5_CACHE_DIR, once
  for case in r["results"]:
    # Packed rows (segments restart the sum, padding adds nothing), length normalisation on and off, lengths
    # that are not a multiple of the block, blocks of 1 and longer than the row, more rows than threads.
    assert case["state_max"] > 5, case  # states large enough to reach the GELU's tails
    assert case["scan_vs_numpy"] < 2e-6, case
    for form in ("direct", "cpu", "auto"):
      assert case[f"{form}_vs_numpy"] < 2e-6, (form, case)
      assert max(case[f"{form}_vs_scan"]) < 2e-6, (form, case)  # output, dW1, dX, dW2
    # Under grad a CPU program through the kernel calls its forward and its backward once each; impl='xla', and
    # 'auto' lowered for a TPU, have neither.
    assert case["cpu_calls"] == {"direct": 2, "cpu": 2, "auto": 2, "xla": 0} and case["tpu_calls"] == 0, case
  for case in r["segmented"]:
    # Packed rows of 1-4 examples, ids with keys but no queries and with queries but no keys, padding on both
    # sides, queries longer and shorter than the keys, length normalisation on and off.
    assert case["xla_vs_numpy"] < 2e-6, case
    for form in ("direct", "cpu", "auto"):
      assert case[f"{form}_vs_numpy"] < 2e-6, (form, case)
      assert max(case[f"{form}_vs_xla"]) < 2e-6, (form, case)  # output, dW1, dX, dW2
    assert case["cpu_calls"] == {"direct": 2, "cpu": 2, "auto": 2, "xla": 0} and case["tpu_calls"] == 0, case


@pytest.mark.integration
@needs_cxx
def test_several_devices_keep_xlas_forms(tmp_path):
  """With two JAX devices (a custom call cannot be partitioned) impl 'cpu' and 'auto' compute XLA's forms, the
  same numbers as impl='xla', and nothing is built."""
  proc = run_py(
    CHECK,
    {
      "REMIXER_T5_CACHE_DIR": str(tmp_path),
      "CHECK_DIRECT": "0",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    },
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["devices"] == 2 and r["describe"] is None
  assert all(
    c["cpu_calls"] == {"cpu": 0, "auto": 0, "xla": 0}
    and c["cpu_vs_scan"] == [0.0] * 4
    and c["auto_vs_scan"] == [0.0] * 4
    for c in r["results"]
  )
  assert all(c["cpu_calls"] == {"cpu": 0, "auto": 0, "xla": 0} and c["cpu_vs_xla"] == [0.0] * 4 for c in r["segmented"])
  assert not list(tmp_path.glob("**/*.so"))  # never needed, never built


TRAIN = """
import json, jax, jax.numpy as jnp, numpy as np
from remixer_t5.bench import train as bench_train
from remixer_t5 import gin_utils
from remixer_t5.training import mfu, programs
lengths = {"inputs": 24, "targets": 20}
shapes = programs.batch_shapes(lengths, 4, pack=True)  # model FLOPs drop the segment ids: the causal kernel's case

def build(impl):
  # The model with HyperMixing.impl bound in gin, traced and lowered while that config is in force.
  gin_utils.parse_gin(["models/hypermixer/tiny.gin"], ["DROPOUT_RATE=0.0", f"hypermixer.HyperMixing.impl='{impl}'"])
  model = bench_train.from_gin(4, lengths)["model"]
  step = jax.jit(jax.value_and_grad(lambda p, batch: model.loss_fn(p, batch, None)[0]))
  return model, step

model, _ = build("xla")
batch = bench_train.random_batch(model.module.config.vocab_size, 4, lengths)
params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
ids = lambda n, cuts: np.searchsorted(np.asarray(cuts), np.arange(n), side="right").astype(np.int32)
pos = lambda seg: np.array([i - np.argmax(seg == s) for i, s in enumerate(seg)], np.int32)  # from each start
es, ds = ids(24, [0, 9, 17, 22]), ids(20, [0, 7, 15, 19])  # 3 examples a row, then padding (id 4 -> 0)
es[es == 4], ds[ds == 4] = 0, 0
batch.update(encoder_segment_ids=np.tile(es, (4, 1)), decoder_segment_ids=np.tile(ds, (4, 1)),
             encoder_positions=np.tile(pos(es), (4, 1)), decoder_positions=np.tile(pos(ds), (4, 1)))
batch = {k: jnp.asarray(v) for k, v in batch.items()}
out = {}
for impl in ("xla", "cpu", "auto"):
  model, step = build(impl)
  loss, grads = step(params, batch)
  hlo = step.lower(params, batch).as_text()
  out[impl] = {"loss": float(loss), "grads": grads, "flops": mfu.model_flops_per_step(model, shapes),
               "calls": hlo.count("@remixer_hypermixing_causal"),
               "segmented": hlo.count("@remixer_hypermixing_segmented")}
ref_grads = out["xla"]["grads"]
worst = lambda g: max(jax.tree.leaves(jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)), g, ref_grads)))
for impl in out:
  out[impl]["worst_grad"] = worst(out[impl].pop("grads"))
print(json.dumps(out))
"""


@pytest.mark.integration
@needs_cxx
def test_hypermixer_loss_and_gradients_match_xla():
  """A HyperMixer tiny train step on packed rows with HyperMixing.impl 'cpu' and 'auto' (gin): its loss and every
  parameter's gradient through the kernels (causal decoder self-mixing; segmented encoder self-mixing and
  cross-mixing) match impl='xla', whose program calls no kernel. (`make test` checks each kernel's output and
  gradients against XLA's forms and the equations: test_kernels_match_the_equations_and_xla_and_tpu_keeps_xla.)"""
  proc = run_py(TRAIN, {})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["xla"]["calls"] == r["xla"]["segmented"] == 0 and r["xla"]["worst_grad"] == 0.0, r
  for impl in ("cpu", "auto"):
    # forward and backward in each of the 2 decoder layers; and in the 2 encoder layers and 2 cross slots
    assert r[impl]["calls"] >= 4 and r[impl]["segmented"] >= 8, r
    assert abs(r[impl]["loss"] - r["xla"]["loss"]) <= 1e-5 * abs(r["xla"]["loss"]), r
    assert r[impl]["worst_grad"] < 1e-4, r
    # XLA's cost analysis counts a custom call as no FLOPs: model FLOPs are counted on XLA's forms (flop_count.py)
    assert r[impl]["flops"] == r["xla"]["flops"] > 0, r


def _gcc() -> str | None:
  """The compiler ffi.py would build with, if it is GCC."""
  try:
    cxx = ffi.compiler(os.environ, cpu_hypermixing.SOURCE)
  except ffi.Unavailable:
    return None
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  return cxx if ("GCC" in version or "Free Software Foundation" in version) else None


@pytest.mark.skipif(
  not (_gcc() and __import__("platform").machine() == "x86_64"), reason="needs GCC on x86-64 (its -fopt-info report)"
)
def test_every_simd_loop_vectorises_with_avx2(tmp_path):
  """Every `#pragma omp simd` loop of csrc/hypermixing.cc is vectorised under the module's flags for an AVX2 CPU
  (-march=x86-64-v3 for -march=native, whatever CPU runs this): GCC's report names a vectorised loop within 3
  lines of each pragma. Without -fno-trapping-math the GELU loops of the causal forward and the segmented form
  ran scalar on AVX2 CPUs (AVX-512's masks hid it)."""
  import re

  import jax

  flags = [
    ("-march=x86-64-v3" if f == "-march=native" else f)
    for f in cpu_hypermixing.flags()
    if not f.startswith("-mprefer-vector-width")
  ]
  source = cpu_hypermixing.SOURCE
  proc = subprocess.run(
    [
      _gcc(),
      *flags,
      "-std=c++17",
      "-shared",
      "-fPIC",
      "-w",
      f"-I{source.parent}",
      f"-I{jax.ffi.include_dir()}",
      "-fopt-info-vec-optimized",
      str(source),
      "-o",
      str(tmp_path / "h.so"),
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  done = {
    int(m)
    for m in re.findall(re.escape(source.name) + r":(\d+):\d+: optimized: loop vectorized", proc.stdout + proc.stderr)
  }
  pragmas = [i for i, line in enumerate(source.read_text().splitlines(), 1) if "#pragma omp simd" in line]
  assert len(pragmas) >= 8
  scalar = [p for p in pragmas if not any(p <= v <= p + 3 for v in done)]
  assert not scalar, f"#pragma omp simd loops GCC left scalar at lines {scalar} of {source.name}"


@pytest.mark.integration
@needs_cxx
def test_the_cli_runs_the_kernels_for_a_hypermixer_run(tmp_path, embedded_cache):
  """`remixer-t5 train` of a HyperMixer on packed demo rows, in a one-device CPU process, with the config's
  default HyperMixing.impl ('auto'): the start line says the kernels are chosen by platform, the run builds the
  CPU kernels (the first program that needs them), trains and checkpoints."""
  model_dir = tmp_path / "run"
  cache = tmp_path / "cache"
  shutil.copytree(embedded_cache.root, cache)  # the embedded corpus, and no kernel built yet
  cmd = [
    sys.executable,
    "-m",
    "remixer_t5",
    "train",
    "--gin_file=models/hypermixer/tiny.gin",
    "--gin_file=runs/demo.gin",
    "--gin.BATCH_SIZE=4",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 16}",
    "--gin.network.T5Config.emb_dim=32",
    "--gin.network.T5Config.mlp_dim=48",
    "--gin.LOG_PERIOD=2",
    "--gin.EVAL_PERIOD=0",
    "--gin.TRAIN_STEPS=4",
    f"--gin.MODEL_DIR={model_dir}",
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "REMIXER_T5_CACHE_DIR": str(cache)}
  env["XLA_FLAGS"] = xla_flags()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "remixer-t5 train: 1 cpu device(s)" in proc.stderr and "kernels: auto (by platform)" in proc.stderr, (
    proc.stderr[-3000:]
  )
  rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if r.get("split") == "train"]
  assert losses and all(0 < loss < 100 for loss in losses)
  assert len(list((cache / "cpu_hypermixing").glob("hypermixing-*.so"))) == 1
