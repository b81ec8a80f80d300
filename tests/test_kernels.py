"""The kernel registry (kernels/__init__.py): which implementation `auto` and the named fields take, by the platform
traced for; what a named kernel that cannot take its inputs says; and the docs' table, made from the registry."""

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxpr_util
from remixer_t5 import flop_count, kernels
from remixer_t5.model import config

KERNELS = {"cpu": "cpu.fake:f", "pallas_gpu": "gpu.fake:f"}
AUTO = {"cpu": "cpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}  # no TPU kernel among KERNELS: the reference
# An operation named by the attention field (so its names are valid) with kernels of its own.
OP = kernels.Operation("fake attention", "network.T5Config.attention_impl", "fake", KERNELS, AUTO)


@pytest.fixture
def traced(monkeypatch):
  """Kernels that add 1 (cpu) or 2 (gpu) to the reference's x + 0, and hand their inputs back to the reference
  when asked to (`back=True`, a static argument); `traced` lists the kernels traced."""
  seen = []

  def load(name):
    def kernel(x, reference, back=False):
      seen.append(name)
      if back:
        return kernels.hand_back(reference, "fake kernels take no back=True", x)
      return reference(x) + {"cpu.fake:f": 1.0, "gpu.fake:f": 2.0}[name]

    return kernel

  monkeypatch.setattr(kernels, "load", load)
  monkeypatch.setattr(kernels, "_SAID", set())
  return seen


def reference(x):
  return x + 0.0


def test_auto_without_a_mesh_takes_the_default_backends_kernel_only(traced):
  fn = OP.choose("auto", reference)
  assert jax.default_backend() == "cpu"
  assert float(jax.jit(fn)(jnp.float32(0))) == 1.0 and traced == ["cpu.fake:f"]  # no other platform's is traced


@pytest.mark.parametrize(
  "platform, added, seen", [("cpu", 1.0, ["cpu.fake:f"]), ("tpu", 0.0, []), ("cuda", 2.0, ["gpu.fake:f"])]
)
def test_auto_under_a_mesh_takes_its_platforms_kernel(traced, platform, added, seen):
  text = jaxpr_util.lowered_for(
    platform, lambda x: OP.choose("auto", reference)(x), jax.ShapeDtypeStruct((), jnp.float32)
  )
  assert traced == seen
  assert ("1.000000e+00" in text, "2.000000e+00" in text) == (added == 1.0, added == 2.0), text


def test_named_and_counting_choices(traced):
  assert float(OP.choose("xla", reference)(jnp.float32(0))) == 0.0
  assert float(OP.choose("cpu", reference)(jnp.float32(0))) == 1.0
  with flop_count.counting_model_flops():
    assert float(OP.choose("cpu", reference)(jnp.float32(0))) == 0.0
  assert traced == ["cpu.fake:f"]
  with pytest.raises(ValueError, match=r"attention_impl='flash': expected one of \('auto', 'xla', 'cpu'"):
    OP.choose("flash", reference)
  with pytest.raises(
    ValueError,
    match=r"HyperMixing.impl='pallas_tpu': expected one of "
    r"\('auto', 'xla', 'cpu', 'pallas_gpu'\)",
  ):
    kernels.check("hypermixer.HyperMixing.impl", "pallas_tpu")


def test_a_named_kernel_that_cannot_take_the_inputs_says_so_once(traced, caplog):
  """Named explicitly: no kernel of that name for this operation, or a kernel handing its inputs back, computes
  the reference and logs it once; under `auto` the same hand-back is silent."""
  with caplog.at_level(logging.WARNING, logger="remixer_t5.kernels"):
    for _ in range(2):
      assert float(OP.choose("pallas_tpu", reference)(jnp.float32(0))) == 0.0  # none of that name: the reference
      assert float(OP.choose("cpu", reference, back=True)(jnp.float32(-1))) == -1.0  # handed back
    assert float(OP.choose("auto", reference, back=True)(jnp.float32(-3))) == -3.0  # auto: handed back, silently
  said = [r.getMessage() for r in caplog.records]
  field = "network.T5Config.attention_impl"
  assert said == [
    f"{field}='pallas_tpu': fake attention has no 'pallas_tpu' kernel; computing the plain-JAX "
    f"reference ({field}='xla') there",
    f"{field}='cpu': fake kernels take no back=True; computing the plain-JAX reference ({field}='xla') there",
  ], said


def test_the_config_and_the_docs_table_come_from_the_registry():
  assert config.ATTENTION_IMPLS == ("auto", "xla", "cpu", "pallas_gpu", "pallas_tpu")
  assert config.DROPOUT_IMPLS == ("auto", "xla", "cpu")
  assert kernels.choices("hypermixer.HyperMixing.impl") == ("auto", "xla", "cpu", "pallas_gpu")
  with pytest.raises(KeyError, match="no operation is chosen by 'network.T5Config.remat_policy'"):
    kernels.choices("network.T5Config.remat_policy")
  table = kernels.table()
  assert len(table.splitlines()) == 2 + len(kernels.OPERATIONS)
  docs = (Path(__file__).resolve().parents[1] / "docs" / "configuring.md").read_text()
  assert table in docs, "docs/configuring.md's kernel table differs from kernels.table(); paste it in"
