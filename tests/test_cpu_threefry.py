"""remixer_t5/cpu_threefry.py: JAX's Threefry-2x32 hash unrolled as its CPU lowering, the same bits.

The hash is checked against Random123's published known answers (an independent reference), and the registered
lowering against JAX's own rolled loop on every random function the models use, in a fresh process (a lowering
registration is process-wide)."""
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_util import run_py

from remixer_t5 import cpu_threefry

REPO = Path(__file__).resolve().parents[1]

# Random123 (Salmon et al. 2011), kat_vectors: threefry2x32 with 20 rounds, (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("rolled", [False, True])
@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected, rolled):
  out = cpu_threefry.threefry_2x32(np.uint32(key[0]), np.uint32(key[1]), jnp.asarray([counter[0]], jnp.uint32),
                                   jnp.asarray([counter[1]], jnp.uint32), rolled=rolled)
  assert [int(o[0]) for o in out] == list(expected)
  assert all(o.dtype == jnp.uint32 and o.shape == (1,) for o in out)


def test_broadcasts_like_the_primitive():
  k1, k2 = np.uint32(7), np.uint32(11)
  x1 = jnp.arange(6, dtype=jnp.uint32).reshape(2, 3)
  out = cpu_threefry.threefry_2x32(k1, k2, x1, jnp.uint32(5))
  assert [o.shape for o in out] == [(2, 3), (2, 3)]
  one = cpu_threefry.threefry_2x32(k1, k2, jnp.asarray([4], jnp.uint32), jnp.asarray([5], jnp.uint32))
  assert int(out[0][1, 1]) == int(one[0][0]) and int(out[1][1, 1]) == int(one[1][0])


def test_modes():
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPU_THREEFRY='fast': expected one of on, fused, off"):
    cpu_threefry.configure(environ={"REMIXER_T5_CPU_THREEFRY": "fast"}, cpu_only=True)
  assert cpu_threefry.configure(environ={"REMIXER_T5_CPU_THREEFRY": "off"}, cpu_only=True) is False
  assert cpu_threefry.configure(environ={}, cpu_only=False) is False  # TPU or GPU: JAX's lowering


SAME_BITS = """
import json
import jax, jax.numpy as jnp, numpy as np
from remixer_t5 import cpu_threefry

def small(key):  # keys and arrays below UNROLL_MIN elements: the loop
  k1, k2 = jax.random.split(key)
  return {"split": jax.random.key_data(jax.random.split(jax.random.wrap_key_data(key), 5)),
          "fold_in": jax.random.fold_in(key, 7), "bernoulli": jax.random.bernoulli(k2, 0.9, (4, 7, 33)),
          "uniform": jax.random.uniform(k1, (257,)), "normal": jax.random.normal(k2, (5, 3)),
          "bits_odd": jax.random.bits(k2, (7,))}

def large(key):  # at or above it (the hash of a bits draw covers half its elements): unrolled, fused
  return {"bits": jax.random.bits(key, (3, 2**16 + 1)), "bernoulli": jax.random.bernoulli(key, 0.9, (4, 4, 96, 96)),
          "masked": jnp.where(jax.random.bernoulli(key, 0.9, (512, 300)), 2.0, 0.0)}

def run(draws, key):
  fn = jax.jit(lambda k: draws(k))  # a new function object: traced and lowered with the rule in force now
  return {k: np.asarray(v) for k, v in fn(key).items()}, fn.lower(key).compile().as_text().count(" while(")

keys = [jax.random.PRNGKey(s) for s in (0, 3, 2**31 - 1)]
out = {}
for name, draws in (("small", small), ("large", large)):
  out[name + "_before"] = [run(draws, k) for k in keys]
assert cpu_threefry.configure(log=print, environ={}, cpu_only=True)
for name, draws in (("small", small), ("large", large)):
  out[name + "_after"] = [run(draws, k) for k in keys]
same = all(np.array_equal(b[0][n], a[0][n]) for kind in ("small", "large")
           for b, a in zip(out[kind + "_before"], out[kind + "_after"]) for n in b[0])
print(json.dumps({"same": same, "applied": cpu_threefry.applied,
                  **{k: v[0][1] for k, v in out.items()}}))
"""


def test_same_bits_as_jax_and_large_arrays_without_its_loop():
  p = run_py(SAME_BITS, {})
  assert p.returncode == 0, p.stderr[-3000:]
  assert "random bits: Threefry unrolled on XLA:CPU for arrays of 65,536+ elements, the same bits" in p.stdout
  r = json.loads(p.stdout.strip().splitlines()[-1])
  assert r["same"] is True and r["applied"] is True
  assert r["large_before"] >= 3 and r["large_after"] == 0  # JAX's rolled loop for each draw, then none
  assert r["small_before"] > 0 and r["small_after"] == r["small_before"]  # small arrays keep a loop


@pytest.mark.integration
def test_train_steps_through_both_lowerings():
  """The benchmark script's tiny config: T5.1.1's whole train step (dropout 0.1) with JAX's loop and with this
  module's lowering in one process (attention masks of 2,304 elements unrolled): fewer while loops, and the same
  losses up to XLA's fusion order."""
  p = subprocess.run([sys.executable, "scripts/bench_threefry_cpu.py", "--config", "tiny", "--models", "t5_1_1",
                      "--rounds", "1", "--steps", "2", "--warmup", "1", "--unroll_min", "1000"], capture_output=True, text=True,
                     timeout=600, cwd=REPO, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu",
                                                 "XLA_FLAGS": ""})
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
  by = {r["variant"]: r for r in rows}
  assert set(by) == {"rolled", "fused", "once"} and all(r["model"] == "t5_1_1" for r in rows)
  assert by["rolled"]["while_loops"] > by["fused"]["while_loops"] > 0  # attention masks unrolled, keys not
  assert by["once"]["while_loops"] == by["fused"]["while_loops"]
  assert by["rolled"]["materialized"] == by["fused"]["materialized"] == 0
  assert by["once"]["materialized"] == 6  # the 2 layers' encoder, decoder and cross-attention masks (1,024+)
  assert [by[v]["cpu_threefry"] for v in ("rolled", "fused", "once")] == [None, "unrolled",
                                                                           "unrolled, large masks hashed once"]
  for v in ("fused", "once"):
    assert abs(by["rolled"]["loss_sum"] - by[v]["loss_sum"]) <= 1e-6 * abs(by["rolled"]["loss_sum"])
  assert "t5_1_1: rolled" in p.stdout


ONCE = """
import json, os, re
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from remixer_t5 import cpu_threefry, flop_count, layers

SHAPE = (4, 4, 96, 96)  # 147,456 elements: above UNROLL_MIN

class Net(nn.Module):
  ours: bool
  @nn.compact
  def __call__(self, x):
    drop = layers.Dropout if self.ours else nn.Dropout
    y = drop(0.1)(jnp.tanh(x), deterministic=False)  # an attention-sized mask, read by forward and backward
    z = drop(0.1, broadcast_dims=(-2,))(y * 2.0, deterministic=False)  # a broadcast [4, 4, 1, 96] mask
    return jnp.sum(z ** 2)

def grad_fn(ours):
  return jax.jit(jax.value_and_grad(lambda x, k: Net(ours).apply({}, x, rngs={"dropout": k})))

def hashes(text):
  # XLA fuses the unrolled hash: each copy is a fused computation with 20 rounds of u32 xors of the mask's shape
  bodies = re.split(r"\\n(?=%?fused_computation)", text)
  return sum(1 for b in bodies if b.count("u32[4,4,96,96]{3,2,1,0} xor(") >= 20)

x = jnp.asarray(np.random.default_rng(0).normal(size=SHAPE), jnp.float32)
key = jax.random.PRNGKey(5)
ref = grad_fn(False)(x, key)  # flax's Dropout, before anything is configured
out = {}
mode = {"REMIXER_T5_CPU_THREEFRY": os.environ["ONCE_MODE"]}
assert cpu_threefry.configure(log=print, environ={**os.environ, **mode}, cpu_only=True)
for name, ours in (("flax", False), ("ours", True)):
  fn = grad_fn(ours)
  (v, g) = fn(x, key)
  text = fn.lower(x, key).compile().as_text()
  out[name] = {"same_value": bool(v == ref[0]), "same_grad": bool(np.array_equal(g, ref[1])),
               "custom_calls": text.count('custom_call_target="remixer_materialize"'), "hashes": hashes(text)}
with flop_count.counting_model_flops():
  text = jax.jit(jax.value_and_grad(lambda x, k: Net(True).apply({}, x, rngs={"dropout": k}))).lower(x, key).as_text()
out["counting_custom_calls"] = text.count("remixer_materialize")
out["describe"] = cpu_threefry.describe()
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["on", "fused"])
def test_large_masks_hashed_once(mode):
  """layers.Dropout is flax's Dropout (same mask, value and gradient from the same key); in `on` mode its large
  mask goes through the custom call and XLA hashes it once for forward and backward, where flax's Dropout, or
  `fused` mode, hash it in more than one loop. The broadcast mask (small) keeps its loop either way, and inside
  the FLOP-count context the custom call is left out."""
  p = run_py(ONCE, {"ONCE_MODE": mode})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  assert r["flax"] == {**r["flax"], "same_value": True, "same_grad": True, "custom_calls": 0}
  assert r["ours"]["same_value"] and r["ours"]["same_grad"]
  assert r["flax"]["hashes"] >= 2  # forward and backward each hash the mask
  if mode == "on":
    assert "each such dropout mask hashed once" in p.stdout
    assert r["ours"]["custom_calls"] == 1 and r["ours"]["hashes"] == 1
    assert r["describe"] == "unrolled, large masks hashed once"
  else:
    assert r["ours"]["custom_calls"] == 0 and r["ours"]["hashes"] == r["flax"]["hashes"]
    assert r["describe"] == "unrolled"
  assert r["counting_custom_calls"] == 0


def test_large_masks_left_alone_on_a_mesh():
  """With more than one JAX device the custom call (which XLA cannot partition) is not used."""
  p = run_py(ONCE, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "ONCE_MODE": "on"})
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(p.stdout.strip().splitlines()[-1])
  assert r["ours"]["same_value"] and r["ours"]["same_grad"] and r["ours"]["custom_calls"] == 0


def test_large_masks_fused_when_the_custom_call_cannot_build(tmp_path):
  """No C++ compiler: one line saying so, and the masks stay as flax draws them (hashed in each reader)."""
  p = run_py(ONCE, {"ONCE_MODE": "on", "CXX": str(tmp_path / "no-such-compiler"),
                    "REMIXER_T5_CACHE_DIR": str(tmp_path / "cache")})
  assert p.returncode == 0, p.stderr[-3000:]
  assert "random bits: dropout masks hashed in each loop that reads them (no C++ compiler" in p.stdout
  r = json.loads(p.stdout.strip().splitlines()[-1])
  assert r["ours"]["same_value"] and r["ours"]["same_grad"] and r["ours"]["custom_calls"] == 0
  assert r["ours"]["hashes"] == r["flax"]["hashes"] >= 2 and r["describe"] == "unrolled"
