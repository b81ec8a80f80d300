"""T5's relative position bias as the attention operation takes it: one value per head and key - query offset.

Every non-decoding attention takes its bias from row indices (`layers.RelativePositionBiases`), so the bias is
a function of k - q alone: bias[h, q, k] = values[h, k - q + q_len - 1], q_len + k_len - 1 values a head. The
plain-JAX forms expand it (`dense`); the GPU kernel reads the vector itself, which is ~q_len times fewer bytes
than the [1, h, q, k] array, and gives its gradient per offset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RelativeBias:
  values: jax.Array  # [heads, q_len + k_len - 1]: values[h, k - q + q_len - 1] is the bias of query q, key k
  q_len: int = dataclasses.field(metadata=dict(static=True))

  @property
  def k_len(self) -> int:
    return self.values.shape[-1] - self.q_len + 1

  def dense(self) -> jax.Array:
    """The [1, heads, q_len, k_len] bias, laid out by broadcasting, reshaping and slicing (no gather): rows of
    width n + 1 read back as rows of width n shift one place a row, so skewed[q, j] = values[j - q] for j >= q,
    and row q's columns q_len - 1 .. n - 1 are values[k - q + q_len - 1] for k = 0 .. k_len - 1. Its gradient is
    sums over rows (no scatter)."""
    heads, n = self.values.shape
    q = self.q_len
    padded = jnp.pad(jnp.broadcast_to(self.values[:, None, :], (heads, q, n)), ((0, 0), (0, 0), (0, 1)))
    skewed = padded.reshape(heads, q * (n + 1))[:, : q * n].reshape(heads, q, n)
    return skewed[None, :, :, q - 1 :]

  def offset_sums(self, dense_gradient: jax.Array) -> jax.Array:
    """The gradient of `values` given that of `dense()` ([1 or heads..., q, k] summed to [heads, q, k]): the
    sum of each offset's diagonal (dense's transpose)."""
    transpose = jax.linear_transpose(lambda v: RelativeBias(v, self.q_len).dense()[0], self.values)
    return transpose(dense_gradient.astype(self.values.dtype))[0]


def check(bias: RelativeBias, heads: int, q_len: int, k_len: int, name: str = "attention") -> None:
  """ValueError naming the shapes when `bias` is not one value per head and offset of a [q_len, k_len] pair."""
  if bias.values.shape != (heads, q_len + k_len - 1) or bias.q_len != q_len:
    raise ValueError(
      f"{name}: relative bias values {bias.values.shape} (q_len {bias.q_len}) must be "
      f"[{heads}, {q_len + k_len - 1}] for {q_len} queries and {k_len} keys"
    )
