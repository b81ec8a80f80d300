"""layers.Dense and cpu_attention.add_bias: the same values and gradients as the plain formulas, written so that XLA:CPU
compiles their backward without the slow paths measured in docs/benchmarks.md (transposed activation-gradient
copies; YNNPACK's sum over a leading axis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.kernels.cpu import attention as cpu_attention
from remixer_t5.model import layers
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
  np.testing.assert_allclose(
    np.asarray(g_params["params"]["kernel"]), np.einsum("btd,btf->df", x, dy), rtol=1e-4, atol=1e-4
  )
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
@pytest.mark.parametrize(
  "x_shape, bias_shape", [("bhqk", "1hqk"), ("bhqk", "b1qk"), ("bhqk", "11qk"), ("bhqk", "bhqk"), ("b1qk", "1hqk")]
)
def test_add_bias_value_and_gradients_match_numpy(batch, x_shape, bias_shape):
  sizes = {"b": batch, "h": 3, "q": 4, "k": 5, "1": 1}
  rng = np.random.default_rng(batch)
  x = rng.standard_normal([sizes[c] for c in x_shape]).astype(np.float32)
  bias = rng.standard_normal([sizes[c] for c in bias_shape]).astype(np.float32)
  w = rng.standard_normal(np.broadcast_shapes(x.shape, bias.shape)).astype(np.float32)
  f = lambda x, b: jnp.sum(w * cpu_attention.add_bias(x, b))
  np.testing.assert_allclose(np.asarray(cpu_attention.add_bias(x, bias)), x + bias, rtol=1e-6)
  gx, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(x, bias)
  sum_to = lambda g, shape: np.sum(g, axis=tuple(i for i, s in enumerate(shape) if s == 1), keepdims=True)
  assert gx.shape == x.shape and gb.shape == bias.shape
  np.testing.assert_allclose(np.asarray(gx), sum_to(w, x.shape), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gb), sum_to(w, bias.shape), rtol=1e-5, atol=1e-5)


def test_add_bias_backward_has_no_reduce_and_the_reference_keeps_its_plain_sum():
  """The `cpu` attention's bias gradient sums the batch by pairwise adds (8 -> 4 -> 2 -> 1), no reduce; the
  reference (`xla`, what GPUs and TPUs run when no kernel of theirs applies) keeps x + bias and one reduce."""
  import functools
  from remixer_t5.model.mixers.attention import dot_product_attention

  x, bias = jnp.ones((8, 6, 4, 4)), jnp.ones((1, 6, 4, 4))
  _, vjp = jax.vjp(cpu_attention.add_bias, x, bias)
  assert jax.jit(vjp).lower(jnp.ones((8, 6, 4, 4))).as_text().count("stablehlo.reduce") == 0
  q = jnp.ones((8, 4, 6, 2))
  seg = jnp.ones((8, 4), jnp.int32)
  attend = lambda add: jax.jit(
    jax.grad(
      lambda b: jnp.sum(
        functools.partial(dot_product_attention, causal=False, dropout_rate=0.0, dtype=jnp.float32, add=add)(
          q, q, q, b, seg, seg, None
        )
      )
    )
  )
  count = lambda add: attend(add).lower(bias).as_text().count("stablehlo.reduce")
  assert count(cpu_attention.add_bias) < count(jnp.add)
  with pytest.raises(ValueError, match="same rank"):
    jax.grad(lambda b: jnp.sum(cpu_attention.add_bias(jnp.ones((2, 3)), b)))(jnp.ones((3,)))


def _numpy_relpos_bias(table, q_len, k_len, bidirectional, max_distance=128):
  """T5's bias from the bucket formula (HF's _relative_position_bucket, in numpy), read element by element."""
  num_heads, num_buckets = table.shape
  out = np.zeros((1, num_heads, q_len, k_len), np.float32)
  for q in range(q_len):
    for k in range(k_len):
      n, ret, nb = k - q, 0, num_buckets
      if bidirectional:
        nb //= 2
        ret += nb if n > 0 else 0
        n = abs(n)
      else:
        n = -min(n, 0)
      exact = nb // 2
      if n < exact:
        bucket = ret + n
      else:
        large = exact + int(
          np.float32(np.log(np.float32(max(n, 1)) / exact) / np.log(max_distance / exact) * (nb - exact))
        )
        bucket = ret + min(large, nb - 1)
      out[0, :, q, k] = table[:, bucket]
  return out


@pytest.mark.parametrize(
  "q_len,k_len,bidirectional",
  [(7, 7, True), (5, 9, True), (9, 5, False), (1, 6, False), (150, 160, True), (3, 1, True)],
)
def test_relpos_bias_from_row_lengths_equals_the_bucket_formula_and_the_gather(q_len, k_len, bidirectional):
  """The row-index path (ints: one value per head and offset, laid out by `RelativeBias.dense`) against
  numpy's element-by-element bias, and its gradient against the gather path's (positions as arrays) up to summation order; its backward
  has no scatter (the gather's is one of q x k x heads updates into the table)."""
  module = layers.RelativePositionBiases(32, 128, 3)
  table = np.asarray(jax.random.normal(jax.random.PRNGKey(q_len), (3, 32)), np.float32)
  params = {"params": {"rel_embedding": jnp.asarray(table)}}
  rows = lambda p: module.apply(p, q_len, k_len, bidirectional=bidirectional).dense()
  gather = lambda p: module.apply(p, jnp.arange(q_len)[None], jnp.arange(k_len)[None], bidirectional=bidirectional)
  np.testing.assert_array_equal(rows(params), _numpy_relpos_bias(table, q_len, k_len, bidirectional))
  np.testing.assert_array_equal(gather(params), _numpy_relpos_bias(table, q_len, k_len, bidirectional))
  g = jax.random.normal(jax.random.PRNGKey(1), (1, 3, q_len, k_len))
  grad = lambda f: jax.grad(lambda p: jnp.sum(f(p) * g))(params)["params"]["rel_embedding"]
  buckets = _numpy_relpos_bias(np.tile(np.arange(32, dtype=np.float32), (3, 1)), q_len, k_len, bidirectional)[0, 0]
  expected = np.stack([[np.asarray(g, np.float64)[0, h][buckets == b].sum() for b in range(32)] for h in range(3)])
  for f in (rows, gather):  # float32 sums of up to ~10^4 terms of size ~1, in different orders
    np.testing.assert_allclose(grad(f), expected, rtol=1e-5, atol=2e-4)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(rows(p) * g)))(params).jaxpr
  assert not [e for e in eqns_in(jaxpr) if e.primitive.name.startswith("scatter")]


def _dots(fn, *args):
  """(lhs dtype, rhs dtype) of every dot_general `fn` traces to, nested jaxprs included."""
  return [
    tuple(str(v.aval.dtype) for v in e.invars)
    for e in eqns_in(jax.make_jaxpr(fn)(*args).jaxpr)
    if e.primitive.name == "dot_general"
  ]


def test_accumulating_einsum_keeps_the_gradient_products_in_the_operands_dtype():
  """bfloat16 operands: the float32 result of preferred_element_type=float32 exactly, and a gradient without a
  mixed float32 x bfloat16 product (JAX's own has two), equal to the plain bfloat16 einsum's gradient of the
  cotangent rounded to bfloat16 and within bfloat16 rounding of the float32 gradient. Float32 operands: JAX's
  own gradient, bit for bit."""
  rng = np.random.default_rng(0)
  x32, y32 = rng.normal(size=(3, 16, 8)).astype(np.float32), rng.normal(size=(3, 16, 24)).astype(np.float32)
  g = jnp.asarray(rng.normal(size=(3, 8, 24)), jnp.float32)
  x, y = jnp.asarray(x32, jnp.bfloat16), jnp.asarray(y32, jnp.bfloat16)
  spec = "bjh,bjd->bhd"
  ours = lambda x, y: layers.accumulating_einsum(spec, x, y)
  jaxs = lambda x, y: jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
  assert ours(x, y).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(ours(x, y)), np.asarray(jaxs(x, y)))
  grad = lambda f: jax.vjp(f, x, y)[1](g)
  assert sum(len(set(d)) == 2 for d in _dots(lambda: grad(jaxs))) == 2, _dots(lambda: grad(jaxs))
  ours_dots = _dots(lambda: grad(ours))  # the forward product (with its custom_vjp's body) and the two gradients
  assert len(ours_dots) >= 3 and set(ours_dots) == {("bfloat16", "bfloat16")}, ours_dots
  plain = jax.vjp(lambda x, y: jnp.einsum(spec, x, y), x, y)[1](g.astype(jnp.bfloat16))
  exact = jax.vjp(
    lambda x, y: jnp.einsum(spec, x, y, precision="highest"), x.astype(jnp.float32), y.astype(jnp.float32)
  )[1](g)
  for got, same, want in zip(grad(ours), plain, exact):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(same, np.float32))
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want), rtol=0.05, atol=0.05 * float(np.max(np.abs(want)))
    )
  f32 = lambda f: jax.vjp(f, jnp.asarray(x32), jnp.asarray(y32))[1](g)
  for got, want in zip(f32(ours), f32(jaxs)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
