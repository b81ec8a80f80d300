"""layers.Dense and layers.add_bias: the same values and gradients as the plain formulas, written so that XLA:CPU
compiles their backward without the slow paths measured in docs/benchmarks.md (transposed activation-gradient
copies; YNNPACK's sum over a leading axis)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5 import layers
from jaxpr_util import eqns_in


def _dense_grads(x, kernel):
  dense = layers.Dense(kernel.shape[1], ("embed", "mlp"))
  params = {"params": {"kernel": kernel}}
  f = lambda p, x: jnp.sum(jnp.sin(dense.apply(p, x)))
  return jax.jit(jax.grad(f, argnums=(0, 1)))(params, x), f, params


def test_dense_matches_numpy_and_its_kernel_gradient_contracts_one_axis():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 8)).astype(np.float32)
  kernel = rng.standard_normal((8, 4)).astype(np.float32)
  dense = layers.Dense(4, ("embed", "mlp"))
  y = dense.apply({"params": {"kernel": kernel}}, x)
  np.testing.assert_allclose(np.asarray(y), np.einsum("btd,df->btf", x, kernel), rtol=1e-5, atol=1e-5)
  (g_params, g_x), f, params = _dense_grads(x, kernel)
  # numpy reference of both gradients: d sum(sin(y)) = cos(y)
  dy = np.cos(np.einsum("btd,df->btf", x, kernel))
  np.testing.assert_allclose(np.asarray(g_params["params"]["kernel"]), np.einsum("btd,btf->df", x, dy),
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(g_x), np.einsum("btf,df->btd", dy, kernel), rtol=1e-4, atol=1e-4)
  # Every matmul of forward and backward is 2-D with one contracting axis: the kernel gradient is
  # tokens^T @ dy, not a contraction over (batch, length) (which XLA:CPU runs with transposed copies).
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(params, x).jaxpr
  dots = [e for e in eqns_in(jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 3, [str(e) for e in dots]
  for e in dots:
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    assert len(lc) == len(rc) == 1 and not lb and not rb, str(e)
    assert all(v.aval.ndim == 2 for v in e.invars), str(e)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("x_shape, bias_shape", [
    ("bhqk", "1hqk"), ("bhqk", "b1qk"), ("bhqk", "11qk"), ("bhqk", "bhqk"), ("b1qk", "1hqk")])
def test_add_bias_value_and_gradients_match_numpy(batch, x_shape, bias_shape):
  sizes = {"b": batch, "h": 3, "q": 4, "k": 5, "1": 1}
  rng = np.random.default_rng(batch)
  x = rng.standard_normal([sizes[c] for c in x_shape]).astype(np.float32)
  bias = rng.standard_normal([sizes[c] for c in bias_shape]).astype(np.float32)
  w = rng.standard_normal(np.broadcast_shapes(x.shape, bias.shape)).astype(np.float32)
  f = lambda x, b: jnp.sum(w * layers.add_bias(x, b))
  np.testing.assert_allclose(np.asarray(layers.add_bias(x, bias)), x + bias, rtol=1e-6)
  gx, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(x, bias)
  sum_to = lambda g, shape: np.sum(g, axis=tuple(i for i, s in enumerate(shape) if s == 1), keepdims=True)
  assert gx.shape == x.shape and gb.shape == bias.shape
  np.testing.assert_allclose(np.asarray(gx), sum_to(w, x.shape), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gb), sum_to(w, bias.shape), rtol=1e-5, atol=1e-5)


def test_add_bias_backward_has_no_reduce_on_a_cpu_only_and_rejects_mismatched_ranks():
  x, bias = jnp.ones((8, 6, 4, 4)), jnp.ones((1, 6, 4, 4))
  _, vjp = jax.vjp(layers.add_bias, x, bias)
  traced = jax.jit(vjp).trace(jnp.ones((8, 6, 4, 4)))
  reduces = lambda platform: traced.lower(lowering_platforms=(platform,)).as_text().count("stablehlo.reduce")
  # on a CPU the batch sum of the bias gradient is pairwise adds (8 -> 4 -> 2 -> 1), no reduce; a GPU or TPU
  # program sums in one reduce
  assert reduces("cpu") == 0
  assert reduces("cuda") == reduces("tpu") == 1
  with pytest.raises(ValueError, match="same rank"):
    jax.grad(lambda b: jnp.sum(layers.add_bias(jnp.ones((2, 3)), b)))(jnp.ones((3,)))
