"""runtime: XLA:CPU's per-step scratch stays on the heap (no page faults per step) once configured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from subprocess_util import xla_flags

from remixer_t5 import runtime

# A fwd+bwd whose scratch (48 MiB) is above glibc's largest adaptive mmap threshold (32 MiB).
_PROBE = r"""
import json, resource, statistics, jax, jax.numpy as jnp
from remixer_t5 import runtime
applied = runtime.configure()
w = jnp.eye(64) * 0.5
def loss(x):
  for _ in range(3):
    x = jnp.tanh(x @ w)
  return jnp.sum(x)
x = jnp.ones((65536, 64))
step = jax.jit(jax.grad(loss)).lower(x).compile()
faults = []
for i in range(40):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(step(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# Buffers are freed asynchronously, so the heap first grows to hold a few steps' scratch, then stays.
print(json.dumps({"applied": applied, "temp_bytes": step.memory_analysis().temp_size_in_bytes,
                  "faults": statistics.median(faults[20:]), "warmup": faults[:20]}))
"""


def _probe(mode: str) -> dict:
  env = dict(os.environ, REMIXER_T5_HOST_MALLOC=mode, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags()
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _huge_pages_always() -> bool:
  path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
  return path.exists() and "[always]" in path.read_text()


@pytest.mark.integration
@pytest.mark.skipif(runtime._glibc() is None, reason="the allocator policy is for glibc (Linux) only")
def test_scratch_is_not_page_faulted_in_every_step():
  on, off = _probe("on"), _probe("off")
  pages = on["temp_bytes"] / 4096
  assert on["temp_bytes"] > 40 * 2**20, on  # the probe really needs a buffer above the mmap threshold
  assert on["applied"] and not off["applied"]
  assert on["faults"] < 0.02 * pages, (on, pages)  # median step after 20 warm-up steps
  if not _huge_pages_always():  # with 2 MiB pages the default would fault far fewer times
    assert off["faults"] > 0.5 * pages, (off, pages)  # the default really does fault the scratch in


class _FakeLibc:
  """Records mallopt(param, value) calls; returns `result` (glibc: 1 accepted, 0 refused)."""

  def __init__(self, result=1):
    self.calls = []

    def mallopt(param, value):
      self.calls.append((param, value))
      return result

    self.mallopt = mallopt


def _fake(monkeypatch, cpu_only=True, result=1):
  libc = _FakeLibc(result)
  monkeypatch.setattr(runtime, "_glibc", lambda: libc)
  monkeypatch.setattr(runtime, "jax_runs_on_cpu_only", lambda: cpu_only)
  monkeypatch.setattr(runtime, "applied", False)
  return libc


def test_auto_turns_mmap_chunks_and_trimming_off_with_one_arena_on_cpu(monkeypatch):
  libc = _fake(monkeypatch, cpu_only=True)
  monkeypatch.delenv(runtime.ENV, raising=False)
  lines = []
  assert runtime.configure(lines.append, verbose=True)
  # no mmap chunks (a threshold is an int: it cannot cover a scratch above 2 GiB), no trimming, one arena
  assert sorted(libc.calls) == sorted(
    [(runtime.M_MMAP_MAX, 0), (runtime.M_TRIM_THRESHOLD, -1), (runtime.M_ARENA_MAX, 1)]
  )
  assert runtime.applied and "heap" in lines[0] and runtime.ENV in lines[0]


def test_auto_leaves_accelerator_hosts_alone_and_off_wins(monkeypatch):
  libc = _fake(monkeypatch, cpu_only=False)
  monkeypatch.setenv(runtime.ENV, "auto")
  assert not runtime.configure() and libc.calls == []
  monkeypatch.setenv(runtime.ENV, "on")  # forced on an accelerator host
  assert runtime.configure() and len(libc.calls) == 3
  libc = _fake(monkeypatch, cpu_only=True)
  monkeypatch.setenv(runtime.ENV, "off")
  assert not runtime.configure() and libc.calls == []


def test_refused_setting_is_reported(monkeypatch):
  _fake(monkeypatch, result=0)
  monkeypatch.setenv(runtime.ENV, "on")
  lines = []
  assert not runtime.configure(lines.append)
  assert "refused" in lines[0] and not runtime.applied


def test_not_glibc_and_bad_values(monkeypatch):
  monkeypatch.setattr(runtime, "_glibc", lambda: None)
  monkeypatch.setenv(runtime.ENV, "on")
  lines = []
  assert not runtime.configure(lines.append) and "not glibc" in lines[0]
  monkeypatch.setenv(runtime.ENV, "yes please")
  with pytest.raises(ValueError, match=r"REMIXER_T5_HOST_MALLOC='yes please'.*'auto', 'on' or 'off'"):
    runtime.configure()


@pytest.mark.parametrize("platforms,expected", [("cpu", True), ("cuda,cpu", False), ("tpu", False), (" cpu ", True)])
def test_jax_platforms_decides(platforms, expected):
  saved = jax.config.jax_platforms
  try:
    jax.config.update("jax_platforms", platforms)
    assert runtime.jax_runs_on_cpu_only() is expected
  finally:
    jax.config.update("jax_platforms", saved)


def test_without_platforms_installed_accelerator_support_decides(monkeypatch):
  saved = jax.config.jax_platforms
  try:
    jax.config.update("jax_platforms", None)
    monkeypatch.setattr(runtime.importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setitem(sys.modules, "jax_plugins", None)  # import fails: no plugin namespace
    monkeypatch.setattr(runtime, "_ACCELERATOR_MODULES", ("no_such_module_remixer_t5",))
    assert runtime.jax_runs_on_cpu_only() is True
    monkeypatch.setattr(runtime, "_ACCELERATOR_MODULES", ("json",))  # stands in for an installed libtpu
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: True)
    assert runtime.jax_runs_on_cpu_only() is False
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: False)  # libtpu only to compile for TPUs
    assert runtime.jax_runs_on_cpu_only() is True
    monkeypatch.setattr(runtime, "_ACCELERATOR_MODULES", ("no_such_module_remixer_t5",))
    monkeypatch.setattr(runtime.importlib.metadata, "entry_points", lambda group: ["jax_cuda12_plugin"])
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: True)
    assert runtime.jax_runs_on_cpu_only() is False
  finally:
    jax.config.update("jax_platforms", saved)


def test_tpu_chips_are_found_by_their_device_files(monkeypatch, tmp_path):
  (tmp_path / "accel0").touch()
  monkeypatch.setattr(runtime, "_TPU_DEVICE_GLOBS", (str(tmp_path / "accel*"),))
  assert runtime.tpu_chips_present()
  monkeypatch.setattr(runtime, "_TPU_DEVICE_GLOBS", (str(tmp_path / "vfio" / "[0-9]*"),))
  assert not runtime.tpu_chips_present()


def test_libtpu_without_chips_pins_jax_to_the_cpu(monkeypatch):
  saved = jax.config.jax_platforms
  try:
    monkeypatch.setattr(runtime.importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setitem(sys.modules, "jax_plugins", None)
    monkeypatch.setattr(runtime, "_ACCELERATOR_MODULES", ("json",))  # stands in for an installed libtpu
    jax.config.update("jax_platforms", None)
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: True)  # a TPU VM: JAX picks the TPU itself
    assert not runtime.pin_cpu_without_tpu_chips() and not jax.config.jax_platforms
    monkeypatch.setattr(runtime, "tpu_chips_present", lambda: False)
    assert runtime.pin_cpu_without_tpu_chips() and jax.config.jax_platforms == "cpu"
    assert not runtime.pin_cpu_without_tpu_chips()  # already set: left alone
  finally:
    jax.config.update("jax_platforms", saved)
