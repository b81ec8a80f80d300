"""Fused (flash) attention with T5's relative position bias, its gradient included, as Pallas (Triton) kernels.

The function is `mixers.attention.dot_product_attention` (T5's attention: no 1/sqrt(d) on the logits):

    allowed[b, i, j] = (q_seg[b, i] == kv_seg[b, j]) & (kv_seg[b, j] != 0) & (not causal or j <= i)
    logits[b, h, i, j] = q[b, i, h] · k[b, j, h] + bias[b|0, h, i, j] + (0 if allowed else NEG_INF)
    W = softmax(logits over j) in float32, rounded to `dtype`
    W' = where(dropout_mask, W / (1 - rate), 0) when a dropout mask is given, else W
    out[b, i, h] = Σ_j W'[b, h, i, j] v[b, j, h]

Forward (FlashAttention-2, Dao 2023, Algorithm 1): one program per (row b, query block, head) walks the key
blocks with an online softmax: a running maximum m and sum l per query row and an unnormalised float32 output
accumulator, rescaled by exp(m_old - m_new) when the maximum grows. It writes the output and the log-sum-exp
L = m + log l of each row (float32, [b, h, q]); nothing of size q x k leaves the chip.

Backward (recomputation, no stored weights): with P = exp(logits - L) rebuilt tile by tile,
    dW' = dO V^T,   dW = where(mask, dW' / (1 - rate), 0),   D_i = Σ_d O[i, d] dO[i, d]  (= Σ_j P_ij dW_ij)
    dS = P ⊙ (dW - D)   (the logits' gradient),   dQ = dS K,   dK = dS^T Q,   dV = W'^T dO,   dbias = Σ_b dS
in three kernels:
  - `dkv`: one program per (b, key block, head) walks the query blocks and accumulates dK and dV;
  - `dq`: one program per (b, query block, head) walks the key blocks and accumulates dQ;
  - `dbias`: one program per (query block, key block, head) walks the batch and accumulates that tile of the
    bias gradient in registers, writing it once. T5's bias is [1, h, q, k], shared by the batch, so its gradient
    is a sum over the batch; summing inside the program needs no [b, h, q, k] buffer and no atomics (the sum is
    deterministic). It recomputes QK^T and dO V^T for its tile (two of the backward's seven tile products), which
    is expected to cost less than moving dS through memory, as a [b, h, q, k] array or as per-example
    accumulators in the dQ or dK/dV programs (not yet measured on a GPU). A bias with its own batch axis
    ([b, h, q, k]) gets its gradient per element from the same kernel.
The split of dK/dV and dQ into two kernels (JAX's Pallas attention fuses them into one program when q and k
have as many blocks) keeps q != k (cross-attention) and causal bounds simple; each kernel skips the tiles that
causality masks entirely.

Supported: float32 and bfloat16 (any float dtype Triton's dot takes) queries, keys and values with one head dimension d
(padded to a power of two >= 16 with zeros); any q and k lengths (padded to whole blocks with segment id 0, which masks
them); bias None, [1, h, q, k] or [b, h, q, k] (float32; gradient in its own shape); segment ids (0 = padding), causal
masking, and a dropout mask given as a [b, h, q, k] bool array (read tile by tile, never written: the kernels draw no
random numbers). Not supported: a bias broadcast over heads ([., 1, q, k]), different head dimensions for values,
grouped keys/values, higher-order derivatives, and partitioning: XLA does not partition a custom call, so under a mesh
the caller runs it per batch shard (and sums the bias gradient over the shards). Padding is by copies (masked loads
would avoid them), the outputs sliced: T5's 512 encoder positions need none, its 114 decoder positions pad to 128.

Numerics: logits, softmax statistics and every accumulator are float32; the softmax runs in base 2 (logits times
log2(e), Triton's exp2 is one instruction where exp is a range reduction plus exp2); the weights are rounded to
`dtype` before the product with V, as the reference rounds them; with bfloat16 inputs the tile products take
bfloat16 operands (dS is rounded to bfloat16 for dQ and dK, as in FlashAttention). Masked logits are replaced
by NEG_INF (the reference adds it): identical wherever a row has an allowed key. A row without any (padding
queries) gets uniform weights over all keys: finite, and with a zero cotangent on such rows (the loss ignores
padding) it adds nothing to any gradient. In float32 (interpret mode) the output and the four gradients match the
reference to ~1e-6 of each array's largest magnitude (tests/test_flash_attention.py).

Why a kernel of our own: JAX's Pallas GPU attention (`jax.experimental.pallas.ops.gpu.attention`) takes no
bias, one segment-id array for queries and keys (self-attention only) and only whole-block lengths; axlearn's
port of it adds a bias but returns no gradient for it; cuDNN's fused attention
(`jax.nn.dot_product_attention(implementation="cudnn")`) takes bfloat16/float16 only, segment ids only as a
dense mask or as packed offsets (refused unless a Hopper GPU is visible, so not deviceless), draws its own
dropout, and needs the cuDNN library when the program is traced (not in the gpu-compile extra).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from remixer_t5 import kernels
from remixer_t5.kernels import pad_axis, sharding

f32 = jnp.float32
NEG_INF = -1e10  # layers.NEG_INF: the mask value of the reference (finite, so fully masked rows stay finite)
LOG2E = math.log2(math.e)
# Tiles of 64 x 64: Triton's tensors need powers of two, its dot needs >= 16 per side; 64 rows are a whole
# H100 warpgroup MMA (m64) and, with d = 64 and 4 warps, the forward's accumulator, logits, bias and weights
# tiles each take 32 float32 registers per thread, so nothing spills. T5's lengths pad little: 512 is 8 blocks,
# the decoder's 114 pads to 128 (2 blocks, of which causality skips one tile in 4). Not tuned on a GPU: the
# keyword arguments override them.
BLOCK_Q = 64
BLOCK_K = 64
MIN_BLOCK = 16  # Triton's dot needs at least 16 along each side
NUM_WARPS = 4
NUM_STAGES = 2  # the key-block loop's loads are double-buffered


def _scaled_logits(q, k, bias, q_seg, kv_seg, rows, cols, causal: bool):
  """log2(e) (q k^T + bias) where allowed, else NEG_INF: a [block_q, block_k] float32 tile."""
  s = plt.dot(q, k, trans_b=True)
  if bias is not None:
    s = s + bias
  allowed = (q_seg[:, None] == kv_seg[None, :]) & (kv_seg[None, :] != 0)
  if causal:
    allowed = allowed & (cols[None, :] <= rows[:, None])
  return jnp.where(allowed, s * LOG2E, NEG_INF)


def _causal_key_blocks(q_block, block_q: int, block_k: int, num_k_blocks: int):
  """How many key blocks hold a key j <= i for some query i of the block (the rest are masked entirely)."""
  return jnp.minimum(jax.lax.div((q_block + 1) * block_q + block_k - 1, block_k), num_k_blocks)


def _logits_gradient(p, dw, delta, keep, keep_scale: float):
  """dS = P (dW - D), with dW = where(keep, dW' / (1 - rate), 0) under dropout."""
  if keep is not None:
    dw = jnp.where(keep, dw * keep_scale, 0.0)
  return p * (dw - delta[:, None])


def _dropped(p, keep, keep_scale: float):
  return p if keep is None else jnp.where(keep, p * keep_scale, 0.0)


def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, drop_ref, o_ref, lse_ref, *,
                    causal: bool, keep_scale: float, block_q: int, block_k: int, weights_dtype, pv_dtype):
  qb = pl.program_id(1)
  num_k_blocks = k_ref.shape[0] // block_k
  q, q_seg = q_ref[...], qseg_ref[...]
  rows = qb * block_q + jnp.arange(block_q)

  def body(kb, carry):
    acc, m, l = carry
    ks = pl.ds(kb * block_k, block_k)
    cols = kb * block_k + jnp.arange(block_k)
    s = _scaled_logits(q, k_ref[ks, :], None if bias_ref is None else bias_ref[:, ks], q_seg, kvseg_ref[ks],
                       rows, cols, causal)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    rescale = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * rescale + jnp.sum(p, axis=1)
    p = _dropped(p, None if drop_ref is None else drop_ref[:, ks], keep_scale)
    pv = plt.dot(p.astype(weights_dtype).astype(pv_dtype), v_ref[ks, :].astype(pv_dtype))
    return acc * rescale[:, None] + pv, m_new, l

  init = (jnp.zeros((block_q, q_ref.shape[-1]), f32), jnp.full((block_q,), NEG_INF, f32), jnp.zeros((block_q,), f32))
  hi = _causal_key_blocks(qb, block_q, block_k, num_k_blocks) if causal else num_k_blocks
  acc, m, l = jax.lax.fori_loop(0, hi, body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _dkv_kernel(q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, drop_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, causal: bool, keep_scale: float, block_q: int, block_k: int, weights_dtype,
                pv_dtype):
  kb = pl.program_id(1)
  num_q_blocks = q_ref.shape[0] // block_q
  k, v, kv_seg = k_ref[...], v_ref[...].astype(pv_dtype), kvseg_ref[...]
  cols = kb * block_k + jnp.arange(block_k)

  def body(qb, carry):
    dk, dv = carry
    qs = pl.ds(qb * block_q, block_q)
    rows = qb * block_q + jnp.arange(block_q)
    q, do = q_ref[qs, :], do_ref[qs, :].astype(pv_dtype)
    s = _scaled_logits(q, k, None if bias_ref is None else bias_ref[qs, :], qseg_ref[qs], kv_seg, rows, cols, causal)
    p = jnp.exp2(s - lse_ref[qs][:, None])
    keep = None if drop_ref is None else drop_ref[qs, :]
    dv = dv + plt.dot(_dropped(p, keep, keep_scale).astype(weights_dtype).astype(pv_dtype), do, trans_a=True)
    ds = _logits_gradient(p, plt.dot(do, v, trans_b=True), delta_ref[qs], keep, keep_scale)
    dk = dk + plt.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  zero = jnp.zeros((block_k, k_ref.shape[-1]), f32)
  lo = jax.lax.div(kb * block_k, block_q) if causal else 0  # query blocks before it see none of its keys
  dk, dv = jax.lax.fori_loop(lo, num_q_blocks, body, (zero, zero))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, drop_ref, do_ref, lse_ref, delta_ref, dq_ref,
               *, causal: bool, keep_scale: float, block_q: int, block_k: int, weights_dtype, pv_dtype):
  del weights_dtype
  qb = pl.program_id(1)
  num_k_blocks = k_ref.shape[0] // block_k
  q, q_seg, do = q_ref[...], qseg_ref[...], do_ref[...].astype(pv_dtype)
  lse, delta = lse_ref[...], delta_ref[...]
  rows = qb * block_q + jnp.arange(block_q)

  def body(kb, dq):
    ks = pl.ds(kb * block_k, block_k)
    cols = kb * block_k + jnp.arange(block_k)
    k = k_ref[ks, :]
    s = _scaled_logits(q, k, None if bias_ref is None else bias_ref[:, ks], q_seg, kvseg_ref[ks], rows, cols, causal)
    p = jnp.exp2(s - lse[:, None])
    keep = None if drop_ref is None else drop_ref[:, ks]
    ds = _logits_gradient(p, plt.dot(do, v_ref[ks, :].astype(pv_dtype), trans_b=True), delta, keep, keep_scale)
    return dq + plt.dot(ds.astype(k.dtype), k)

  hi = _causal_key_blocks(qb, block_q, block_k, num_k_blocks) if causal else num_k_blocks
  dq = jax.lax.fori_loop(0, hi, body, jnp.zeros((block_q, q_ref.shape[-1]), f32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dbias_kernel(q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, drop_ref, do_ref, lse_ref, delta_ref,
                  db_ref, *, causal: bool, keep_scale: float, block_q: int, block_k: int, weights_dtype, pv_dtype,
                  batch: int, per_example: bool):
  del weights_dtype
  qb, kb = pl.program_id(0), pl.program_id(1)
  rows = qb * block_q + jnp.arange(block_q)
  cols = kb * block_k + jnp.arange(block_k)

  def tile(r):  # dS of batch row r for this (query block, key block, head)
    do = do_ref[r].astype(pv_dtype)
    s = _scaled_logits(q_ref[r], k_ref[r], bias_ref[r if per_example else 0], qseg_ref[r], kvseg_ref[r], rows,
                       cols, causal)
    p = jnp.exp2(s - lse_ref[r][:, None])
    keep = None if drop_ref is None else drop_ref[r]
    return _logits_gradient(p, plt.dot(do, v_ref[r].astype(pv_dtype), trans_b=True), delta_ref[r], keep, keep_scale)

  if per_example:
    def write(r, carry):
      db_ref[r] = tile(r).astype(db_ref.dtype)
      return carry
    jax.lax.fori_loop(0, batch, write, 0)
  else:
    # Above the diagonal every logit is masked and dS is 0: the loop over the batch is skipped.
    trips = batch * (kb * block_k < (qb + 1) * block_q).astype(jnp.int32) if causal else batch
    total = jax.lax.fori_loop(0, trips, lambda r, acc: acc + tile(r), jnp.zeros((block_q, block_k), f32))
    db_ref[...] = total.astype(db_ref.dtype)


# --- pallas_calls --------------------------------------------------------------------------------------------

def _next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _block(preferred: int, length: int) -> int:
  """The block along a sequence: `preferred`, or less for a short one (a power of two >= MIN_BLOCK)."""
  return max(MIN_BLOCK, min(preferred, _next_power_of_2(length)))


class _Calls:
  """The four pallas_calls for padded shapes: batch b, lengths nq, nk (whole blocks), heads h, head dim d."""

  def __init__(self, b, nq, nk, h, d, *, bias_batch, has_drop, causal, keep_scale, block_q, block_k,
               weights_dtype, pv_dtype, num_warps, num_stages, interpret):
    self.shape = (b, nq, nk, h, d)
    self.bias_batch, self.has_drop = bias_batch, has_drop
    self.block_q, self.block_k, self.interpret = block_q, block_k, interpret
    self.static = dict(causal=causal, keep_scale=keep_scale, block_q=block_q, block_k=block_k,
                       weights_dtype=weights_dtype, pv_dtype=pv_dtype)
    self.num_warps, self.num_stages = num_warps, num_stages

  def _call(self, kernel, name, grid, in_specs, out_specs, out_shape, args):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages),
        interpret=self.interpret, name=name)(*args)

  def _specs(self, q, k, bias, qseg, kvseg, drop):
    """The BlockSpecs of (q, k, v, bias, q_seg, kv_seg, dropout mask), each given as (block shape, index map);
    None where the bias or the mask is absent."""
    return [pl.BlockSpec(*q), pl.BlockSpec(*k), pl.BlockSpec(*k),
            None if self.bias_batch is None else pl.BlockSpec(*bias), pl.BlockSpec(*qseg), pl.BlockSpec(*kvseg),
            pl.BlockSpec(*drop) if self.has_drop else None]

  @property
  def per_example(self) -> bool:
    """Whether the bias has a batch axis of its own (else one [1, h, q, k] bias is shared by the batch)."""
    return self.bias_batch == self.shape[0] and self.shape[0] > 1

  def _by_query_block(self):
    """For programs over (row, query block, head): the specs of (q, k, v, bias, q_seg, kv_seg, mask), and the
    BlockSpecs of a query block's rows [b, q, h, d] and of its statistics [b, h, q]."""
    b, nq, nk, h, d = self.shape
    bq, per_example = self.block_q, self.per_example
    in_specs = self._specs(
        ((None, bq, None, d), lambda r, i, hh: (r, i, hh, 0)),
        ((None, nk, None, d), lambda r, i, hh: (r, 0, hh, 0)),
        ((None, None, bq, nk), lambda r, i, hh: (r if per_example else 0, hh, i, 0)),
        ((None, bq), lambda r, i, hh: (r, i)),
        ((None, nk), lambda r, i, hh: (r, 0)),
        ((None, None, bq, nk), lambda r, i, hh: (r, hh, i, 0)))
    return (in_specs, pl.BlockSpec((None, bq, None, d), lambda r, i, hh: (r, i, hh, 0)),
            pl.BlockSpec((None, None, bq), lambda r, i, hh: (r, hh, i)))

  def forward(self, q, k, v, bias, qseg, kvseg, drop, out_dtype):
    b, nq, nk, h, d = self.shape
    in_specs, rows, stats = self._by_query_block()
    out_specs = [rows, stats]
    out_shape = [jax.ShapeDtypeStruct((b, nq, h, d), out_dtype), jax.ShapeDtypeStruct((b, h, nq), f32)]
    # The batch is the grid's fastest axis: programs running together read the same head's bias tiles, which
    # then come from L2 after the first reads them.
    return self._call(functools.partial(_forward_kernel, **self.static), "flash_attention_fwd",
                      (b, nq // self.block_q, h), in_specs, out_specs, out_shape, (q, k, v, bias, qseg, kvseg, drop))

  def dkv(self, *args):
    b, nq, nk, h, d = self.shape
    bk, per_example = self.block_k, self.per_example
    rows = ((None, nq, None, d), lambda r, j, hh: (r, 0, hh, 0))
    keys = ((None, bk, None, d), lambda r, j, hh: (r, j, hh, 0))
    in_specs = self._specs(
        rows, keys,
        ((None, None, nq, bk), lambda r, j, hh: (r if per_example else 0, hh, 0, j)),
        ((None, nq), lambda r, j, hh: (r, 0)),
        ((None, bk), lambda r, j, hh: (r, j)),
        ((None, None, nq, bk), lambda r, j, hh: (r, hh, 0, j)))
    stats = pl.BlockSpec((None, None, nq), lambda r, j, hh: (r, hh, 0))
    in_specs += [pl.BlockSpec(*rows), stats, stats]
    out_specs = [pl.BlockSpec(*keys), pl.BlockSpec(*keys)]
    k, v = args[1:3]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    return self._call(functools.partial(_dkv_kernel, **self.static), "flash_attention_dkv", (b, nk // bk, h),
                      in_specs, out_specs, out_shape, args)

  def dq(self, *args):
    b, nq, nk, h, d = self.shape
    in_specs, rows, stats = self._by_query_block()
    q = args[0]
    return self._call(functools.partial(_dq_kernel, **self.static), "flash_attention_dq", (b, nq // self.block_q, h),
                      in_specs + [rows, stats, stats], rows, jax.ShapeDtypeStruct(q.shape, q.dtype), args)

  def dbias(self, *args, bias_dtype):
    b, nq, nk, h, d = self.shape
    bq, bk, per_example = self.block_q, self.block_k, self.per_example
    rows = ((b, bq, None, d), lambda i, j, hh: (0, i, hh, 0))
    in_specs = self._specs(
        rows,
        ((b, bk, None, d), lambda i, j, hh: (0, j, hh, 0)),
        ((self.bias_batch, None, bq, bk), lambda i, j, hh: (0, hh, i, j)),
        ((b, bq), lambda i, j, hh: (0, i)),
        ((b, bk), lambda i, j, hh: (0, j)),
        ((b, None, bq, bk), lambda i, j, hh: (0, hh, i, j)))
    stats = pl.BlockSpec((b, None, bq), lambda i, j, hh: (0, hh, i))
    in_specs += [pl.BlockSpec(*rows), stats, stats]
    out_spec = pl.BlockSpec((b if per_example else None, None, bq, bk), lambda i, j, hh: (0, hh, i, j))
    out_shape = jax.ShapeDtypeStruct((self.bias_batch, h, nq, nk), bias_dtype)
    kernel = functools.partial(_dbias_kernel, **self.static, batch=b, per_example=per_example)
    # Query blocks vary fastest: programs running together share a key block's tiles.
    return self._call(kernel, "flash_attention_dbias", (nq // bq, nk // bk, h), in_specs, out_spec, out_shape, args)


def attention(query, key, value, *, bias=None, q_segment_ids=None, kv_segment_ids=None, causal: bool = False,
              dropout_mask=None, dropout_rate: float = 0.0, dtype=jnp.float32, interpret: bool = False,
              block_q: int = BLOCK_Q, block_k: int = BLOCK_K, num_warps: int = NUM_WARPS,
              num_stages: int = NUM_STAGES):
  """The model's attention operation (`mixers.attention.dot_product_attention`) through the kernels, with a custom
  gradient for query, key, value and bias.

  query [b, q, h, d]; key, value [b, k, h, d]; bias None, [1, h, q, k] or [b, h, q, k] (float); segment ids
  [b, q] and [b, k] (int, 0 = padding; None: every position real); dropout_mask None or [b, h, q, k] bool, with
  dropout_rate the rate it was drawn at; returns [b, q, h, d] in `dtype`. `interpret=True` runs the kernels in
  Pallas's interpreter (any platform: the tests); otherwise they lower for CUDA GPUs only."""
  b, nq, h, d = query.shape
  nk = key.shape[1]
  kernels.check_attention_shapes(query, key, value, bias)
  if dropout_mask is not None and dropout_mask.shape != (b, h, nq, nk):
    raise ValueError(f"flash attention: dropout_mask {dropout_mask.shape} must be [{b}, {h}, {nq}, {nk}]")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"flash attention: dropout_rate {dropout_rate} must be in [0, 1)")
  q_seg = jnp.ones((b, nq), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
  kv_seg = jnp.ones((b, nk), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
  drop = None if dropout_mask is None else jnp.asarray(dropout_mask, jnp.bool_)
  dtype = jnp.dtype(dtype)

  bq, bk = _block(block_q, nq), _block(block_k, nk)
  pq, pk, pd = -(-nq // bq) * bq, -(-nk // bk) * bk, max(MIN_BLOCK, _next_power_of_2(d))
  calls = _Calls(b, pq, pk, h, pd, bias_batch=None if bias is None else bias.shape[0], has_drop=drop is not None,
                 causal=causal, keep_scale=1.0 / (1.0 - dropout_rate), block_q=bq, block_k=bk,
                 weights_dtype=dtype, pv_dtype=jnp.promote_types(dtype, value.dtype), num_warps=num_warps,
                 num_stages=num_stages, interpret=interpret)

  def padded(q, k, v, bias, q_seg, kv_seg, drop):
    """Whole blocks and a power-of-two head dimension: zeros, segment id 0 (masked), mask False."""
    rows = lambda x, n: pad_axis(pad_axis(x, 1, n), 3, pd)
    tiles = lambda x, fill=0: None if x is None else pad_axis(pad_axis(x, 2, pq), 3, pk, fill)
    return (rows(q, pq), rows(k, pk), rows(v, pk), tiles(bias), pad_axis(q_seg, 1, pq), pad_axis(kv_seg, 1, pk),
            tiles(drop, False))

  @jax.custom_vjp
  def run(q, k, v, bias, q_seg, kv_seg, drop):
    return run_fwd(q, k, v, bias, q_seg, kv_seg, drop)[0]

  def run_fwd(q, k, v, bias, q_seg, kv_seg, drop):
    args = padded(q, k, v, bias, q_seg, kv_seg, drop)
    out, lse = calls.forward(*args, dtype)
    return out[:, :nq, :, :d], (args, out, lse)

  def run_bwd(residuals, g):
    args, out, lse = residuals
    do = pad_axis(pad_axis(g.astype(dtype), 1, pq), 3, pd)
    # D_i = Σ_d O[i, d] dO[i, d] per row and head, [b, h, q] (XLA fuses it into one pass over O and dO)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(f32), do.astype(f32))
    bwd = (*args, do, lse, delta)
    dk, dv = calls.dkv(*bwd)
    dq = calls.dq(*bwd)
    bias_in = args[3]
    dbias = None if bias_in is None else calls.dbias(*bwd, bias_dtype=bias_in.dtype)[:, :, :nq, :nk]
    cut = lambda x, n: x[:, :n, :, :d]
    return cut(dq, nq), cut(dk, nk), cut(dv, nk), dbias, None, None, None

  run.defvjp(run_fwd, run_bwd)
  return run(query, key, value, bias, q_seg, kv_seg, drop)


def seam(query, key, value, bias, q_segment_ids, kv_segment_ids, keep, *, reference, causal: bool,
         dropout_rate: float, dtype, float32_logits: bool = True):
  """The `pallas_gpu` implementation of the model's attention operation (`T5Config.attention_impl`; the
  reference is `mixers.attention.dot_product_attention`, whose positional arguments these are), each device's
  batch rows through the kernels under a mesh. Logits are float32 in the kernels whatever `float32_logits`."""
  del reference, float32_logits
  run = lambda q, k, v, b, qs, ks, m: attention(q, k, v, bias=b, q_segment_ids=qs, kv_segment_ids=ks,
                                                  causal=causal, dropout_mask=m, dropout_rate=dropout_rate,
                                                  dtype=dtype)
  shared = (3,) if bias is not None and bias.shape[0] == 1 else ()
  return sharding.per_batch_shard(run, shared)(query, key, value, bias, q_segment_ids, kv_segment_ids, keep)
