"""HyperMixing, the token mixer of HyperMixer (Mai et al., "HyperMixer: An MLP-based Low Cost Alternative to
Transformers", ACL 2023, §2.3, Algorithm 1, Appendices D and F).

A token-mixing MLP (Eq. 1) whose weights are generated per token by hypernetworks (§2.3):

    W1[j] = MLP^{W1}(x_j + p_j)      keys j          (h_1)
    W2[i] = MLP^{W2}(q_i + p_i)      queries i       (h_2; tied: h_2 = h_1, §2.3 "Tying h_1 and h_2")
    out   = LayerNorm(W2 GELU(W1^T X))                (Eq. 1, generated weights; LayerNorm: Algorithm 1, App. F)

X are the values (= keys' vectors, without p). W1^T X ∈ R^{d'×d} sums over the keys, so the cost is linear in
the length and no length×length matrix exists. p_j are absolute sinusoidal position features (Vaswani et al.
2017, as the paper cites), built from the positions in ctx (restarting in each packed segment), so the module
has no maximum length. Length normalisation (App. F) divides W1 by the number of visible keys.

Beyond the paper (which leaves decoders to future work): a causal form out_i = W2[i] GELU(Σ_{j<=i} W1[j]^T x_j), i.e.
the full formula applied to every prefix. Its hidden state Σ_{j<=i} W1[j]^T x_j is a d'×d matrix per query (the GELU
sits between the two sums, so nothing factors as in linear attention); a lax.scan over chunks of `chunk_size` positions
carries that running sum and inside a chunk uses the masked lower-triangular sum, so memory is O(chunk × d' × d) (the
chunk body is rematerialised for the gradient); faster kernels of the same function are named implementations (`impl`).
Decoding caches the running sum. Packed rows: the causal scan restarts the sum where the segment id changes (exact for
contiguous segments, as seqio packs them); the non-causal form (self or cross) computes one hidden state per segment
id, `segment_block` ids at a time, skipping blocks above the batch's largest id, so its cost grows with the number of
packed examples per row, not with the length squared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5 import kernels
from remixer_t5.model import layers
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import base

Array = jax.Array
f32 = jnp.float32


def gelu(x: Array) -> Array:
  """The exact GELU x·Φ(x) (PyTorch's nn.GELU, which the paper's code uses), in the form PyTorch computes it,
  0.5·x·(1 + erf(x/√2)): within 1e-6 of jax.nn.gelu(approximate=False), whose erfc form is slower on XLA:CPU,
  and the causal form evaluates it on every position's d'×d state."""
  return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(0.7071067811865476, x.dtype)))


class HyperNetwork(nn.Module):
  """MLP^{W_i}: R^d -> R^{d'} with one GELU hidden layer, applied to each token alone (§2.3; Algorithm 1's
  MLP([d, d, d']))."""

  hidden_dim: int
  out_dim: int
  use_bias: bool = True
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    def bias(name, size, axis):
      return layers.param_with_axes(name, nn.initializers.zeros, (size,), f32, axes=(axis,)).astype(self.dtype)

    h = layers.Dense(self.hidden_dim, ("embed", "mlp"), dtype=self.dtype, name="wi")(x)
    if self.use_bias:
      h = h + bias("wi_bias", self.hidden_dim, "mlp")
    w = layers.Dense(self.out_dim, ("mlp", "mix_hidden"), dtype=self.dtype, name="wo")(gelu(h))
    if self.use_bias:
      w = w + bias("wo_bias", self.out_dim, "mix_hidden")
    return w


def activate(hsum: Array, count: Array | None, dtype) -> Array:
  """GELU of the TM-MLP hidden layer; `count` (broadcastable) divides it for length normalisation."""
  if count is not None:
    hsum = hsum / jnp.maximum(count, 1.0)
  return gelu(hsum).astype(dtype)


class HyperMixing(nn.Module):
  """HyperMixing (§2.3, Algorithm 1), token slot (self-mixing, encoder or causal decoder) or cross slot
  (W2 from the decoder queries; W1 and X from the encoder output, masked by ctx.kv_mask).

  Fields:
    hidden_dim: d', the width of the token-mixing MLP's hidden layer (the rows of W1, W2); 0 means
      cfg.mlp_dim (the paper uses d' = 512 = its feature-MLP width, with d = 256, App. B.2).
    hyper_hidden_dim: hidden width of each hypernetwork MLP; 0 means cfg.emb_dim (MLP([d, d, d'])).
    tied: one hypernetwork for W1 and W2 (§2.3; the paper's default, untied is the App. C.2 ablation).
    layer_norm: LayerNorm on the TM-MLP output (Algorithm 1; App. F recommends it by default).
    length_normalize: divide W1 by the number M of keys each query sees (App. F: "scale the generated
      weight matrices by 1/M" so the hidden layer's magnitude does not grow with the length; W2 sums over
      nothing, so only W1 is scaled): the real keys of the query's segment, or of its prefix when causal.
    position_features: 'sinusoidal' (p_j of §2.3 as absolute sinusoidal embeddings) or 'none' (p_j = 0;
      the layer is then permutation-equivariant).
    query_positions: add p_i to the queries too (Algorithm 1). Set it False in the cross slot: there the
      decoder's own layers already know its positions, and at decode steps the cross slot is not told the
      step (ctx.q_positions spans max_decode_length), so it refuses to run with it on.
    use_bias: biases in the hypernetwork MLPs (the paper's MLPs are PyTorch Linear layers, with biases;
      the official implementation, github.com/idiap/hypermixing, defaults to `hypernetwork_bias=False`).
    scale_inputs: multiply the token vectors by sqrt(d) before the position features are added, as the
      official implementation's positional encoding does (`x * sqrt(d_model) + pe`); the paper's text adds
      p_j to x_j unscaled (§2.3). Only the hypernetworks' inputs are scaled, never the values X.
    chunk_size: positions per step of the causal scan. The chunk's states take batch × chunk × d' × d floats
      and its masked sum batch × length × (chunk + 1) × d' × d multiply-adds (the carried sum is one more key
      row), so small chunks are cheaper in both (docs/architectures.md has the measurements).
    segment_block: segment ids handled per step of the packed non-causal form (a step costs about
      segment_block times an unpacked pass; steps above the batch's largest segment id are skipped).
    impl: which implementation computes the causal and the packed non-causal forms (kernels/__init__.py):
      'auto' (by the platform the program is lowered for), 'xla' (the scan and the id blocks below), 'cpu'
      (kernels/cpu/hypermixing.py: fused C++ loops, one running state per sequence or (row, id), float32, one
      device) or 'pallas_gpu' (kernels/gpu/hypermixing.py: the causal form's state tiles kept on chip).

  Parameters (d = emb_dim, e = hyper_hidden_dim): per hypernetwork `wi` [d, e] ('embed','mlp'), `wi_bias` [e]
  ('mlp',), `wo` [e, d'] ('mlp','mix_hidden'), `wo_bias` [d'] ('mix_hidden',), under `hypernetwork_in` (h_1)
  and, untied, `hypernetwork_out` (h_2); `layer_norm` scale and bias [d] ('embed',). Per layer:
  T·(d·e + e·d' + e + d') + 2d with T = 1 tied, 2 untied (biases and LayerNorm only when enabled)."""

  config: T5Config
  hidden_dim: int = 0
  hyper_hidden_dim: int = 0
  tied: bool = True
  layer_norm: bool = True
  length_normalize: bool = False
  position_features: str = "sinusoidal"
  query_positions: bool = True
  use_bias: bool = True
  scale_inputs: bool = False
  chunk_size: int = 8
  segment_block: int = 4
  impl: str = "auto"

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, *, deterministic: bool = True) -> Array:
    del deterministic  # the paper puts dropout at the layer input, which the stack owns
    cfg = self.config
    kernels.check("hypermixer.HyperMixing.impl", self.impl)
    if self.position_features not in ("none", "sinusoidal"):
      raise ValueError(f"HyperMixing.position_features must be 'none' or 'sinusoidal', got {self.position_features!r}")
    if (ctx.q_segment_ids is None) != (ctx.kv_segment_ids is None):
      raise ValueError("HyperMixing needs segment ids on both the query and the key side, or on neither")
    if ctx.causal and not ctx.decode and inputs_q.shape[1] != inputs_kv.shape[1]:
      raise ValueError(
        "causal HyperMixing mixes a sequence with itself; got query length "
        f"{inputs_q.shape[1]} and key length {inputs_kv.shape[1]}"
      )
    dtype = cfg.dtype
    hidden = self.hidden_dim or cfg.mlp_dim
    net = lambda name: HyperNetwork(self.hyper_hidden_dim or cfg.emb_dim, hidden, self.use_bias, dtype, name=name)
    h_in = net("hypernetwork_in")
    h_out = h_in if self.tied else net("hypernetwork_out")

    if ctx.decode:
      out = self._decode(h_in, h_out, inputs_q, inputs_kv, ctx, hidden)
    else:
      w1, w2 = self._generate(h_in, h_out, inputs_q, inputs_kv, ctx.q_positions, ctx.kv_positions)
      w1 = w1 * ctx.kv_mask.astype(dtype)[:, :, None]  # padded keys add nothing
      x, kv_mask = inputs_kv.astype(dtype), ctx.kv_mask.astype(f32)
      if ctx.causal:
        out = self._causal(w1, x, w2, kv_mask, ctx.q_segment_ids)
      elif ctx.packed:
        out = self._segmented(w1, x, w2, kv_mask, ctx.q_segment_ids, ctx.kv_segment_ids)
      else:  # one d'×d hidden layer shared by all queries: linear in the length
        hsum = layers.accumulating_einsum("bjh,bjd->bhd", w1, x)
        count = kv_mask.sum(-1)[:, None, None] if self.length_normalize else None
        out = jnp.einsum("bih,bhd->bid", w2, activate(hsum, count, dtype))
    if self.layer_norm:
      out = layers.LayerNorm(cfg.layer_norm_epsilon, dtype, name="layer_norm")(out)
    return out.astype(dtype)

  def _generate(self, h_in, h_out, inputs_q, inputs_kv, q_positions, kv_positions) -> tuple[Array, Array]:
    """W1 = h_1(keys + p), W2 = h_2(queries + p); tied self-mixing computes the one hypernetwork once."""
    w1 = h_in(self._add_positions(inputs_kv, kv_positions))
    if self.tied and self.query_positions and inputs_q is inputs_kv and q_positions is kv_positions:
      return w1, w1
    if not self.query_positions:
      return w1, h_out(self._add_positions(inputs_q, None))
    if self.position_features != "none" and q_positions.shape[-1] != inputs_q.shape[1]:
      raise ValueError(
        f"HyperMixing got {q_positions.shape[-1]} query positions for {inputs_q.shape[1]} "
        "queries (a decode step in the cross slot?); set HyperMixing.query_positions=False "
        "for cross-mixing"
      )
    return w1, h_out(self._add_positions(inputs_q, q_positions))

  def _add_positions(self, x: Array, positions: Array | None) -> Array:
    """x_j + p_j, the hypernetworks' input (§2.3); sqrt(d) x_j + p_j with `scale_inputs` (official code); no p_j
    for `positions=None` (queries with `query_positions=False`)."""
    if self.scale_inputs:
      x = x.astype(f32) * jnp.sqrt(jnp.float32(x.shape[-1]))
    if self.position_features == "none" or positions is None:
      return x.astype(self.config.dtype)
    return (x.astype(f32) + layers.sinusoidal_features(positions, x.shape[-1])).astype(self.config.dtype)

  def _causal(self, w1: Array, x: Array, w2: Array, mask: Array, segment_ids: Array | None) -> Array:
    """out_i = W2[i] GELU(Σ_{j<=i, same segment} W1[j]^T x_j) through the implementation `impl` chooses."""
    fn = kernels.HYPERMIXING_CAUSAL.choose(self.impl, self._scan_causal, length_normalize=self.length_normalize)
    return fn(w1, x, w2, mask, segment_ids).astype(self.config.dtype)

  def _scan_causal(self, w1: Array, x: Array, w2: Array, mask: Array, segment_ids: Array | None) -> Array:
    """out_i = W2[i] GELU(Σ_{j<=i, same segment} W1[j]^T x_j), chunk by chunk with a carried running sum."""
    b, n, h = w1.shape
    d = x.shape[-1]
    c = max(1, min(self.chunk_size, n))
    m = -(-n // c)
    seg = jnp.zeros((b, n), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    pad = m * c - n  # the tail beyond n has no real keys and its outputs are dropped

    def chunks(a):
      a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
      return jnp.moveaxis(a.reshape((b, m, c) + a.shape[2:]), 1, 0)

    tri = jnp.tril(jnp.ones((c, c), bool))
    length_normalize, dtype = self.length_normalize, self.config.dtype

    def step(carry, chunk):
      run_sum, run_count, run_seg = carry  # the running segment's sum and key count, and its id
      w1c, xc, w2c, mc, sc = chunk
      vis = tri[None] & (sc[:, :, None] == sc[:, None, :])
      vis = vis.astype(f32) * mc[:, None, :]  # [b, i, j]: j <= i, same segment, real
      # Only queries of the segment still running from the previous chunk read the carried sum.
      cont = (sc == run_seg[:, None]).astype(f32)
      # The chunk's outer products W1[j]^T x_j, then one [c, 1 + c] x [1 + c, d·d'] matmul sums the visible
      # ones and the carried sum (one more key row, read where `cont`): every gradient is then a matmul too.
      # The states are laid out [d, d'] (d' minor): the gradient of the read with W2 is then an outer product
      # in the states' own layout, where [d', d] makes XLA:CPU copy the states transposed; and the carried sum
      # is a key row, not a broadcast product whose gradient would be a sum over the chunk's positions.
      outer = jnp.einsum("bih,bid->bidh", w1c.astype(f32), xc.astype(f32)).reshape(b, -1, d * h)
      keys = jnp.concatenate([run_sum.reshape(b, 1, d * h), outer], axis=1)
      hsum = jnp.einsum("bij,bjk->bik", jnp.concatenate([cont[:, :, None], vis], axis=2), keys)
      hsum = hsum.reshape(b, -1, d, h)
      count = vis.sum(-1) + cont * run_count[:, None]
      act = activate(hsum, count[:, :, None, None] if length_normalize else None, dtype)
      out = jnp.einsum("bih,bidh->bid", w2c, act)
      # The running sum after a chunk is the prefix sum at its last position (of that position's segment).
      return (hsum[:, -1], count[:, -1], sc[:, -1]), out

    init = (jnp.zeros((b, d, h), f32), jnp.zeros((b,), f32), jnp.full((b,), -1, jnp.int32))
    # Rematerialise the chunk body for the gradient: otherwise the scan keeps every chunk's d'×d states.
    _, out = base.scan(step, init, tuple(map(chunks, (w1, x, w2, mask, seg))), remat=True)
    return jnp.moveaxis(out, 0, 1).reshape(b, m * c, d)[:, :n]

  def _segmented(self, w1: Array, x: Array, w2: Array, kv_mask: Array, q_seg: Array, kv_seg: Array) -> Array:
    """Packed non-causal: query i reads GELU(Σ_{j real, seg_j = seg_i} W1[j]^T x_j), one state per segment id,
    through the implementation `impl` chooses (the id blocks below on every platform but a CPU's `cpu`)."""
    fn = kernels.HYPERMIXING_PACKED.choose(self.impl, self._block_segmented, length_normalize=self.length_normalize)
    return fn(w1, x, w2, kv_mask, q_seg, kv_seg).astype(self.config.dtype)

  def _block_segmented(self, w1: Array, x: Array, w2: Array, kv_mask: Array, q_seg: Array, kv_seg: Array) -> Array:
    """Packed non-causal: query i reads GELU(Σ_{j real, seg_j = seg_i} W1[j]^T x_j), one state per segment id.

    Segment ids are 1, 2, ... (0 is padding). A step handles `segment_block` ids with one-hot sums, and only the
    steps up to the batch's largest query id run: the loop's trip count is that id (at most min(q_len, kv_len):
    a larger id has no keys or no queries, whose queries read GELU(0) = 0 as they would from a block). The
    gradient is a loop of the same length that recomputes each step's block and adds its cotangents
    (`custom_vjp`: XLA cannot differentiate a loop of data-dependent length, and the recomputation keeps
    nothing per step). A fixed-length scan whose unused steps sit in a `lax.cond` still pays for most of them."""
    b, nq, h = w2.shape
    d = x.shape[-1]
    k = max(1, self.segment_block)
    q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
    steps = jnp.clip(-(-jnp.max(q_seg) // k), 0, -(-min(nq, x.shape[1]) // k))  # blocks holding ids 1..top
    length_normalize, dtype = self.length_normalize, self.config.dtype

    def block(start, w1, x, w2, kv_mask, q_seg, kv_seg):
      ids = start + 1 + jnp.arange(k)
      kv_hot = (kv_seg[:, :, None] == ids).astype(f32) * kv_mask[:, :, None]  # [b, j, s]
      # Two-operand contractions (XLA:CPU runs the three-operand einsums as slow generic loops): the block's
      # one-hot rows scale W1, one batched matmul over the keys; then one matmul over (segment, d') per query.
      hot_w1 = kv_hot.astype(dtype)[:, :, :, None] * w1[:, :, None, :]  # [b, j, s, h]
      hsum = layers.accumulating_einsum("bjsh,bjd->bshd", hot_w1, x)
      count = kv_hot.sum(1)[:, :, None, None] if length_normalize else None
      q_hot = (q_seg[:, :, None] == ids).astype(dtype)
      hot_w2 = (q_hot[:, :, :, None] * w2[:, :, None, :]).reshape(b, nq, k * h)  # [b, i, s·h]
      act = activate(hsum, count, dtype).reshape(b, k * h, d)
      return layers.accumulating_einsum("bik,bkd->bid", hot_w2, act)

    # The segment ids, mask and trip count are arguments, not closed over: a custom_vjp may not capture tracers.
    @jax.custom_vjp
    def run(w1, x, w2, kv_mask, q_seg, kv_seg, steps):
      fold = lambda i, acc: acc + block(i * k, w1, x, w2, kv_mask, q_seg, kv_seg)
      return jax.lax.fori_loop(0, steps, fold, jnp.zeros((b, nq, d), f32))

    def run_fwd(w1, x, w2, kv_mask, q_seg, kv_seg, steps):
      return run(w1, x, w2, kv_mask, q_seg, kv_seg, steps), (w1, x, w2, kv_mask, q_seg, kv_seg, steps)

    def run_bwd(res, g):
      w1, x, w2, kv_mask, q_seg, kv_seg, steps = res

      def fold(i, grads):
        _, pullback = jax.vjp(lambda a, c, e: block(i * k, a, c, e, kv_mask, q_seg, kv_seg), w1, x, w2)
        return jax.tree_util.tree_map(jnp.add, grads, pullback(g))

      zeros = tuple(jnp.zeros(a.shape, a.dtype) for a in (w1, x, w2))
      dw1, dx, dw2 = jax.lax.fori_loop(0, steps, fold, zeros)
      return dw1, dx, dw2, jnp.zeros_like(kv_mask), None, None, None

    run.defvjp(run_fwd, run_bwd)
    return run(w1, x, w2, jax.lax.stop_gradient(kv_mask), q_seg, kv_seg, steps)

  def _decode(self, h_in, h_out, inputs_q: Array, inputs_kv: Array, ctx: base.MixerContext, hidden: int) -> Array:
    """One position per call: add W1[i]^T x_i to the cached running sum, read it with W2[i]."""
    if not ctx.causal:
      raise ValueError("HyperMixing decodes only as the causal self-mixer (cross-mixing needs no cache)")
    b, length, d = inputs_q.shape
    initialized = self.has_variable("cache", "hidden_sum")
    hidden_sum = self.variable("cache", "hidden_sum", jnp.zeros, (b, hidden, d), f32)
    index = base.cache_index(self)
    pos = jnp.broadcast_to(index.value, (1, length)) if initialized else ctx.q_positions
    w1, w2 = self._generate(h_in, h_out, inputs_q, inputs_kv, pos, pos)
    if not initialized:  # the first call only creates the cache (and the parameters); its output is discarded
      return jnp.zeros(inputs_q.shape, self.config.dtype)
    if length != 1:
      raise ValueError(f"decode step expects one position at a time, got length {length}")
    hidden_sum.value = hidden_sum.value + jnp.einsum(
      "bjh,bjd->bhd", w1, inputs_kv.astype(self.config.dtype), preferred_element_type=f32
    )
    index.value = index.value + 1
    count = index.value.astype(f32) if self.length_normalize else None  # every decoded position is real
    return jnp.einsum("bih,bhd->bid", w2, activate(hidden_sum.value, count, self.config.dtype))
