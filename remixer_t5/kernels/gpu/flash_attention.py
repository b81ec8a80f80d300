"""Fused (flash) attention with T5's relative position bias, its gradient included, as Pallas (Triton) kernels.

The function is `mixers.attention.dot_product_attention` (T5's attention: no 1/sqrt(d) on the logits), with
T5's bias as one value per head and key - query offset (`kernels.bias.RelativeBias`):

    allowed[b, i, j] = (q_seg[b, i] == kv_seg[b, j]) & (kv_seg[b, j] != 0) & (not causal or j <= i)
    logits[b, h, i, j] = q[b, i, h] · k[b, j, h] + rel[h, j - i + q_len - 1] + (0 if allowed else NEG_INF)
    W = softmax(logits over j) in float32, rounded to `dtype`
    W' = where(dropout_mask, W / (1 - rate), 0) when a dropout mask is given, else W
    out[b, i, h] = Σ_j W'[b, h, i, j] v[b, j, h]

Forward (FlashAttention-2, Dao 2023, Algorithm 1): one program per (row b, query block, head) walks the key
blocks with an online softmax: a running maximum m and sum l per query row and an unnormalised float32 output
accumulator, rescaled by exp(m_old - m_new) when the maximum grows. It writes the output and the log-sum-exp
L = m + log l of each row (float32, [b, h, q]); nothing of size q x k leaves the chip. A tile's bias is
gathered from the head's offset vector (q + k - 1 float32 values, read from L1/L2), not from a [h, q, k] array:
a 64 x 64 tile otherwise loads as many bytes of bias as of K and V together.

Backward (recomputation, no stored weights): with P = exp(logits - L) rebuilt tile by tile,
    dW' = dO V^T,   dW = where(mask, dW' / (1 - rate), 0),   D_i = Σ_d O[i, d] dO[i, d]  (= Σ_j P_ij dW_ij)
    dS = P ⊙ (dW - D)   (the logits' gradient),   dQ = dS K,   dK = dS^T Q,   dV = W'^T dO,
    drel[h, o] = Σ_{b, i, j: j - i = o - q_len + 1} dS[b, h, i, j]
in three kernels:
  - `dkv`: one program per (b, key block, head) walks the query blocks and accumulates dK and dV;
  - `dq`: one program per (b, query block, head) walks the key blocks and accumulates dQ;
  - `dbias`: one program per (query block, key block, head, group of batch rows) sums dS over its rows in
    registers and writes the tile once; XLA then sums the groups and each offset's diagonal ([h, q, k] values,
    no batch axis). The batch is split into groups so that the grid has ~`BIAS_PROGRAMS` programs: the
    decoder's 2 x 2 tiles a head would otherwise be 48 programs each walking all 128 rows. It recomputes QK^T
    and dO V^T for its tile (two of the backward's seven tile products) rather than moving dS through memory.
The split of dK/dV and dQ into two kernels (JAX's Pallas attention fuses them into one program when q and k
have as many blocks) keeps q != k (cross-attention) and causal bounds simple.

Masks only where they can bite: with causal masking, key blocks wholly at or below the diagonal take no causal
comparison (each loop is split in two at the diagonal) and those above it are skipped; without segment ids
(and no padding) there is no segment comparison at all.

Supported: float32 and bfloat16 (any float dtype Triton's dot takes) queries, keys and values with one head dimension d
(padded to a power of two >= 16 with zeros); any q and k lengths (padded to whole blocks with segment id 0, which masks
them); bias None or a `RelativeBias` (its gradient per offset); segment ids (0 = padding), causal masking, and a dropout
mask given as a [b, h, q, k] bool array (read tile by tile, never written: the kernels draw no random numbers). Not
supported: a dense [., h, q, k] bias (the seam hands it to the reference), different head dimensions for values, grouped
keys/values, higher-order derivatives, and partitioning: XLA does not partition a custom call, so under a mesh the caller
runs it per batch shard (and sums the bias gradient over the shards). Padding is by copies (masked loads would avoid
them), the outputs sliced: T5's 512 encoder positions need none, its 114 decoder positions pad to 128.

Tiles: `TILINGS` holds the (block_q, block_k, num_warps, num_stages) of the forward and of the gradient kernels per GPU
(`device_kind`), measured by scripts/gpu_measure.py's attention stage; a GPU without a row takes "default".

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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from remixer_t5 import kernels
from remixer_t5.kernels import pad_axis, sharding
from remixer_t5.kernels.bias import RelativeBias, check as check_bias

f32 = jnp.float32
NEG_INF = -1e10  # layers.NEG_INF: the mask value of the reference (finite, so fully masked rows stay finite)
LOG2E = math.log2(math.e)
MIN_BLOCK = 16  # Triton's dot needs at least 16 along each side
BIAS_PROGRAMS = 1024  # the bias gradient's grid: ~8 programs per SM of an H100/H200 (132 SMs)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """A kernel's tile: query and key block lengths (powers of two >= 16), Triton's warps and pipeline stages."""

  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2


# device_kind -> (forward, gradient kernels). The default: tiles of 64 x 64, 64 rows a whole H100 warpgroup MMA
# (m64); with d = 64 and 4 warps the forward's accumulator, logits and weights tiles each take 32 float32
# registers a thread, so nothing spills; two stages double-buffer the key-block loop's loads. T5's lengths pad
# little at 64: 512 is 8 blocks, the decoder's 114 pads to 128.
TILINGS = {"default": (Tiling(), Tiling())}


def tilings(device_kind: str | None = None) -> tuple[Tiling, Tiling]:
  """The (forward, gradient) tilings for a GPU by its device kind (the compile target's when None)."""
  kind = kernels.target_device().device_kind if device_kind is None else device_kind
  return TILINGS.get(kind, TILINGS["default"])


@dataclasses.dataclass(frozen=True)
class _Static:
  """What every kernel body is specialised on."""

  block_q: int
  block_k: int
  keep_scale: float
  weights_dtype: object
  pv_dtype: object
  rel_offset: int  # the padded offset vector's index of key - query = 0 (the padded query length - 1)


def _scaled_logits(q, k, rel_ref, q_seg, kv_seg, rows, cols, st: _Static, causal: bool):
  """log2(e) (q k^T + bias) where allowed, else NEG_INF: a [block_q, block_k] float32 tile."""
  s = plt.dot(q, k, trans_b=True)
  if rel_ref is not None:
    s = s + rel_ref[cols[None, :] - rows[:, None] + st.rel_offset]
  s = s * LOG2E
  allowed = None if q_seg is None else (q_seg[:, None] == kv_seg[None, :]) & (kv_seg[None, :] != 0)
  if causal:
    below = cols[None, :] <= rows[:, None]
    allowed = below if allowed is None else allowed & below
  return s if allowed is None else jnp.where(allowed, s, NEG_INF)


def _logits_gradient(p, dw, delta, keep, keep_scale: float):
  """dS = P (dW - D), with dW = where(keep, dW' / (1 - rate), 0) under dropout."""
  if keep is not None:
    dw = jnp.where(keep, dw * keep_scale, 0.0)
  return p * (dw - delta[:, None])


def _dropped(p, keep, keep_scale: float):
  return p if keep is None else jnp.where(keep, p * keep_scale, 0.0)


def _read(ref, index=...):
  return None if ref is None else ref[index]


def _split_at_diagonal(body, lo, diagonal, hi, carry, *, masked_first: bool):
  """`body(causal)` over blocks lo..hi in two loops: the blocks on the diagonal with the causal comparison,
  the rest without; `diagonal` is where they meet (the masked blocks come first when `masked_first`)."""
  diagonal = jnp.clip(diagonal, lo, hi)
  first, second = (body(True), body(False)) if masked_first else (body(False), body(True))
  carry = jax.lax.fori_loop(lo, diagonal, first, carry)
  return jax.lax.fori_loop(diagonal, hi, second, carry)


def _forward_kernel(
  q_ref, k_ref, v_ref, rel_ref, qseg_ref, kvseg_ref, drop_ref, o_ref, lse_ref, *, st: _Static, causal: bool
):
  bq, bk = st.block_q, st.block_k
  qb = pl.program_id(1)
  num_k_blocks = k_ref.shape[0] // bk
  q, q_seg = q_ref[...], _read(qseg_ref)
  rows = qb * bq + jnp.arange(bq)

  def body(masked):
    def step(kb, carry):
      acc, m, l = carry
      ks = pl.ds(kb * bk, bk)
      cols = kb * bk + jnp.arange(bk)
      s = _scaled_logits(q, k_ref[ks, :], rel_ref, q_seg, _read(kvseg_ref, ks), rows, cols, st, masked)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      rescale = jnp.exp2(m - m_new)
      p = jnp.exp2(s - m_new[:, None])
      l = l * rescale + jnp.sum(p, axis=1)
      p = _dropped(p, _read(drop_ref, (slice(None), ks)), st.keep_scale)
      pv = plt.dot(p.astype(st.weights_dtype).astype(st.pv_dtype), v_ref[ks, :].astype(st.pv_dtype))
      return acc * rescale[:, None] + pv, m_new, l

    return step

  init = (jnp.zeros((bq, q_ref.shape[-1]), f32), jnp.full((bq,), NEG_INF, f32), jnp.zeros((bq,), f32))
  if causal:  # key blocks below the first query row need no comparison; those past the last are skipped
    hi = jnp.minimum(jax.lax.div((qb + 1) * bq + bk - 1, bk), num_k_blocks)
    acc, m, l = _split_at_diagonal(body, 0, jax.lax.div(qb * bq + 1, bk), hi, init, masked_first=False)
  else:
    acc, m, l = jax.lax.fori_loop(0, num_k_blocks, body(False), init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _dkv_kernel(
  q_ref,
  k_ref,
  v_ref,
  rel_ref,
  qseg_ref,
  kvseg_ref,
  drop_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dk_ref,
  dv_ref,
  *,
  st: _Static,
  causal: bool,
):
  bq, bk = st.block_q, st.block_k
  kb = pl.program_id(1)
  num_q_blocks = q_ref.shape[0] // bq
  k, v, kv_seg = k_ref[...], v_ref[...].astype(st.pv_dtype), _read(kvseg_ref)
  cols = kb * bk + jnp.arange(bk)

  def body(masked):
    def step(qb, carry):
      dk, dv = carry
      qs = pl.ds(qb * bq, bq)
      rows = qb * bq + jnp.arange(bq)
      q, do = q_ref[qs, :], do_ref[qs, :].astype(st.pv_dtype)
      s = _scaled_logits(q, k, rel_ref, _read(qseg_ref, qs), kv_seg, rows, cols, st, masked)
      p = jnp.exp2(s - lse_ref[qs][:, None])
      keep = _read(drop_ref, (qs, slice(None)))
      dv = dv + plt.dot(_dropped(p, keep, st.keep_scale).astype(st.weights_dtype).astype(st.pv_dtype), do, trans_a=True)
      ds = _logits_gradient(p, plt.dot(do, v, trans_b=True), delta_ref[qs], keep, st.keep_scale)
      return dk + plt.dot(ds.astype(q.dtype), q, trans_a=True), dv

    return step

  zero = jnp.zeros((bk, k_ref.shape[-1]), f32)
  if causal:  # query blocks before the block's first key see none of it; those after its last key see all
    lo = jax.lax.div(kb * bk, bq)
    dk, dv = _split_at_diagonal(
      body, lo, jax.lax.div(kb * bk + bk - 1 + bq - 1, bq), num_q_blocks, (zero, zero), masked_first=True
    )
  else:
    dk, dv = jax.lax.fori_loop(0, num_q_blocks, body(False), (zero, zero))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
  q_ref,
  k_ref,
  v_ref,
  rel_ref,
  qseg_ref,
  kvseg_ref,
  drop_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dq_ref,
  *,
  st: _Static,
  causal: bool,
):
  bq, bk = st.block_q, st.block_k
  qb = pl.program_id(1)
  num_k_blocks = k_ref.shape[0] // bk
  q, q_seg, do = q_ref[...], _read(qseg_ref), do_ref[...].astype(st.pv_dtype)
  lse, delta = lse_ref[...], delta_ref[...]
  rows = qb * bq + jnp.arange(bq)

  def body(masked):
    def step(kb, dq):
      ks = pl.ds(kb * bk, bk)
      cols = kb * bk + jnp.arange(bk)
      k = k_ref[ks, :]
      s = _scaled_logits(q, k, rel_ref, q_seg, _read(kvseg_ref, ks), rows, cols, st, masked)
      p = jnp.exp2(s - lse[:, None])
      keep = _read(drop_ref, (slice(None), ks))
      ds = _logits_gradient(p, plt.dot(do, v_ref[ks, :].astype(st.pv_dtype), trans_b=True), delta, keep, st.keep_scale)
      return dq + plt.dot(ds.astype(k.dtype), k)

    return step

  zero = jnp.zeros((bq, q_ref.shape[-1]), f32)
  if causal:
    hi = jnp.minimum(jax.lax.div((qb + 1) * bq + bk - 1, bk), num_k_blocks)
    dq = _split_at_diagonal(body, 0, jax.lax.div(qb * bq + 1, bk), hi, zero, masked_first=False)
  else:
    dq = jax.lax.fori_loop(0, num_k_blocks, body(False), zero)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dbias_kernel(
  q_ref,
  k_ref,
  v_ref,
  rel_ref,
  qseg_ref,
  kvseg_ref,
  drop_ref,
  do_ref,
  lse_ref,
  delta_ref,
  db_ref,
  *,
  st: _Static,
  causal: bool,
  batch: int,
  rows_per_program: int,
):
  bq, bk = st.block_q, st.block_k
  qb, kb, group = pl.program_id(0), pl.program_id(1), pl.program_id(3)
  rows = qb * bq + jnp.arange(bq)
  cols = kb * bk + jnp.arange(bk)

  def body(masked):
    def step(r, total):  # dS of batch row r for this (query block, key block, head), added to the sum
      do = do_ref[r].astype(st.pv_dtype)
      s = _scaled_logits(q_ref[r], k_ref[r], rel_ref, _read(qseg_ref, r), _read(kvseg_ref, r), rows, cols, st, masked)
      p = jnp.exp2(s - lse_ref[r][:, None])
      ds = _logits_gradient(
        p, plt.dot(do, v_ref[r].astype(st.pv_dtype), trans_b=True), delta_ref[r], _read(drop_ref, r), st.keep_scale
      )
      return total + ds

    return step

  lo = group * rows_per_program
  hi = jnp.minimum(lo + rows_per_program, batch)
  zero = jnp.zeros((bq, bk), f32)
  if causal:
    # Above the diagonal every logit is masked and dS is 0 (no rows walked); below it nothing is masked.
    above, below = kb * bk > qb * bq + bq - 1, kb * bk + bk - 1 <= qb * bq
    hi = jnp.where(above, lo, hi)
    total = jax.lax.cond(
      below, lambda: jax.lax.fori_loop(lo, hi, body(False), zero), lambda: jax.lax.fori_loop(lo, hi, body(True), zero)
    )
  else:
    total = jax.lax.fori_loop(lo, hi, body(False), zero)
  db_ref[...] = total


# --- pallas_calls --------------------------------------------------------------------------------------------


def _next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _block(preferred: int, length: int) -> int:
  """The block along a sequence: `preferred`, or less for a short one (a power of two >= MIN_BLOCK)."""
  return max(MIN_BLOCK, min(preferred, _next_power_of_2(length)))


def bias_groups(batch: int, tiles: int, programs: int = BIAS_PROGRAMS) -> tuple[int, int]:
  """(groups, rows a group) splitting `batch` rows so the bias gradient's grid of `tiles` x groups programs
  has about `programs` of them."""
  rows = -(-batch // max(1, min(batch, -(-programs // tiles))))
  return -(-batch // rows), rows


class _Calls:
  """The four pallas_calls for padded shapes: batch b, lengths nq, nk (whole blocks), heads h, head dim d."""

  def __init__(
    self,
    b,
    nq,
    nk,
    h,
    d,
    *,
    tiling: tuple[Tiling, Tiling],
    has_rel,
    has_seg,
    has_drop,
    causal,
    keep_scale,
    weights_dtype,
    pv_dtype,
    interpret,
  ):
    self.shape = (b, nq, nk, h, d)
    self.has = dict(rel=has_rel, seg=has_seg, drop=has_drop)
    self.causal, self.interpret = causal, interpret
    self.tiling = dict(zip(("forward", "backward"), tiling))
    self.static = {
      k: _Static(_block(t.block_q, nq), _block(t.block_k, nk), keep_scale, weights_dtype, pv_dtype, nq - 1)
      for k, t in self.tiling.items()
    }

  def _call(self, kernel, direction, name, grid, in_specs, out_specs, out_shape, args, **static):
    t = self.tiling[direction]
    return pl.pallas_call(
      functools.partial(kernel, st=self.static[direction], causal=self.causal, **static),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
      interpret=self.interpret,
      name=name,
    )(*args)

  def _specs(self, q, k, rel, qseg, kvseg, drop):
    """The BlockSpecs of (q, k, v, rel, q_seg, kv_seg, dropout mask), each given as (block shape, index map);
    None where the bias, the segment ids or the mask is absent."""
    has = self.has
    opt = lambda present, spec: pl.BlockSpec(*spec) if present else None
    return [
      pl.BlockSpec(*q),
      pl.BlockSpec(*k),
      pl.BlockSpec(*k),
      opt(has["rel"], rel),
      opt(has["seg"], qseg),
      opt(has["seg"], kvseg),
      opt(has["drop"], drop),
    ]

  def _rel(self, head):
    """The head's whole offset vector [h, nq + nk]: (block shape, index map)."""
    nq, nk = self.shape[1:3]
    return (None, nq + nk), lambda *ids: (ids[head], 0)

  def _by_query_block(self):
    """For programs over (row, query block, head): the specs of (q, k, v, rel, q_seg, kv_seg, mask), and the
    BlockSpecs of a query block's rows [b, q, h, d] and of its statistics [b, h, q]."""
    b, nq, nk, h, d = self.shape
    bq = self.static["backward"].block_q
    in_specs = self._specs(
      ((None, bq, None, d), lambda r, i, hh: (r, i, hh, 0)),
      ((None, nk, None, d), lambda r, i, hh: (r, 0, hh, 0)),
      self._rel(2),
      ((None, bq), lambda r, i, hh: (r, i)),
      ((None, nk), lambda r, i, hh: (r, 0)),
      ((None, None, bq, nk), lambda r, i, hh: (r, hh, i, 0)),
    )
    return (
      in_specs,
      pl.BlockSpec((None, bq, None, d), lambda r, i, hh: (r, i, hh, 0)),
      pl.BlockSpec((None, None, bq), lambda r, i, hh: (r, hh, i)),
    )

  def forward(self, q, k, v, rel, qseg, kvseg, drop, out_dtype):
    b, nq, nk, h, d = self.shape
    bq = self.static["forward"].block_q
    in_specs = self._specs(
      ((None, bq, None, d), lambda r, i, hh: (r, i, hh, 0)),
      ((None, nk, None, d), lambda r, i, hh: (r, 0, hh, 0)),
      self._rel(2),
      ((None, bq), lambda r, i, hh: (r, i)),
      ((None, nk), lambda r, i, hh: (r, 0)),
      ((None, None, bq, nk), lambda r, i, hh: (r, hh, i, 0)),
    )
    out_specs = [
      pl.BlockSpec((None, bq, None, d), lambda r, i, hh: (r, i, hh, 0)),
      pl.BlockSpec((None, None, bq), lambda r, i, hh: (r, hh, i)),
    ]
    out_shape = [jax.ShapeDtypeStruct((b, nq, h, d), out_dtype), jax.ShapeDtypeStruct((b, h, nq), f32)]
    # The batch is the grid's fastest axis: programs running together read the same head's K/V columns' bias.
    return self._call(
      _forward_kernel,
      "forward",
      "flash_attention_fwd",
      (b, nq // bq, h),
      in_specs,
      out_specs,
      out_shape,
      (q, k, v, rel, qseg, kvseg, drop),
    )

  def dkv(self, *args):
    b, nq, nk, h, d = self.shape
    bk = self.static["backward"].block_k
    rows = ((None, nq, None, d), lambda r, j, hh: (r, 0, hh, 0))
    keys = ((None, bk, None, d), lambda r, j, hh: (r, j, hh, 0))
    in_specs = self._specs(
      rows,
      keys,
      self._rel(2),
      ((None, nq), lambda r, j, hh: (r, 0)),
      ((None, bk), lambda r, j, hh: (r, j)),
      ((None, None, nq, bk), lambda r, j, hh: (r, hh, 0, j)),
    )
    stats = pl.BlockSpec((None, None, nq), lambda r, j, hh: (r, hh, 0))
    in_specs += [pl.BlockSpec(*rows), stats, stats]
    out_specs = [pl.BlockSpec(*keys), pl.BlockSpec(*keys)]
    k, v = args[1:3]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    return self._call(
      _dkv_kernel, "backward", "flash_attention_dkv", (b, nk // bk, h), in_specs, out_specs, out_shape, args
    )

  def dq(self, *args):
    b, nq, nk, h, d = self.shape
    in_specs, rows, stats = self._by_query_block()
    q = args[0]
    return self._call(
      _dq_kernel,
      "backward",
      "flash_attention_dq",
      (b, nq // self.static["backward"].block_q, h),
      in_specs + [rows, stats, stats],
      rows,
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      args,
    )

  def dbias(self, *args):
    """The bias gradient's tiles summed over each group of batch rows: [groups, h, nq, nk] float32."""
    b, nq, nk, h, d = self.shape
    st = self.static["backward"]
    bq, bk = st.block_q, st.block_k
    groups, rows_per_program = bias_groups(b, (nq // bq) * (nk // bk) * h)
    rows = ((b, bq, None, d), lambda i, j, hh, g: (0, i, hh, 0))
    in_specs = self._specs(
      rows,
      ((b, bk, None, d), lambda i, j, hh, g: (0, j, hh, 0)),
      self._rel(2),
      ((b, bq), lambda i, j, hh, g: (0, i)),
      ((b, bk), lambda i, j, hh, g: (0, j)),
      ((b, None, bq, bk), lambda i, j, hh, g: (0, hh, i, j)),
    )
    stats = pl.BlockSpec((b, None, bq), lambda i, j, hh, g: (0, hh, i))
    in_specs += [pl.BlockSpec(*rows), stats, stats]
    out_spec = pl.BlockSpec((None, None, bq, bk), lambda i, j, hh, g: (g, hh, i, j))
    out_shape = jax.ShapeDtypeStruct((groups, h, nq, nk), f32)
    # Query blocks vary fastest: programs running together share a key block's tiles.
    return self._call(
      _dbias_kernel,
      "backward",
      "flash_attention_dbias",
      (nq // bq, nk // bk, h, groups),
      in_specs,
      out_spec,
      out_shape,
      args,
      batch=b,
      rows_per_program=rows_per_program,
    )


def attention(
  query,
  key,
  value,
  *,
  bias: RelativeBias | None = None,
  q_segment_ids=None,
  kv_segment_ids=None,
  causal: bool = False,
  dropout_mask=None,
  dropout_rate: float = 0.0,
  dtype=jnp.float32,
  interpret: bool = False,
  tiling: tuple[Tiling, Tiling] | Tiling | None = None,
):
  """The model's attention operation (`mixers.attention.dot_product_attention`) through the kernels, with a custom
  gradient for query, key, value and the bias's values.

  query [b, q, h, d]; key, value [b, k, h, d]; bias None or a `RelativeBias` ([h, q + k - 1] values); segment
  ids [b, q] and [b, k] (int, 0 = padding; None: every position real); dropout_mask None or [b, h, q, k] bool,
  with dropout_rate the rate it was drawn at; returns [b, q, h, d] in `dtype`. `tiling`: (forward, gradient)
  tilings, or one for both (None: `tilings()`, by the GPU compiled for). `interpret=True` runs the kernels in
  Pallas's interpreter (any platform: the tests); otherwise they lower for CUDA GPUs only."""
  b, nq, h, d = query.shape
  nk = key.shape[1]
  kernels.check_attention_shapes(query, key, value, None)
  if bias is not None:
    check_bias(bias, h, nq, nk, "flash attention")
  if dropout_mask is not None and dropout_mask.shape != (b, h, nq, nk):
    raise ValueError(f"flash attention: dropout_mask {dropout_mask.shape} must be [{b}, {h}, {nq}, {nk}]")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"flash attention: dropout_rate {dropout_rate} must be in [0, 1)")
  tiling = tilings() if tiling is None else (tiling, tiling) if isinstance(tiling, Tiling) else tuple(tiling)
  block = lambda side, n: max(_block(getattr(t, side), n) for t in tiling)  # a multiple of each kernel's
  pq, pk, pd = (
    -(-nq // block("block_q", nq)) * block("block_q", nq),
    -(-nk // block("block_k", nk)) * block("block_k", nk),
    max(MIN_BLOCK, _next_power_of_2(d)),
  )
  # Segment ids are compared only when given, or when padding to whole blocks adds keys to mask.
  has_seg = q_segment_ids is not None or kv_segment_ids is not None or pk != nk
  seg = lambda ids, n: (
    None if not has_seg else (jnp.ones((b, n), jnp.int32) if ids is None else jnp.asarray(ids, jnp.int32))
  )
  q_seg, kv_seg = seg(q_segment_ids, nq), seg(kv_segment_ids, nk)
  drop = None if dropout_mask is None else jnp.asarray(dropout_mask, jnp.bool_)
  dtype = jnp.dtype(dtype)
  calls = _Calls(
    b,
    pq,
    pk,
    h,
    pd,
    tiling=tiling,
    has_rel=bias is not None,
    has_seg=has_seg,
    has_drop=drop is not None,
    causal=causal,
    keep_scale=1.0 / (1.0 - dropout_rate),
    weights_dtype=dtype,
    pv_dtype=jnp.promote_types(dtype, value.dtype),
    interpret=interpret,
  )

  def padded(q, k, v, rel, q_seg, kv_seg, drop):
    """Whole blocks and a power-of-two head dimension: zeros, segment id 0 (masked), mask False; the offset
    vector [h, pq + pk] indexed by key - query + pq - 1 (zeros for the padded rows' and columns' offsets)."""
    rows = lambda x, n: pad_axis(pad_axis(x, 1, n), 3, pd)
    pad = lambda x, n: None if x is None else pad_axis(x, 1, n)
    if rel is not None:
      rel = jnp.pad(rel, ((0, 0), (pq - nq, pk - nk + 1)))
    drop = None if drop is None else pad_axis(pad_axis(drop, 2, pq), 3, pk, False)
    return rows(q, pq), rows(k, pk), rows(v, pk), rel, pad(q_seg, pq), pad(kv_seg, pk), drop

  @jax.custom_vjp
  def run(q, k, v, rel, q_seg, kv_seg, drop):
    return run_fwd(q, k, v, rel, q_seg, kv_seg, drop)[0]

  def run_fwd(q, k, v, rel, q_seg, kv_seg, drop):
    args = padded(q, k, v, rel, q_seg, kv_seg, drop)
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
    drel = None
    if args[3] is not None:  # the groups' tiles summed, then each offset's diagonal: [h, pq + pk - 1]
      sums = RelativeBias(jnp.zeros((h, pq + pk - 1), f32), pq).offset_sums(calls.dbias(*bwd).sum(0))
      drel = sums[:, pq - nq : pq + nk - 1]
    cut = lambda x, n: x[:, :n, :, :d]
    return cut(dq, nq), cut(dk, nk), cut(dv, nk), drel, None, None, None

  run.defvjp(run_fwd, run_bwd)
  rel = None if bias is None else bias.values.astype(f32)
  return run(query, key, value, rel, q_seg, kv_seg, drop)


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
  """The `pallas_gpu` implementation of the model's attention operation (`T5Config.attention_impl`; the
  reference is `mixers.attention.dot_product_attention`, whose positional arguments these are), each device's
  batch rows through the kernels under a mesh. Logits are float32 in the kernels whatever `float32_logits`. A
  dense bias (not T5's per-offset one) goes to the reference."""
  del float32_logits
  if bias is not None and not isinstance(bias, RelativeBias):
    return kernels.hand_back(
      reference,
      "the kernel takes T5's relative bias (kernels.bias.RelativeBias), not a dense bias",
      query,
      key,
      value,
      bias,
      q_segment_ids,
      kv_segment_ids,
      keep,
    )
  q_len = query.shape[1]
  run = lambda q, k, v, rel, qs, ks, m: attention(
    q,
    k,
    v,
    bias=None if rel is None else RelativeBias(rel[0], q_len),
    q_segment_ids=qs,
    kv_segment_ids=ks,
    causal=causal,
    dropout_mask=m,
    dropout_rate=dropout_rate,
    dtype=dtype,
  )
  rel = None if bias is None else bias.values[None]  # shared by the batch: one copy per shard
  return sharding.per_batch_shard(run, (3,))(query, key, value, rel, q_segment_ids, kv_segment_ids, keep)
