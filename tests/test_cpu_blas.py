"""remixer_t5/cpu_blas.py: layers.Dense's products through MKL's sgemm on CPU-only runs (the `.[mkl]` extra).

The numerical checks run in a fresh process (a custom call is registered once per process, and the suite's own
processes have 8 host devices, where the route is off by design) against XLA's own jnp.dot."""
import json
import os
import shutil
import sys

import pytest
from subprocess_util import run_py

from remixer_t5 import cpu_blas

HAS_CXX = bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))


def _available() -> list[str]:
  try:
    cpu_blas._lib(cpu_blas.MKL_LIB, cpu_blas.MKL_PACKAGE)  # installed (not loaded into the test process)
    return ["mkl"]
  except cpu_blas.Unavailable:
    return []


AVAILABLE = _available()
needs_backend = pytest.mark.skipif(not (HAS_CXX and AVAILABLE),
                                   reason="needs a C++ compiler and MKL in this venv (pip install -e '.[mkl]')")


def test_bad_mode_and_off_and_non_cpu_runs():
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPU_BLAS='blas': expected one of auto, mkl, off"):
    cpu_blas.configure(environ={"REMIXER_T5_CPU_BLAS": "blas"}, cpu_only=True)
  assert cpu_blas.configure(environ={"REMIXER_T5_CPU_BLAS": "off"}, cpu_only=True) is False
  # A run on TPU or GPU: never, whatever the mode.
  assert cpu_blas.configure(environ={"REMIXER_T5_CPU_BLAS": "mkl"}, cpu_only=False) is False
  assert cpu_blas.applied is False and cpu_blas.describe() is None


def test_missing_library_is_named(monkeypatch, tmp_path):
  import site
  monkeypatch.setattr(sys, "prefix", str(tmp_path))
  monkeypatch.setattr(site, "getuserbase", lambda: str(tmp_path / "user"))
  with pytest.raises(cpu_blas.Unavailable, match=r"no libmkl_rt.so\* in .*lib or .*user.lib \(pip install -e '.\[mkl\]'\)"):
    cpu_blas.find_sgemm("mkl")
  with pytest.raises(ValueError, match=r"unknown CPU BLAS 'onednn': expected one of mkl"):
    cpu_blas.find_sgemm("onednn")
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPU_BLAS=mkl: no libmkl_rt"):
    cpu_blas.configure(environ={"REMIXER_T5_CPU_BLAS": "mkl"}, cpu_only=True)
  logs = []  # auto (the default) without MKL installed: XLA's own dots, silently (the plain default)
  assert cpu_blas.configure(log=logs.append, environ={}, cpu_only=True) is False
  assert logs == [] and cpu_blas.applied is False


@pytest.mark.skipif(not shutil.which("false"), reason="no `false` program to stand in for a failing compiler")
@pytest.mark.skipif(not AVAILABLE, reason="needs MKL in this venv (pip install -e '.[mkl]')")
def test_installed_but_unusable_says_why_in_one_line(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_blas, "cpu_vendor", lambda: "GenuineIntel")  # where `auto` would use MKL
  env = {"CXX": shutil.which("false"), "REMIXER_T5_CACHE_DIR": str(tmp_path)}
  logs = []  # auto: MKL is there but the handler does not build: XLA's dots, and one line saying why
  assert cpu_blas.configure(log=logs.append, environ=env, cpu_only=True) is False
  assert cpu_blas.applied is False
  assert logs[-1].startswith("CPU matmuls: XLA's own (mkl: building cpu_sgemm.cc with") and "failed (exit 1)" in logs[-1]
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPU_BLAS=mkl: building cpu_sgemm.cc .* failed"):
    cpu_blas.configure(environ={**env, "REMIXER_T5_CPU_BLAS": "mkl"}, cpu_only=True)


def test_cpu_vendor_is_read_from_cpuinfo(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
  assert cpu_blas.cpu_vendor(str(info)) == "AuthenticAMD"
  info.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # an Arm machine names no vendor_id
  assert cpu_blas.cpu_vendor(str(info)) is None
  assert cpu_blas.cpu_vendor(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not AVAILABLE, reason="needs MKL in this venv (pip install -e '.[mkl]')")
def test_auto_keeps_xla_dots_on_other_vendors_and_says_so(monkeypatch, tmp_path):
  """`auto` uses MKL on Intel CPUs only (AUTO_VENDORS: on an AMD Zen 3 it made the step no faster); on an AMD
  one it says so in one line, naming the way to force it, and builds and loads nothing."""
  monkeypatch.setattr(cpu_blas, "applied", False)  # restored to False after the forced `mkl` below
  monkeypatch.setattr(cpu_blas, "cpu_vendor", lambda: "AuthenticAMD")
  monkeypatch.setattr(cpu_blas, "load", lambda *a, **k: pytest.fail("auto loaded MKL on an AMD CPU"))
  logs = []
  assert cpu_blas.configure(log=logs.append, environ={"REMIXER_T5_CACHE_DIR": str(tmp_path)}, cpu_only=True) is False
  assert cpu_blas.applied is False and list(tmp_path.iterdir()) == []
  assert logs == ["CPU matmuls: XLA's own (MKL is installed, but on AuthenticAMD CPUs it made the step no faster; "
                  "$REMIXER_T5_CPU_BLAS=mkl to use it; see remixer_t5/cpu_blas.py)"]
  loaded = []  # `mkl` forces it on any vendor
  monkeypatch.setattr(cpu_blas, "load", lambda backend, *a, **k: loaded.append(backend) or {
      "backend": backend, "description": "MKL", "threads": 2})
  assert cpu_blas.configure(environ={"REMIXER_T5_CPU_BLAS": "mkl"}, cpu_only=True) is True and loaded == ["mkl"]


def test_build_failure_and_missing_compiler_are_reported(tmp_path):
  with pytest.raises(cpu_blas.Unavailable, match=r"no C\+\+ compiler \(\$CXX='/nonexistent/cxx'"):
    cpu_blas.build(environ={"CXX": "/nonexistent/cxx"}, out_dir=tmp_path)
  false = shutil.which("false")
  if false is None:
    pytest.skip("no `false` program to stand in for a failing compiler")
  with pytest.raises(cpu_blas.Unavailable, match=r"building cpu_sgemm.cc with .*false failed \(exit 1\)"):
    cpu_blas.build(environ={"CXX": false}, out_dir=tmp_path)
  assert list(tmp_path.iterdir()) == []  # nothing half-written left in the cache


CHECK = """
import json, os, jax, jax.numpy as jnp, numpy as np
from remixer_t5 import cpu_blas
logs = []
on = cpu_blas.configure(log=logs.append)
grad = lambda: jax.jit(jax.grad(lambda x, w: jnp.sum(cpu_blas.matmul(x, w) ** 2), argnums=(0, 1)))
count = lambda m, k, n: grad().lower(jnp.ones((m, k)), jnp.ones((k, n))).as_text().count("@remixer_sgemm")
# The default threshold: a product under MIN_FLOPS keeps XLA's dot, one at it goes to MKL.
threshold = cpu_blas.MIN_FLOPS
sizes = {"under": count(64, 32, 48), "at": count(threshold // 2 // (256 * 256) + 1, 256, 256)}
cpu_blas.MIN_FLOPS = 0  # every product below, to check the call on small shapes too
rng = np.random.default_rng(0)
worst = 0.0
for m, k, n in ((300, 70, 130), (7, 512, 1024), (1037, 256, 515)):
  x, w, g = (jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in ((m, k), (k, n), (m, n)))
  ours = jax.jit(lambda x, w, g: (cpu_blas.matmul(x, w), *jax.vjp(cpu_blas.matmul, x, w)[1](g)))(x, w, g)
  ref = jax.jit(lambda x, w, g: (jnp.dot(x, w), *jax.vjp(jnp.dot, x, w)[1](g)))(x, w, g)
  worst = max(worst, *(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(ours, ref)))
f = grad()
x, w = jnp.ones((64, 32)), jnp.ones((32, 48))
cpu_hlo = f.lower(x, w).as_text()
tpu_hlo = f.trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
print(json.dumps({"on": on, "logs": logs, "worst": worst, "describe": cpu_blas.describe(),
                  "devices": jax.device_count(), "cpu_calls": cpu_hlo.count("remixer_sgemm"),
                  "tpu_calls": tpu_hlo.count("remixer_sgemm"), "tpu_dots": tpu_hlo.count("dot_general"),
                  "threshold": threshold, "sizes": sizes}))
"""


@needs_backend
@pytest.mark.parametrize("backend", AVAILABLE)
def test_products_and_gradients_match_xla_and_tpu_lowering_keeps_dot(backend, tmp_path):
  proc = run_py(CHECK, {"REMIXER_T5_CPU_BLAS": backend, "REMIXER_T5_CACHE_DIR": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["on"] is True and r["devices"] == 1
  assert any("building cpu_sgemm.cc" in m for m in r["logs"])  # built into the given cache, once
  assert any("CPU matmuls: Intel(R) oneAPI Math Kernel Library" in m and "cblas_sgemm_64" in m for m in r["logs"]), \
      r["logs"]
  assert "via FFI" in r["describe"]
  assert len(list((tmp_path / "cpu_blas").glob("cpu_sgemm-*.so"))) == 1
  # Forward product and both gradients, with and without transposes, against XLA's: float32 rounding only.
  assert r["worst"] < 1e-5
  # The CPU program calls the sgemm three times (product, dX, dW); a TPU lowering of the same function has none.
  assert r["cpu_calls"] == 3 and r["tpu_calls"] == 0 and r["tpu_dots"] >= 3
  # Products under the threshold keep XLA's dot (COGS-sized layers were slower through MKL).
  assert r["threshold"] > 0 and r["sizes"] == {"under": 0, "at": 3}


@needs_backend
def test_several_devices_keep_xla_dot(tmp_path):
  proc = run_py(CHECK, {"REMIXER_T5_CPU_BLAS": AVAILABLE[0], "REMIXER_T5_CACHE_DIR": str(tmp_path),
                        "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["on"] is True and r["devices"] == 2 and r["cpu_calls"] == 0 and r["worst"] == 0.0
  assert r["sizes"] == {"under": 0, "at": 0}


TRAIN = """
import json, jax, jax.numpy as jnp, numpy as np
from remixer_t5 import bench_train, cpu_blas, gin_utils
on = cpu_blas.configure()
cpu_blas.MIN_FLOPS = 0  # T5.1.1 tiny's products are all under the default threshold
gin_utils.parse_gin(["models/t5_1_1/tiny.gin"], ["DROPOUT_RATE=0.0"])
lengths = {"inputs": 24, "targets": 12}
built = bench_train.from_gin(4, lengths)
model = built["model"]
batch = bench_train.random_batch(model.module.config.vocab_size, 4, lengths)
params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
batch = {k: jnp.asarray(v) for k, v in batch.items()}
def loss_and_grads():
  return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0]))(params)
cpu_blas.applied = False
ref_loss, ref_grads = loss_and_grads()
cpu_blas.applied = on
loss, grads = loss_and_grads()
hlo = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, None)[0])).lower(params).as_text()
diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)),
                                     grads, ref_grads))
from remixer_t5 import mfu, trainer
shapes = trainer.batch_shapes(lengths, 4, pack=False)
cpu_blas.applied = False
ref_flops = mfu.model_flops_per_step(model, shapes)
cpu_blas.applied = on
flops = mfu.model_flops_per_step(model, shapes)
print(json.dumps({"on": on, "loss": float(loss), "ref_loss": float(ref_loss), "worst_grad": max(diffs),
                  "calls": hlo.count("@remixer_sgemm"), "flops": flops, "ref_flops": ref_flops}))
"""


@needs_backend
def test_t5_loss_and_gradients_match_xla(tmp_path):
  """A T5.1.1 tiny train step's loss and every parameter's gradient through the sgemm match XLA's dots."""
  proc = run_py(TRAIN, {"REMIXER_T5_CPU_BLAS": AVAILABLE[0], "REMIXER_T5_CACHE_DIR": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["on"] is True and r["calls"] >= 27  # three a Dense, 9+ Dense layers in T5.1.1 tiny
  assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
  assert r["worst_grad"] < 1e-4
  # XLA's cost analysis counts a custom call as no FLOPs: model FLOPs are counted on jnp.dot (flop_count.py)
  assert r["flops"] == r["ref_flops"] > 0, r
