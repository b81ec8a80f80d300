"""T5's attention on TPUs through JAX's Pallas (Mosaic) flash attention, `jax.experimental.pallas.ops.tpu.
flash_attention`, with the contract of `kernels/gpu/flash_attention.py` (the model's `mixers.attention.dot_product_attention` is the function).

That kernel takes an additive bias `ab` and returns its gradient, q and kv segment ids, and causal masking, with
a softmax scale (1 here: T5 does not scale its logits). This wrapper does the layout and the shapes:
  - [b, q, h, d] inputs are transposed to its [b, h, q, d] and the output back;
  - it takes `ab` only as [b, h, q, k], so T5's [1, h, q, k] bias is broadcast over the batch, and its gradient
    comes back as a [b, h, q, k] array that the broadcast's transpose sums over the batch: unlike the GPU kernel,
    the bias and its gradient are materialised per example (the softmax's weights are not);
  - lengths are padded to whole 128-position blocks (its key blocks must divide the length, and its backward
    needs blocks of at least 128) with segment id 0;
  - segment ids are always passed (ones where the caller gives none), so padding never mixes with real tokens.
    Its mask is q_seg == kv_seg: padding queries (id 0) attend to padding keys, which changes nothing a real
    row reads (their outputs are any finite values, as the contract allows).
Generations: libtpu 0.0.42.1 compiles it (forward and gradient, T5.1.1-base shapes, deviceless) for v4, v5e, v5p
and v6e with bfloat16 operands; v2 and v3 refuse bfloat16 matmul operands in Mosaic ("Unsupported matmul RHS
type"), and compile it with float32 operands (`operand_dtype=jnp.float32`) (tests/test_flash_attention.py).

Not supported: a dropout mask (the kernel draws no dropout and takes none: finetuning with attention dropout
keeps the XLA form), and a bias without a head axis. Numerics: float32 logits and statistics; masked logits
are replaced by -0.7 * float32 max where the reference adds -1e10 (identical on rows with an allowed key).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as tpu

from remixer_t5 import kernels
from remixer_t5.kernels import pad_axis, sharding
from remixer_t5.kernels.bias import RelativeBias

FIRST_BFLOAT16_GENERATION = 4  # v2 and v3: Mosaic takes no bfloat16 matmul operands
BLOCK = 128  # JAX's default blocks; its backward needs key blocks of at least 128 (its MIN_BLOCK_SIZE)


def attention(
  query,
  key,
  value,
  *,
  bias=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  causal: bool = False,
  dropout_mask=None,
  dropout_rate: float = 0.0,
  dtype=jnp.float32,
  operand_dtype=None,
  block: int = BLOCK,
):
  """The model's attention operation (`mixers.attention.dot_product_attention`) through JAX's TPU flash
  attention (differentiable in query, key, value and bias). query [b, q, h, d]; key, value [b, k, h, d]; bias
  None, a `RelativeBias` or a [1|b, h, q, k] array; segment ids [b, q], [b, k] (0 = padding); returns [b, q, h, d] in `dtype`. operand_dtype: what query, key
  and value are cast to for the kernel (None: as given); v2 and v3 need float32, their Mosaic compiler takes no
  bfloat16 matmul operands."""
  if dropout_mask is not None or dropout_rate:
    raise NotImplementedError(
      "TPU flash attention takes no dropout mask (JAX's Pallas TPU kernel has no "
      "dropout): use the XLA attention when attention dropout is on"
    )
  if isinstance(bias, RelativeBias):  # JAX's kernel reads a dense [b, h, q, k] bias
    bias = bias.dense()
  b, nq, h, d = query.shape
  nk = key.shape[1]
  kernels.check_attention_shapes(query, key, value, bias)
  pq, pk = -(-nq // block) * block, -(-nk // block) * block
  q_seg = jnp.ones((b, nq), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
  kv_seg = jnp.ones((b, nk), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
  cast = (lambda x: x) if operand_dtype is None else (lambda x: x.astype(operand_dtype))
  heads_first = lambda x, n: jnp.swapaxes(pad_axis(cast(x), 1, n), 1, 2)  # [b, n, h, d] -> [b, h, n_padded, d]
  ab = None
  if bias is not None:
    ab = jnp.broadcast_to(pad_axis(pad_axis(bias, 2, pq), 3, pk), (b, h, pq, pk))
  sizes = tpu.BlockSizes(
    block_q=block,
    block_k_major=block,
    block_k=block,
    block_b=1,
    block_q_major_dkv=block,
    block_k_major_dkv=block,
    block_k_dkv=block,
    block_q_dkv=block,
    block_k_major_dq=block,
    block_k_dq=block,
    block_q_dq=block,
  )
  out = tpu.flash_attention(
    heads_first(query, pq),
    heads_first(key, pk),
    heads_first(value, pk),
    ab,
    tpu.SegmentIds(q=pad_axis(q_seg, 1, pq), kv=pad_axis(kv_seg, 1, pk)),
    causal=causal,
    sm_scale=1.0,
    block_sizes=sizes,
  )
  return jnp.swapaxes(out, 1, 2)[:, :nq].astype(dtype)


def generation(device_kind: str) -> int | None:
  """The TPU generation a device kind names ('TPU v4' -> 4, 'TPU v5 lite' -> 5), or None."""
  m = re.search(r"v(\d+)", device_kind or "")
  return int(m.group(1)) if m else None


def seam(
  query,
  key,
  value,
  bias,
  q_segment_ids,
  kv_segment_ids,
  keep,
  *,
  reference,
  causal: bool,
  dropout_rate: float,
  dtype,
  float32_logits: bool = True,
):
  """The `pallas_tpu` implementation of the model's attention operation (`T5Config.attention_impl`): the kernel
  on TPU v4 and later, where Mosaic takes the model's bfloat16 operands; the reference (XLA's form) on v2 and
  v3, where the kernel would need float32 operands, with attention dropout (the kernel takes no mask), and where
  the generation is unknown. Each device's batch rows under a mesh."""
  del float32_logits
  device = kernels.target_device()
  gen = generation(device.device_kind) if device.platform == "tpu" else None
  if keep is not None or gen is None or gen < FIRST_BFLOAT16_GENERATION:
    why = (
      "the kernel takes no attention dropout"
      if keep is not None
      else f"the kernel runs on TPU v{FIRST_BFLOAT16_GENERATION} and later, not on {device.device_kind}"
    )
    return kernels.hand_back(reference, why, query, key, value, bias, q_segment_ids, kv_segment_ids, keep)
  run = lambda q, k, v, b, qs, ks: attention(
    q, k, v, bias=b, q_segment_ids=qs, kv_segment_ids=ks, causal=causal, dtype=dtype
  )
  bias = bias.dense() if isinstance(bias, RelativeBias) else bias
  shared = (3,) if bias is not None and bias.shape[0] == 1 else ()
  return sharding.per_batch_shard(run, shared)(query, key, value, bias, q_segment_ids, kv_segment_ids)
