"""remixer_t5/kernels/cpu/threefry.py: dropout's keep mask with JAX's Threefry-2x32 hash unrolled, the same bits.

The hash is checked against Random123's published known answers (an independent reference), the keep mask against
`jax.random.bernoulli` bit for bit, and the choice of implementation (`T5Config.dropout_impl`, `layers.keep_mask`)
on lowered and compiled programs. What needs the materialize custom call runs in a fresh process with one JAX
device (a custom call is registered once per process and is used only with one device)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_util import run_py

from remixer_t5.model import layers
from remixer_t5.kernels.cpu import threefry

REPO = Path(__file__).resolve().parents[1]

# Random123 (Salmon et al. 2011), kat_vectors: threefry2x32 with 20 rounds, (counter, key) -> output.
KNOWN_ANSWERS = [
  ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
  ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
  ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
  out = threefry.threefry_2x32(
    np.uint32(key[0]), np.uint32(key[1]), jnp.asarray([counter[0]], jnp.uint32), jnp.asarray([counter[1]], jnp.uint32)
  )
  assert [int(o[0]) for o in out] == list(expected)
  assert all(o.dtype == jnp.uint32 and o.shape == (1,) for o in out)


def test_broadcasts_its_operands():
  k1, k2 = np.uint32(7), np.uint32(11)
  x1 = jnp.arange(6, dtype=jnp.uint32).reshape(2, 3)
  out = threefry.threefry_2x32(k1, k2, x1, jnp.uint32(5))
  assert [o.shape for o in out] == [(2, 3), (2, 3)]
  one = threefry.threefry_2x32(k1, k2, jnp.asarray([4], jnp.uint32), jnp.asarray([5], jnp.uint32))
  assert int(out[0][1, 1]) == int(one[0][0]) and int(out[1][1, 1]) == int(one[1][0])


def bernoulli(keep_prob, shape):
  return lambda key: jax.random.bernoulli(key, keep_prob, shape)


@pytest.mark.parametrize("typed", [False, True])
@pytest.mark.parametrize(
  "shape,unroll_min",
  [
    ((4, 4, 96, 96), None),  # an attention-sized mask: the unrolled hash at the module's threshold
    ((3, 65537), None),  # an odd element count
    ((4, 7, 33), 1),  # small masks, unrolled here by lowering the threshold: the hash itself on other shapes
    ((7,), 1),
    ((5, 1, 3), 1),
  ],
)
def test_keep_mask_is_jaxs_bernoulli_bit_for_bit(shape, unroll_min, typed, monkeypatch):
  if unroll_min is not None:
    monkeypatch.setattr(threefry, "UNROLL_MIN", unroll_min)
  for seed, keep_prob in ((0, 0.9), (3, 0.5), (2**31 - 1, 0.1)):
    key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
    fell_back = []
    reference = lambda k: fell_back.append(k) or jax.random.bernoulli(k, keep_prob, shape)
    ours = jax.jit(lambda k: threefry.keep_mask(k, keep_prob, shape, reference=reference))(key)
    assert not fell_back  # the unrolled hash, not the reference
    want = np.asarray(jax.random.bernoulli(key, keep_prob, shape))
    assert ours.shape == shape and ours.dtype == jnp.bool_
    assert np.array_equal(np.asarray(ours), want), (shape, seed, keep_prob)
    assert 0 < want.mean() < 1 or want.size < 16
    for impl in ("cpu", "auto"):  # and through the model's dropout operation
      assert np.array_equal(np.asarray(jax.jit(lambda k: layers.keep_mask(k, keep_prob, shape, impl=impl))(key)), want)


def test_small_masks_take_the_reference():
  """Below UNROLL_MIN elements (T5's broadcast [batch, 1, d] masks) the hash would be fused into every reader and
  run once per position reading the mask: JAX's own form is used."""
  key = jax.random.PRNGKey(1)
  shape = (4, 1, 512)
  assert 4 * 512 < threefry.UNROLL_MIN
  assert threefry.keep_mask(key, 0.9, shape, reference=lambda k: "reference") == "reference"
  assert np.array_equal(layers.keep_mask(key, 0.9, shape, impl="cpu"), jax.random.bernoulli(key, 0.9, shape))


def test_an_unknown_implementation_is_named():
  with pytest.raises(ValueError, match=r"dropout_impl='pallas_gpu': expected one of \('auto', 'xla', 'cpu'\)"):
    layers.keep_mask(jax.random.PRNGKey(0), 0.9, (4,), impl="pallas_gpu")


LOWERED = """
import json
import jax, jax.numpy as jnp
from remixer_t5 import flop_count
from remixer_t5.model import layers
from remixer_t5.kernels.cpu import threefry
import sys; sys.path.insert(0, "tests")
from jaxpr_util import lowered_for
key = jax.random.PRNGKey(0)
out = {}
for shape in ((4, 4, 96, 96), (4, 1, 96)):  # above UNROLL_MIN, and a small (broadcast) mask
  for impl in ("auto", "cpu", "xla"):
    fn = jax.jit(lambda k: layers.keep_mask(k, 0.9, shape, impl=impl))
    lowered = {p: lowered_for(p, fn, key) for p in ("cpu", "tpu")}  # a TPU's as `remixer-t5 compile` traces it
    with flop_count.counting_model_flops():
      counting = jax.jit(lambda k: layers.keep_mask(k, 0.9, shape, impl=impl)).lower(key).as_text()
    out[f"{shape[1]}/{impl}"] = {"cpu": lowered["cpu"].count("remixer_materialize"),
                                 "tpu": lowered["tpu"].count("remixer_materialize"),
                                 "counting": counting.count("remixer_materialize"),
                                 "same": bool((fn(key) == jax.random.bernoulli(key, 0.9, shape)).all())}
out["describe"] = threefry.describe()
out["devices"] = jax.device_count()
print(json.dumps(out))
"""


def test_the_materialize_call_is_in_cpu_programs_of_large_masks_only():
  """layers.keep_mask with impl 'auto' or 'cpu' lowered for a CPU passes a large mask through the materialize
  custom call; impl 'xla', a small mask, 'auto' traced for a TPU and a FLOP count do not. The bits are JAX's."""
  p = run_py(LOWERED, {})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  assert r.pop("devices") == 1 and r.pop("describe") == "unrolled hash, large masks computed once"
  assert all(v["same"] and v["counting"] == 0 for v in r.values()), r
  assert {k: v["cpu"] > 0 for k, v in r.items()} == {
    "4/auto": True,
    "4/cpu": True,
    "4/xla": False,
    "1/auto": False,
    "1/cpu": False,
    "1/xla": False,
  }
  assert r["4/auto"]["tpu"] == 0 and r["4/xla"]["tpu"] == 0


ONCE = """
import json, os, re
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from remixer_t5.model import layers
from remixer_t5.kernels.cpu import threefry

SHAPE = (4, 4, 96, 96)  # 147,456 elements: above UNROLL_MIN

class Net(nn.Module):
  impl: str  # 'flax': flax's own Dropout
  @nn.compact
  def __call__(self, x):
    drop = nn.Dropout if self.impl == "flax" else lambda *a, **k: layers.Dropout(*a, **k, impl=self.impl)
    y = drop(0.1)(jnp.tanh(x), deterministic=False)  # an attention-sized mask, read by forward and backward
    z = drop(0.1, broadcast_dims=(-2,))(y * 2.0, deterministic=False)  # a broadcast [4, 4, 1, 96] mask
    return jnp.sum(z ** 2)

def hashes(text):
  # XLA fuses the unrolled hash: each copy is a fused computation with 20 rounds of u32 xors of the mask's shape
  bodies = re.split(r"\\n(?=%?fused_computation)", text)
  return sum(1 for b in bodies if b.count("u32[4,4,96,96]{3,2,1,0} xor(") >= 20)

x = jnp.asarray(np.random.default_rng(0).normal(size=SHAPE), jnp.float32)
key = jax.random.PRNGKey(5)
out = {}
for impl in ("flax", "xla", "cpu", "auto"):
  fn = jax.jit(jax.value_and_grad(lambda x, k: Net(impl).apply({}, x, rngs={"dropout": k})))
  v, g = fn(x, key)
  if impl == "flax":
    ref = (v, g)
  text = fn.lower(x, key).compile().as_text()
  out[impl] = {"same_value": bool(v == ref[0]), "same_grad": bool(np.array_equal(g, ref[1])),
               "custom_calls": text.count('custom_call_target="remixer_materialize"'), "hashes": hashes(text)}
out["describe"] = threefry.describe()
print(json.dumps(out))
"""


def test_large_masks_hashed_once():
  """layers.Dropout is flax's Dropout (the same mask, value and gradient from the same key) with every impl;
  with 'cpu' and 'auto' on a CPU its large mask goes through the custom call and XLA hashes it once for forward
  and backward, where the unrolled hash alone would be fused into both. The broadcast mask (small) keeps JAX's
  form, and 'xla' (JAX's rolled loop, no unrolled hash) has no custom call."""
  p = run_py(ONCE, {})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  for impl in ("xla", "cpu", "auto"):
    assert r[impl]["same_value"] and r[impl]["same_grad"], (impl, r)
  assert r["flax"]["custom_calls"] == r["xla"]["custom_calls"] == 0 and r["xla"]["hashes"] == 0, r
  assert r["cpu"] == r["auto"] == {**r["cpu"], "custom_calls": 1, "hashes": 1}, r
  assert r["describe"] == "unrolled hash, large masks computed once"


@pytest.mark.integration
def test_large_masks_left_alone_on_a_mesh():
  """With more than one JAX device the custom call (which XLA cannot partition) is not used: the unrolled hash is
  fused into each reader, the same bits."""
  p = run_py(ONCE, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  for impl in ("cpu", "auto"):
    assert r[impl]["same_value"] and r[impl]["same_grad"] and r[impl]["custom_calls"] == 0, (impl, r)
    assert r[impl]["hashes"] >= 2, (impl, r)  # forward and backward each hash the mask
  assert r["describe"] == "unrolled hash"


def test_large_masks_fused_when_the_custom_call_cannot_build(tmp_path):
  """No C++ compiler: the masks stay the unrolled hash, fused into each reader, the same bits."""
  p = run_py(ONCE, {"CXX": str(tmp_path / "no-such-compiler"), "REMIXER_T5_CACHE_DIR": str(tmp_path / "cache")})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  for impl in ("cpu", "auto"):
    assert r[impl]["same_value"] and r[impl]["same_grad"] and r[impl]["custom_calls"] == 0, (impl, r)
    assert r[impl]["hashes"] >= 2, (impl, r)
  assert r["describe"] == "unrolled hash"


STEP = """
import json
import jax, jax.numpy as jnp, numpy as np
from remixer_t5.bench import train as bench_train
from remixer_t5 import gin_utils
from remixer_t5.kernels.cpu import threefry
threefry.UNROLL_MIN = 1000  # the tiny model's attention masks (2 x 2 x 16 x 16 and up) through the unrolled hash
lengths = {"inputs": 16, "targets": 24}
out = {}
for impl in ("xla", "cpu"):
  # The model built with T5Config.dropout_impl bound in gin, traced while that config is in force.
  gin_utils.parse_gin(["models/t5_1_1/tiny.gin"], ["DROPOUT_RATE=0.1", f"network.T5Config.dropout_impl='{impl}'"])
  model = bench_train.from_gin(2, lengths)["model"]
  if impl == "xla":
    batch = {k: jnp.asarray(v) for k, v in bench_train.random_batch(model.module.config.vocab_size, 2, lengths).items()}
    params = model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
  step = jax.jit(jax.value_and_grad(lambda p, k: model.loss_fn(p, batch, k)[0]))
  losses = [step(params, jax.random.PRNGKey(s)) for s in (1, 2)]
  text = step.lower(params, jax.random.PRNGKey(1)).compile().as_text()
  out[impl] = {"losses": [float(l) for l, _ in losses], "grads": [g for _, g in losses],
               "materialized": text.count('custom_call_target="remixer_materialize"')}
worst = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
            for a_tree, b_tree in zip(out["cpu"].pop("grads"), out["xla"].pop("grads"))
            for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))
print(json.dumps({**out, "worst_grad": worst}))
"""


@pytest.mark.integration
def test_a_train_step_with_either_implementation_has_the_same_loss():
  """The tiny T5.1.1's loss and gradients (dropout 0.1) with T5Config.dropout_impl 'xla' and 'cpu', from the same
  keys: the same dropout masks, so the same loss (to the bit); the 'cpu' program computes its attention masks once (the
  materialize call) and the 'xla' one does not. Another key gives another loss (the masks are used). (`make test`
  checks the masks bit for bit and the call in the program: test_keep_mask_is_jaxs_bernoulli_bit_for_bit,
  test_the_materialize_call_is_in_cpu_programs_of_large_masks_only.)"""
  p = run_py(STEP, {})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  assert r["xla"]["materialized"] == 0 and r["cpu"]["materialized"] >= 6, r  # 2 layers' 3 attention masks
  assert r["cpu"]["losses"] == r["xla"]["losses"], r
  assert r["worst_grad"] < 1e-5, r  # (XLA fuses the two programs differently: gradients within float rounding)
  assert r["xla"]["losses"][0] != r["xla"]["losses"][1]
