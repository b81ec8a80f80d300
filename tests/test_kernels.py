"""kernels.choose, the seam: which implementation `auto` and the named fields take, by the platform traced for."""
import jax
import jax.numpy as jnp
import pytest

import jaxpr_util
from remixer_t5 import flop_count, kernels

KERNELS = {"cpu": "cpu.fake:f", "pallas_gpu": "gpu.fake:f"}
AUTO = {"cpu": "cpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}  # no TPU kernel among KERNELS: the reference


@pytest.fixture
def traced(monkeypatch):
  """Kernels that add 1 (cpu) or 2 (gpu) to the reference's x + 0; `traced` lists the kernels traced."""
  seen = []

  def load(name):
    def kernel(x, reference):
      seen.append(name)
      return reference(x) + {"cpu.fake:f": 1.0, "gpu.fake:f": 2.0}[name]
    return kernel

  monkeypatch.setattr(kernels, "load", load)
  return seen


def reference(x):
  return x + 0.0


def test_auto_without_a_mesh_takes_the_default_backends_kernel_only(traced):
  fn = kernels.choose("auto", reference, KERNELS, AUTO)
  assert jax.default_backend() == "cpu"
  assert float(jax.jit(fn)(jnp.float32(0))) == 1.0 and traced == ["cpu.fake:f"]  # no other platform's is traced


@pytest.mark.parametrize("platform, added, seen", [("cpu", 1.0, ["cpu.fake:f"]), ("tpu", 0.0, []),
                                                   ("cuda", 2.0, ["gpu.fake:f"])])
def test_auto_under_a_mesh_takes_its_platforms_kernel(traced, platform, added, seen):
  text = jaxpr_util.lowered_for(platform, lambda x: kernels.choose("auto", reference, KERNELS, AUTO)(x),
                                jax.ShapeDtypeStruct((), jnp.float32))
  assert traced == seen
  assert ("1.000000e+00" in text, "2.000000e+00" in text) == (added == 1.0, added == 2.0), text


def test_named_and_counting_choices(traced):
  assert float(kernels.choose("xla", reference, KERNELS, AUTO)(jnp.float32(0))) == 0.0
  assert float(kernels.choose("pallas_tpu", reference, KERNELS, AUTO)(jnp.float32(0))) == 0.0  # none here
  assert float(kernels.choose("cpu", reference, KERNELS, AUTO)(jnp.float32(0))) == 1.0
  with flop_count.counting_model_flops():
    assert float(kernels.choose("cpu", reference, KERNELS, AUTO)(jnp.float32(0))) == 0.0
  assert traced == ["cpu.fake:f"]
  with pytest.raises(ValueError, match=r"attention_impl='flash': expected one of \('auto', 'xla', 'cpu'"):
    kernels.check("attention_impl", "flash", ("cpu", "pallas_gpu"))
