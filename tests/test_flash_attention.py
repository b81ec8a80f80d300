"""remixer_t5/kernels/gpu/flash_attention.py: T5's attention (relative position bias, segment ids, causal, dropout
mask) as Pallas (Triton) flash-attention kernels, forward and gradient.

The kernels run here in Pallas's interpreter (the same kernel bodies, executed by XLA:CPU) against
`reference`, the model's plain-JAX attention operation (`mixers.attention.dot_product_attention`): the output on real query rows and the gradients of query,
key, value and bias, with the output's cotangent zero on padding rows (as the loss makes it). Blocks of 16 make
several blocks out of small lengths that are not multiples of them. Programs lowered for CUDA are checked for
the kernels' custom calls and the absence of [b, h, q, k] arrays; with XLA's CUDA compiler plugin (`make
gpu-compile-env`, run in .venv-gpu) they are compiled for an H100 too.

kernels/tpu/flash_attention.py (JAX's TPU flash attention behind the same contract) runs in Pallas's TPU
interpreter against the same reference, and is compiled through libtpu for TPU generations without a TPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.kernels.bias import RelativeBias
from remixer_t5.kernels.gpu import flash_attention as fa
from remixer_t5.model.mixers.attention import dot_product_attention
from tiers import needs_cuda_plugin, tiered


def reference(
  query,
  key,
  value,
  *,
  bias=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  causal=False,
  dropout_mask=None,
  dropout_rate=0.0,
  dtype=jnp.float32,
):
  """The model's attention operation in the kernel's keyword form (segment ids None: every position real)."""
  b, nq, nk = query.shape[0], query.shape[1], key.shape[1]
  q_seg = jnp.ones((b, nq), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
  kv_seg = jnp.ones((b, nk), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
  return dot_product_attention(
    query, key, value, bias, q_seg, kv_seg, dropout_mask, causal=causal, dropout_rate=dropout_rate, dtype=dtype
  )


def segments(rng, b, n, pieces, pad):
  """Contiguous ids 1..pieces over the first n - pad[r] positions of row r, 0 (padding) after."""
  seg = np.zeros((b, n), np.int32)
  for r in range(b):
    real = n - (pad[r] if isinstance(pad, (list, tuple)) else pad)
    ends = np.sort(rng.choice(np.arange(2, real - 1), size=pieces - 1, replace=False)) if pieces > 1 else []
    seg[r, :real] = 1 + (np.arange(real)[None, :] >= np.asarray(ends)[:, None]).sum(0) if pieces > 1 else 1
  return seg


# name: (b, nq, nk, h, d, causal, bias, q pieces, q padding, kv pieces, kv padding); pieces None: no segment ids
CASES = {
  "packed": (2, 37, 37, 2, 24, False, True, 3, 4, 3, 4),  # d 24 padded to 32 inside
  "padded": (3, 29, 29, 2, 16, False, True, 1, [0, 5, 11], 1, [0, 5, 11]),  # unpacked rows: 1 real, 0 padding
  "causal": (2, 37, 37, 2, 16, True, True, 2, 3, 2, 3),  # decoder self-attention
  "cross": (2, 21, 45, 2, 16, False, False, 2, 3, 2, 6),  # decoder queries, encoder keys, packed, no bias
  "head_dim_64": (2, 40, 40, 2, 64, True, True, 2, 5, 2, 5),
  "cross_bias": (3, 20, 33, 2, 16, False, True, 2, 3, 2, 4),  # q != k with a bias: the offsets' both ends
  "unmasked_causal": (2, 64, 64, 2, 16, True, True, None, 0, None, 0),  # no segment ids, whole blocks
}


def make(name, dtype=jnp.float32, dropout_rate=0.0, seed=0, cases=CASES):
  b, nq, nk, h, d, causal, bias, qp, qpad, kp, kpad = cases[name]
  rng = np.random.default_rng(seed)
  q_seg = None if qp is None else segments(rng, b, nq, qp, qpad)
  kv_seg = q_seg if (nq == nk and qp == kp and qpad == kpad) else segments(rng, b, nk, kp, kpad)
  normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  inputs = dict(
    query=normal(b, nq, h, d).astype(dtype),
    key=normal(b, nk, h, d).astype(dtype),
    value=normal(b, nk, h, d).astype(dtype),
    bias=RelativeBias(2 * normal(h, nq + nk - 1), nq) if bias else None,
  )
  as_ids = lambda seg: None if seg is None else jnp.asarray(seg)
  static = dict(
    q_segment_ids=as_ids(q_seg),
    kv_segment_ids=as_ids(kv_seg),
    causal=causal,
    dtype=dtype,
    dropout_rate=dropout_rate,
    dropout_mask=jnp.asarray(rng.random((b, h, nq, nk)) >= dropout_rate) if dropout_rate else None,
  )
  real = True if q_seg is None else (q_seg > 0)[:, :, None, None]
  cotangent = (normal(b, nq, h, d) * real).astype(dtype)
  return inputs, static, real, cotangent


def value_and_grads(fn, inputs, static, cotangent):
  """fn's output and the gradients of every input (bias included) for the cotangent, in one jitted program."""
  names = [k for k, v in inputs.items() if v is not None]

  @jax.jit
  def run(arrays):
    out, vjp = jax.vjp(lambda a: fn(**{**inputs, **a}, **static), arrays)
    return out, vjp(cotangent)[0]

  return run({k: inputs[k] for k in names})


def rel(got, want, where=True):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(np.where(where, got - want, 0))) / np.max(np.abs(np.where(where, want, 0))))


def leaves(grads):
  """The gradients by input name, the relative bias's as its values."""
  return {k: v.values if isinstance(v, RelativeBias) else v for k, v in grads.items()}


def interpreted(tiling):
  return lambda **kw: fa.attention(**kw, interpret=True, tiling=tiling)


def check(name, *, dtype=jnp.float32, dropout_rate=0.0, tol=1e-5, blocks=16):
  inputs, static, real, g = make(name, dtype, dropout_rate)
  kernel = interpreted(fa.Tiling(blocks, blocks))
  out, grads = value_and_grads(kernel, inputs, static, g)
  with jax.default_matmul_precision("highest"):
    want_out, want_grads = value_and_grads(reference, inputs, static, g)
  grads, want_grads, inputs = leaves(grads), leaves(want_grads), leaves(inputs)
  assert out.dtype == dtype and out.shape == want_out.shape
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in [out, *grads.values()])  # padding rows included
  errors = {"out": rel(out, want_out, real)}
  errors.update({k: rel(grads[k], want_grads[k]) for k in want_grads})
  assert set(grads) == set(want_grads) and all(grads[k].shape == inputs[k].shape for k in grads)
  assert max(errors.values()) < tol, errors
  return errors


@pytest.mark.parametrize("name", tiered(list(CASES), quick=["packed", "causal", "cross"]))
def test_matches_the_reference_in_float32(name):
  check(name)


@pytest.mark.parametrize("name", ["packed", "causal"])
def test_a_dropout_mask_is_applied_as_the_reference_applies_it(name):
  check(name, dropout_rate=0.3)


def test_bfloat16_within_bfloat16_tolerance():
  """bfloat16 inputs and weights: the kernel rounds its tiles' operands (dS included) where the reference rounds
  whole arrays; output and gradients stay within ~1 bfloat16 step (2^-7 = 7.8e-3) of the reference's bfloat16
  ones, relative to each array's largest magnitude (8.4e-3 at most over the float32 cases' shapes)."""
  check("causal", dtype=jnp.bfloat16, tol=2e-2)


def test_the_default_blocks_shrink_for_short_sequences():
  """At the default 64 x 64 blocks a 70-position row is two blocks (padded to 128); 20 positions take one
  block of 32."""
  assert (fa._block(64, 70), fa._block(64, 20), fa._block(64, 3)) == (64, 32, 16)
  check("cross_bias", blocks=64)


def test_forward_and_gradient_tilings_may_differ():
  """The forward's tiles and the gradient kernels' are separate entries of a tiling (padding takes the larger
  block); 16 x 32 forward tiles beside 32 x 16 gradient tiles give the reference's output and gradients."""
  inputs, static, real, g = make("causal")
  out, grads = value_and_grads(interpreted((fa.Tiling(16, 32), fa.Tiling(32, 16))), inputs, static, g)
  with jax.default_matmul_precision("highest"):
    want_out, want_grads = value_and_grads(reference, inputs, static, g)
  assert rel(out, want_out, real) < 1e-5
  grads, want_grads = leaves(grads), leaves(want_grads)
  assert max(rel(grads[k], want_grads[k]) for k in want_grads) < 1e-5


def test_the_bias_gradient_is_split_over_groups_of_batch_rows(monkeypatch):
  """The bias gradient's grid splits the batch into groups of rows (`bias_groups`: ~BIAS_PROGRAMS programs);
  with 5 rows in groups of 2 (the last one short) and in one group of all 5, the gradient is the reference's."""
  assert fa.bias_groups(128, 768) == (2, 64) and fa.bias_groups(128, 48) == (22, 6)
  assert fa.bias_groups(5, 4, programs=12) == (3, 2) and fa.bias_groups(5, 4096) == (1, 5)
  inputs, static, real, g = make("five", cases={"five": (5, 24, 24, 2, 16, True, True, 2, 3, 2, 3)})
  with jax.default_matmul_precision("highest"):
    want = leaves(value_and_grads(reference, inputs, static, g)[1])["bias"]
  for programs in (12, 4096):  # 4 tiles a head x 2 heads = 8 tiles: groups of 2 rows, then one group
    monkeypatch.setattr(fa, "BIAS_PROGRAMS", programs)
    got = leaves(value_and_grads(interpreted(fa.Tiling(16, 16)), inputs, static, g)[1])["bias"]
    assert rel(got, want) < 1e-5


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [1, 2])
def test_sweep_of_seeds_blocks_and_dropout(name, seed):
  inputs, static, real, g = make(name, jnp.float32, 0.2, seed)
  for bq, bk in ((16, 32), (32, 16)):
    out, grads = value_and_grads(interpreted(fa.Tiling(bq, bk)), inputs, static, g)
    with jax.default_matmul_precision("highest"):
      want_out, want_grads = value_and_grads(reference, inputs, static, g)
    grads, want_grads = leaves(grads), leaves(want_grads)
    assert rel(out, want_out, real) < 1e-5
    assert max(rel(grads[k], want_grads[k]) for k in want_grads) < 1e-5


def test_bad_shapes_are_named():
  q = jnp.zeros((2, 8, 2, 16))
  with pytest.raises(ValueError, match=r"relative bias values \(2, 16\) \(q_len 8\) must be \[2, 15\]"):
    fa.attention(q, q, q, bias=RelativeBias(jnp.zeros((2, 16)), 8), interpret=True)
  with pytest.raises(ValueError, match=r"dropout_mask \(2, 1, 8, 8\) must be \[2, 2, 8, 8\]"):
    fa.attention(q, q, q, dropout_mask=jnp.ones((2, 1, 8, 8), bool), dropout_rate=0.1, interpret=True)
  with pytest.raises(ValueError, match="must be"):
    fa.attention(q, q[:, :, :1], q, interpret=True)


def test_the_seam_hands_a_dense_bias_to_the_reference():
  """The kernels take T5's bias as its offset vector; given a dense [1, h, q, k] bias the `pallas_gpu` seam
  computes the reference (nothing is lowered for a GPU here)."""
  inputs, static, real, g = make("packed")
  ref = lambda *a: dot_product_attention(*a, causal=False, dropout_rate=0.0, dtype=jnp.float32)
  args = (
    inputs["query"],
    inputs["key"],
    inputs["value"],
    inputs["bias"].dense(),
    static["q_segment_ids"],
    static["kv_segment_ids"],
    None,
  )
  got = fa.seam(*args, reference=ref, causal=False, dropout_rate=0.0, dtype=jnp.float32)
  np.testing.assert_array_equal(got, ref(*args))


# T5.1.1-base: batch 32, 12 heads of 64, encoder 512 positions, decoder 114.
BASE = dict(b=32, h=12, d=64)


def _base_program(nq, nk, causal, bias, dropout):
  """The kernels' forward and gradient at T5.1.1-base shapes in bfloat16, and its arguments' shapes."""
  b, h, d = BASE["b"], BASE["h"], BASE["d"]
  S = jax.ShapeDtypeStruct
  args = [
    S((b, nq, h, d), jnp.bfloat16),
    S((b, nk, h, d), jnp.bfloat16),
    S((b, nk, h, d), jnp.bfloat16),
    S((h, nq + nk - 1), jnp.float32) if bias else None,
    S((b, nq), jnp.int32),
    S((b, nk), jnp.int32),
    S((b, h, nq, nk), jnp.bool_) if dropout else None,
    S((b, nq, h, d), jnp.bfloat16),
  ]

  def program(q, k, v, rel, q_seg, kv_seg, mask, g):
    bias = None if rel is None else RelativeBias(rel, q.shape[1])
    fn = lambda q, k, v, bias: fa.attention(
      q,
      k,
      v,
      bias=bias,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      causal=causal,
      dropout_mask=mask,
      dropout_rate=0.1 if dropout else 0.0,
      dtype=jnp.bfloat16,
    )
    out, vjp = jax.vjp(fn, q, k, v, bias)
    return out, vjp(g)

  return program, args


# (q, k, causal, bias, dropout): the encoder's self-attention, the decoder's (finetuning: with dropout), and
# cross-attention.
BASE_FORMS = {
  "encoder": (512, 512, False, True, False),
  "decoder_dropout": (114, 114, True, True, True),
  "cross": (114, 512, False, False, False),
}


@pytest.mark.parametrize("form", list(BASE_FORMS))
def test_programs_lowered_for_cuda_call_the_kernels_and_hold_no_attention_matrix(form):
  """Pallas lowers the kernels to Triton IR here (no GPU or plugin needed): the forward and the three gradient
  kernels (dK/dV, dQ, and the bias's when there is one) are custom calls, and no [b, h, q, k] float array is in
  the program; the dropout mask is the only [b, h, q, k] array, read as it is given. (The bias gradient's
  group sums are [groups, h, q, k], fewer groups than rows: 2 for the encoder, 22 for the decoder.)"""
  nq, nk, causal, bias, dropout = BASE_FORMS[form]
  program, args = _base_program(nq, nk, causal, bias, dropout)
  text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == (4 if bias else 3)
  for name in ["flash_attention_fwd", "flash_attention_dkv", "flash_attention_dq"] + (
    ["flash_attention_dbias"] if bias else []
  ):
    assert name in text
  b, h = BASE["b"], BASE["h"]
  square = [t for t in re.findall(rf"tensor<{b}x{h}x(\d+)x(\d+)x(\w+)>", text) if t[2] != "i1"]
  assert not square, square


@needs_cuda_plugin
@pytest.mark.parametrize("form", ["encoder", "decoder_dropout"])
def test_the_kernels_compile_for_an_h100_without_a_gpu(form):
  """Deviceless: XLA:GPU compiles the program for an H100 target (Triton to PTX, ptxas): the optimised HLO
  keeps the kernels' custom calls, and its largest float buffers are the [b, q, h, d] arrays, the bias
  gradient's group sums [groups, h, q, k] and their diagonal sums' skewed [h, q, q + k] layout (at lengths padded
  to whole blocks). Scratch memory: the softmax statistics, 8 bytes a query row and head, and those two bias
  gradient arrays; the decoder's 114 positions pad to 128, and the padded copies of q, k, v, the cotangent, the
  mask and the gradients before slicing take ~8 arrays of [b, 128, h, d]."""
  from remixer_t5 import aot_compile

  device = aot_compile.gpu_topology_devices(aot_compile.accelerator("h100"))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  nq, nk, causal, bias, dropout = BASE_FORMS[form]
  program, args = _base_program(nq, nk, causal, bias, dropout)
  args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  compiled = jax.jit(program).trace(*args).lower().compile()
  text = compiled.as_text()
  assert text.count("__gpu$xla.gpu.triton") == 4
  b, h, d = BASE["b"], BASE["h"], BASE["d"]
  floats = {tuple(map(int, s.split(","))) for s in re.findall(r"\b(?:f32|bf16|f16)\[([\d,]+)\]", text)}
  block = fa.tilings("NVIDIA H100 80GB HBM3")[1].block_q
  pq, pk = (-(-n // block) * block for n in (nq, nk))  # the lengths padded to whole blocks
  groups = fa.bias_groups(b, (pq // block) * (pk // block) * h)[0]
  bias_grad = groups * h * pq * pk + h * pq * (pq + pk)  # the group sums and the skewed diagonal sums
  assert max(np.prod(s) for s in floats) <= max(b * pq * h * d, groups * h * pq * pk, h * pq * (pq + pk)), sorted(
    floats
  )
  assert not [s for s in floats if len(s) == 4 and s[0] == b and s[1] == h], sorted(floats)
  temp = compiled.memory_analysis().temp_size_in_bytes
  padded_copies = 0 if (pq, pk) == (nq, nk) else 10 * b * pq * h * d * 2
  assert temp <= 8 * b * h * pq + 4 * bias_grad + padded_copies + 4096, temp


# --- TPU: kernels/tpu/flash_attention.py, JAX's Pallas (Mosaic) flash attention behind the same contract --------


@pytest.mark.parametrize("name", tiered(["causal", "packed", "cross", "padded"], quick=["causal"]))
def test_the_tpu_wrapper_matches_the_reference_in_tpu_interpret_mode(name):
  """JAX's TPU kernel run by Pallas's TPU interpreter on this CPU, through the wrapper's transposes, padding to
  128-position blocks, segment ids and bias broadcast: output and gradients (the bias's summed over the batch)."""
  from jax.experimental.pallas import tpu as pltpu

  from remixer_t5.kernels.tpu import flash_attention as tpu_fa

  inputs, static, real, g = make(name)
  with pltpu.force_tpu_interpret_mode():
    out, grads = value_and_grads(tpu_fa.attention, inputs, static, g)
  with jax.default_matmul_precision("highest"):
    want_out, want_grads = value_and_grads(reference, inputs, static, g)
  grads, want_grads = leaves(grads), leaves(want_grads)
  assert rel(out, want_out, real) < 1e-5
  assert max(rel(grads[k], want_grads[k]) for k in want_grads) < 1e-5


def test_the_tpu_wrapper_refuses_a_dropout_mask():
  from remixer_t5.kernels.tpu import flash_attention as tpu_fa

  q = jnp.zeros((1, 8, 1, 16))
  with pytest.raises(NotImplementedError, match="no dropout mask"):
    tpu_fa.attention(q, q, q, dropout_mask=jnp.ones((1, 1, 8, 8), bool), dropout_rate=0.1)


def _tpu_compile(topology, form, operand_dtype=None):
  """The TPU wrapper's forward and gradient at T5.1.1-base shapes (bfloat16 arrays), compiled for one device of
  `topology` through libtpu without a TPU; the optimised HLO's text."""
  from remixer_t5 import aot_compile
  from remixer_t5.kernels.tpu import flash_attention as tpu_fa

  device = aot_compile.topology_devices(aot_compile.accelerator(topology))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  nq, nk, causal, bias, _ = BASE_FORMS[form]
  b, h, d = BASE["b"], BASE["h"], BASE["d"]
  S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  args = [
    S((b, nq, h, d), jnp.bfloat16),
    S((b, nk, h, d), jnp.bfloat16),
    S((b, nk, h, d), jnp.bfloat16),
    S((1, h, nq, nk), jnp.float32) if bias else None,
    S((b, nq), jnp.int32),
    S((b, nk), jnp.int32),
    S((b, nq, h, d), jnp.bfloat16),
  ]

  def program(q, k, v, bias, q_seg, kv_seg, g):
    fn = lambda q, k, v, bias: tpu_fa.attention(
      q,
      k,
      v,
      bias=bias,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      causal=causal,
      dtype=jnp.bfloat16,
      operand_dtype=operand_dtype,
    )
    out, vjp = jax.vjp(fn, q, k, v, bias)
    return out, vjp(g)

  return jax.jit(program).trace(*args).lower().compile().as_text()


TPU_COMPILES = [(t, form) for t in ("v5e-1", "v4-8", "v5p-8", "v6e-1") for form in ("encoder", "cross")]


@pytest.mark.parametrize("case", tiered(TPU_COMPILES, quick=TPU_COMPILES[:1]), ids="-".join)
def test_the_tpu_wrapper_compiles_with_bfloat16_operands_from_v4_on(case):
  """Deviceless (libtpu): the encoder's self-attention (bias) and cross-attention (none) compile to Mosaic
  kernels, forward and both gradient kernels (the bias's gradient comes from the dQ kernel)."""
  topology, form = case
  assert _tpu_compile(topology, form).count('custom_call_target="tpu_custom_call"') == 3


@pytest.mark.integration
@pytest.mark.parametrize("topology", ["v2-8", "v3-8"])
def test_v2_and_v3_take_the_tpu_wrapper_with_float32_operands_only(topology):
  """Mosaic on v2/v3 (libtpu 0.0.42.1) refuses bfloat16 matmul operands; with float32 ones it compiles."""
  with pytest.raises(Exception, match="Unsupported matmul RHS type"):
    _tpu_compile(topology, "decoder_dropout")
  assert _tpu_compile(topology, "decoder_dropout", jnp.float32).count('"tpu_custom_call"') == 3


@pytest.mark.parametrize(
  "case",
  tiered([("v5e-1", True), ("v3-8", False), ("v4-8", True)], quick=[("v5e-1", True), ("v3-8", False)]),
  ids=lambda c: c[0],
)
def test_auto_takes_the_tpu_kernel_from_v4_and_xla_s_form_on_v3(case):
  """The model's attention operation with attention_impl 'auto', traced under a mesh of `topology`'s devices (as
  the trainer and `remixer-t5 compile` trace), compiled through libtpu without a TPU: Mosaic kernels on v4 and
  later, none on v3 (whose Mosaic takes no bfloat16 operands: the XLA form, and the v3 cost table, stay)."""
  topology, kernel = case
  from remixer_t5 import aot_compile
  from remixer_t5.model.mixers import attention as attention_mixer

  devices = aot_compile.topology_devices(aot_compile.accelerator(topology))[:1]
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, 1), ("data", "model"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  b, nq, h, d = 2, 256, 4, 64
  S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  args = [S((b, nq, h, d), jnp.bfloat16)] * 3 + [
    S((1, h, nq, nq), jnp.float32),
    S((b, nq), jnp.int32),
    S((b, nq), jnp.int32),
  ]
  static = dict(causal=False, dropout_rate=0.0, dtype=jnp.bfloat16, float32_logits=True)

  def program(q, k, v, bias, q_seg, kv_seg):
    fn = attention_mixer.attention_operation("auto", **static)
    out, vjp = jax.vjp(lambda q, k, v, bias: fn(q, k, v, bias, q_seg, kv_seg, None), q, k, v, bias)
    return out, vjp(out)

  with jax.set_mesh(mesh):
    text = jax.jit(program).trace(*args).lower().compile().as_text()
  assert (text.count('custom_call_target="tpu_custom_call"') == 3) == kernel
