"""remixer_t5/kernels/gpu/hypermixing.py: HyperMixing's causal form as a Pallas (Triton) kernel.

The kernel runs here in Pallas's interpreter (the same kernel bodies, executed by XLA:CPU) against numpy loops over
the equation, against a jnp reference's gradients, and against the layer's own XLA form; the choice is checked on
lowered programs (`HyperMixing.impl`): with 'auto' a program lowered for CUDA calls the Triton kernel for the
causal form and keeps XLA's id blocks for the packed one, one lowered for CPU or TPU calls no Triton kernel, and
'xla' calls none anywhere. The kernel ran on an H200 against XLA's forms too (scripts/gpu_measure.py's
`hypermixing_kernel` stage, docs/benchmarks.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import jaxpr_util
from scipy.special import erf

from remixer_t5 import flop_count
from remixer_t5.kernels.gpu import hypermixing as gpu_hypermixing
from remixer_t5.model.config import T5Config
from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.hypermixer import HyperMixing


def gelu_np(a):
  return 0.5 * a * (1.0 + erf(a / np.sqrt(2.0)))


def runs(seg):
  """Each position's run (contiguous equal ids) start."""
  start = np.zeros_like(seg)
  for r in range(seg.shape[0]):
    for i in range(1, seg.shape[1]):
      start[r, i] = start[r, i - 1] if seg[r, i] == seg[r, i - 1] else i
  return start


def causal_np(w1, x, w2, mask, seg, ln):
  """out_i = W2[i] GELU(Σ_{j<=i in i's run} W1[j]^T x_j / count), one query at a time."""
  b, n, _ = w1.shape
  start, out = runs(seg), np.zeros((b, n, x.shape[-1]))
  for r in range(b):
    for i in range(n):
      js = range(start[r, i], i + 1)
      state = sum(np.outer(w1[r, j], x[r, j]) for j in js)
      count = max(sum(mask[r, j] for j in js), 1.0) if ln else 1.0
      out[r, i] = w2[r, i] @ gelu_np(state / count)
  return out


def causal_jnp(w1, x, w2, mask, seg, ln):
  """The same function with every prefix state materialised (differentiable: the gradients' reference)."""
  n = seg.shape[1]
  start = jnp.asarray(runs(np.asarray(seg)))
  pos = jnp.arange(n)
  vis = ((pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] >= start[:, :, None])).astype(jnp.float32)
  state = jnp.einsum("bij,bjh,bjd->bihd", vis, w1, x)
  if ln:
    state = state / jnp.maximum(jnp.einsum("bij,bj->bi", vis, mask), 1.0)[:, :, None, None]
  return jnp.einsum("bih,bihd->bid", w2, jax.nn.gelu(state, approximate=False))


def segments(rng, b, n, pieces, pad):
  """Contiguous ids 1..pieces over the first n - pad positions of each row, 0 (padding) after."""
  seg = np.zeros((b, n), np.int32)
  for r in range(b):
    ends = np.sort(rng.choice(np.arange(1, n - pad), size=pieces - 1, replace=False))
    seg[r, : n - pad] = 1 + (np.arange(n - pad)[None, :] >= ends[:, None]).sum(0)
  return seg


def data(rng, b, nq, nk, h, d, kv_seg):
  mask = (kv_seg > 0).astype(np.float32)
  w1 = rng.normal(size=(b, nk, h)).astype(np.float32) * mask[:, :, None]
  return (
    w1,
    rng.normal(size=(b, nk, d)).astype(np.float32),
    rng.normal(size=(b, nq, h)).astype(np.float32),
    mask,
    rng.normal(size=(b, nq, d)).astype(np.float32),
  )


def rel(a, r):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(r))) / np.max(np.abs(np.asarray(r))))


def xla_form(length_normalize, name):
  """The layer's XLA form (what GPUs ran before the kernels), unbound: it reads only the module's fields."""
  return getattr(
    HyperMixing(T5Config(dtype="float32"), length_normalize=length_normalize, chunk_size=4, segment_block=2), name
  )


@pytest.mark.parametrize(
  "b,n,h,d,ln,pieces,block_h,block_d",
  [
    (2, 13, 48, 40, False, 3, 16, 16),  # d' and d padded up to whole tiles
    (3, 9, 32, 32, True, 2, 32, 16),
    (2, 17, 20, 24, True, 4, 8, 8),
  ],
)
def test_causal_kernel_against_the_equations_and_xla(b, n, h, d, ln, pieces, block_h, block_d):
  rng = np.random.default_rng(n)
  seg = segments(rng, b, n, pieces, pad=2)
  w1, x, w2, mask, g = data(rng, b, n, n, h, d, seg)
  with jax.default_matmul_precision("highest"):
    kernel = lambda w1, x, w2: gpu_hypermixing.kernel(
      w1, x, w2, mask, seg, ln, block_h=block_h, block_d=block_d, interpret=True
    )
    out, vjp = jax.vjp(kernel, w1, x, w2)
    grads = vjp(g)
    _, ref_vjp = jax.vjp(lambda *a: causal_jnp(*a, mask, seg, ln), w1, x, w2)
    xla_out, xla_vjp = jax.vjp(lambda *a: xla_form(ln, "_scan_causal")(*a, mask, seg), w1, x, w2)
    assert rel(out, causal_np(w1, x, w2, mask, seg, ln)) < 2e-6
    assert rel(out, xla_out) < 2e-6
    # XLA's scan also masks the keys it sums (its W1 gradient is 0 at padding); the layer masks W1 before either
    keys = (mask[:, :, None], 1.0, 1.0)
    for got, want, xla, m in zip(grads, ref_vjp(g), xla_vjp(g), keys):
      assert rel(got, want) < 2e-6 and rel(got * m, xla) < 2e-6


def test_gelu_and_its_slope():
  a = np.linspace(-9, 9, 2001).astype(np.float32)
  value, slope = gpu_hypermixing.gelu_and_grad(jnp.asarray(a))
  assert np.max(np.abs(np.asarray(value) - gelu_np(a.astype(np.float64)))) < 2e-6
  want = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(jnp.asarray(a, jnp.float32))
  assert np.max(np.abs(np.asarray(slope) - np.asarray(want))) < 2e-6


def lowered(platform, fn, *shapes):
  return jaxpr_util.lowered_for(platform, fn, *shapes)  # traced afresh, for the platform


@pytest.mark.parametrize("impl", ["auto", "pallas_gpu", "xla"])
def test_only_programs_lowered_for_cuda_call_the_kernel(impl):
  """A HyperMixer layer's gradient, causal and packed non-causal, lowered for CUDA: with HyperMixing.impl 'auto'
  or 'pallas_gpu' the causal form calls its Triton kernel (forward and backward) in place of XLA's chunked scan,
  and the packed form keeps XLA's id-block loop (there is no GPU kernel for it); with 'xla' both keep XLA's
  loops. 'auto' and 'xla' lowered for CPU or TPU call no Triton kernel (a TPU keeps XLA's loops), and inside a
  FLOP count no program does."""
  cfg = T5Config(
    vocab_size=64,
    emb_dim=16,
    num_heads=2,
    num_encoder_layers=1,
    num_decoder_layers=1,
    head_dim=8,
    mlp_dim=32,
    dtype="float32",
  )
  b, n = 2, 12
  x = jnp.ones((b, n, 16))
  seg = jnp.asarray(np.repeat([[1] * 5 + [2] * 7], b, 0), jnp.int32)
  pos = jnp.asarray(np.repeat([list(range(5)) + list(range(7))], b, 0), jnp.int32)
  mod = HyperMixing(cfg, impl=impl)

  def ctx(causal):
    return base.MixerContext(
      q_mask=jnp.ones((b, n)),
      kv_mask=jnp.ones((b, n)),
      q_positions=pos,
      kv_positions=pos,
      q_segment_ids=seg,
      kv_segment_ids=seg,
      causal=causal,
    )

  params = mod.init(jax.random.PRNGKey(0), x, x, ctx(False))
  S = jax.ShapeDtypeStruct
  shapes = (jax.tree_util.tree_map(lambda a: S(a.shape, a.dtype), params), S(x.shape, x.dtype))
  for causal in (True, False):
    grad = jax.grad(lambda v, x: jnp.sum(mod.apply(v, x, x, ctx(causal)) ** 2), argnums=(0, 1))
    cuda = lowered("cuda", grad, *shapes)
    if causal and impl != "xla":
      assert cuda.count("__gpu$xla.gpu.triton") == 2 and "hypermixing_causal" in cuda, impl
      assert "stablehlo.while" not in cuda, impl  # the chunked scan is gone
    else:
      assert "triton" not in cuda and "stablehlo.while" in cuda, (impl, causal)  # the scan, or the id blocks
    with flop_count.counting_model_flops():
      assert "triton" not in lowered("cuda", grad, *shapes)
    if impl != "pallas_gpu":  # (an explicit 'pallas_gpu' is for GPU programs: Pallas lowers it nowhere else)
      for platform in ("cpu", "tpu"):
        assert "triton" not in lowered(platform, grad, *shapes), (impl, platform)
      assert "stablehlo.while" in lowered("tpu", grad, *shapes)


SHARDED = """
import json, re
import jax, jax.numpy as jnp, numpy as np
from remixer_t5.training import partitioning
from remixer_t5.kernels.gpu import hypermixing as gpu_hypermixing
S = jax.ShapeDtypeStruct
fall = lambda w1, x, w2, *a: jnp.zeros(w2.shape[:2] + x.shape[-1:], jnp.float32)  # never called
def loss(w1, x, w2, mask, seg):
  return jnp.sum(gpu_hypermixing.causal(w1, x, w2, mask, seg, reference=fall, length_normalize=True) ** 2)
args = (S((16, 9, 40), jnp.float32), S((16, 9, 24), jnp.float32), S((16, 9, 40), jnp.float32),
        S((16, 9), jnp.float32), S((16, 9), jnp.int32))
out = {}
for rules in ("data", "fsdp"):
  with partitioning.partitioner("4x2", rules=rules).activation_sharding():
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  out[rules] = {"triton": text.count("__gpu$xla.gpu.triton"), "manual": text.count("manual_computation"),
                "rows": sorted(set(re.findall(r"tensor<(\\d+)x9x40xf32>", text)))}
print(json.dumps(out))
"""


def test_under_a_mesh_each_device_runs_the_kernel_on_its_own_rows():
  """XLA does not partition a custom call: under the trainer's mesh (8 host devices, data-parallel rules) the
  kernel's forward and backward run inside a shard_map over the batch axes, each device on its rows (16 / 8 = 2
  with the 'data' rules, whose batch spans both mesh axes; 16 / 4 = 4 with 'fsdp', whose batch is the 'data' axis
  only)."""
  import json
  import sys

  sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
  from subprocess_util import run_py

  proc = run_py(SHARDED, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  for rules, rows in (("data", "2"), ("fsdp", "4")):
    assert got[rules]["triton"] == 2 and got[rules]["manual"] >= 2, got
    assert rows in got[rules]["rows"], got


@pytest.mark.integration
def test_a_hypermixer_train_step_through_the_kernel_matches_xla(monkeypatch):
  """The tiny HyperMixer's loss and every parameter's gradient on packed rows (3 examples a row, then padding)
  with HyperMixing.impl='pallas_gpu', the kernel run by Pallas's interpreter here, against impl='xla': the layer
  passes the kernel the right masks, ids and dtypes, through the model's remat and the loss."""
  from remixer_t5.bench import train as bench_train
  from remixer_t5 import gin_utils

  lengths = {"inputs": 24, "targets": 20}

  def step(impl):
    """The jitted loss and gradient of the model built with `impl` (traced while its gin config is in force)."""
    gin_utils.parse_gin(["models/hypermixer/tiny.gin"], ["DROPOUT_RATE=0.0", f"hypermixer.HyperMixing.impl='{impl}'"])
    model = bench_train.from_gin(4, lengths)["model"]
    fn = jax.jit(jax.value_and_grad(lambda p, batch: model.loss_fn(p, batch, None)[0]))
    return model, fn

  model, ref_step = step("xla")
  batch = bench_train.random_batch(model.module.config.vocab_size, 4, lengths)
  params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
  ids = lambda n, cuts: np.searchsorted(np.asarray(cuts), np.arange(n), side="right").astype(np.int32)
  pos = lambda seg: np.array([i - np.argmax(seg == s) for i, s in enumerate(seg)], np.int32)
  es, ds = ids(24, [0, 9, 17, 22]), ids(20, [0, 7, 15, 19])
  es[es == 4], ds[ds == 4] = 0, 0
  batch.update(
    encoder_segment_ids=np.tile(es, (4, 1)),
    decoder_segment_ids=np.tile(ds, (4, 1)),
    encoder_positions=np.tile(pos(es), (4, 1)),
    decoder_positions=np.tile(pos(ds), (4, 1)),
  )
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  with jax.default_matmul_precision("highest"):
    ref_loss, ref_grads = ref_step(params, batch)
  calls = []
  real = gpu_hypermixing.kernel
  # The seam calls kernels/gpu/hypermixing.py's `causal`, which would lower the kernel for a GPU: here it runs
  # the same kernel in Pallas's interpreter.
  monkeypatch.setattr(
    gpu_hypermixing, "kernel", lambda *a, **k: calls.append("causal") or real(*a, **{**k, "interpret": True})
  )
  _, kernel_step = step("pallas_gpu")
  with jax.default_matmul_precision("highest"):
    loss, grads = kernel_step(params, batch)
  assert calls.count("causal") >= 2, calls  # each decoder layer's self-mixing (the packed forms keep XLA's)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  worst = max(
    jax.tree.leaves(
      jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)), grads, ref_grads)
    )
  )
  assert worst < 1e-4


def test_the_causal_gradient_holds_over_a_long_segment():
  """The backward rebuilds each state by subtracting from the next one (only a segment's end is summed afresh):
  over one segment of 1024 positions its gradients stay within 2e-5 of the materialised reference."""
  rng = np.random.default_rng(7)
  b, n, h, d = 1, 1024, 16, 16
  seg, mask = np.ones((b, n), np.int32), np.ones((b, n), np.float32)
  w1, x, w2 = (rng.normal(size=s).astype(np.float32) / 4 for s in ((b, n, h), (b, n, d), (b, n, h)))
  g = rng.normal(size=(b, n, d)).astype(np.float32)
  with jax.default_matmul_precision("highest"):
    _, vjp = jax.vjp(
      lambda *a: gpu_hypermixing.kernel(*a, mask, seg, True, block_h=16, block_d=16, interpret=True), w1, x, w2
    )
    _, ref_vjp = jax.vjp(lambda *a: causal_jnp(*a, mask, seg, True), w1, x, w2)
    for got, want in zip(vjp(g), ref_vjp(g)):
      assert rel(got, want) < 2e-5
