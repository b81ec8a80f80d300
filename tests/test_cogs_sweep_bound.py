"""scripts/cogs_sweep_bound.py: a COGS model's train step against its matmuls timed alone."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "cogs_sweep_bound.py"


@pytest.fixture
def bound(monkeypatch):
  monkeypatch.syspath_prepend(str(REPO / "scripts"))
  import cogs_sweep_bound
  return cogs_sweep_bound


def run(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env)


def test_every_dot_of_a_program_is_found_with_its_count_and_flops(bound):
  """Dots in a scan (times its length), a cond (its cheapest branch) and a gradient, against XLA's own count."""
  w = jnp.ones((8, 16))
  v = jnp.ones((3, 16, 5))
  x = jnp.ones((4, 8))
  flops = lambda found: sum(n * bound.dot_flops(k) for k, n in found.items())

  def dots_only(w, x, unroll=1):
    h = x @ w                                                  # [4, 8] . [8, 16]
    def body(c, _):
      return c @ w.T @ w, None                                 # two dots, 5 times
    h, _ = jax.lax.scan(body, h, None, length=5, unroll=unroll)
    return jnp.einsum("bi,kio->bko", h, v)                     # no batch dims, 3 free output dims
  found, loops = bound.step_dots(dots_only, w, x)
  assert loops == 0
  assert flops(found) == 2 * (4 * 8 * 16 + 5 * (4 * 16 * 8 + 4 * 8 * 16) + 4 * 16 * 3 * 5)
  assert found[next(k for k in found if k[1] == (16, 8))] == 5  # the scan's first dot, once per iteration
  # XLA's count of the same program unrolled (a loop's body XLA would count once)
  unrolled = lambda w, x: dots_only(w, x, unroll=True)
  assert flops(found) == jax.jit(unrolled).lower(w, x).compile().cost_analysis()["flops"]

  def with_cond(x):
    y = x @ w
    return jax.lax.cond(y.sum() > 0, lambda y: y @ jnp.ones((16, 64)), lambda y: jnp.broadcast_to(y[:, :1], (4, 64)), y)
  found, _ = bound.step_dots(with_cond, x)
  assert list(found.values()) == [1] and flops(found) == 2 * 4 * 8 * 16  # the branch without a dot is cheaper

  # The gradient with respect to w alone: the forward dot and x^T dy, the same FLOPs again.
  found, _ = bound.step_dots(jax.grad(lambda w: jnp.tanh(x @ w).sum()), w)
  assert sum(found.values()) == 2 and flops(found) == 2 * (2 * 4 * 8 * 16)


def test_batched_dot_flops_match_xla(bound):
  a, b = jnp.ones((4, 4, 32, 24)), jnp.ones((4, 24, 4, 16))
  f = lambda a, b: jnp.einsum("bhqk,bkhd->bhqd", a, b)
  (key, n), = bound.step_dots(f, a, b)[0].items()
  assert n == 1
  assert bound.dot_flops(key) == jax.jit(f).lower(a, b).compile().cost_analysis()["flops"] == 2 * 4 * 4 * 32 * 24 * 16


TINY = ["network.T5Config.emb_dim=32", "network.T5Config.mlp_dim=48", "network.T5Config.num_heads=2",
        "network.T5Config.head_dim=16", "BATCH_SIZE=2", "TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 24}"]


@pytest.mark.integration
def test_a_cogs_model_row_and_the_sweep_line():
  """The sweep's config with a tiny shape (--gin bindings, recorded in the row), to keep the test short."""
  proc = run("--models", "t5_1_1", "--steps", "10", "--seeds", "2", "--repeats", "2", "--rounds", "2",
             "--step_repeats", "2", "--top", "3", "--json", *(f"--gin={b}" for b in TINY))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert len(rows) == 1
  row = rows[0]
  assert row["model"] == "t5_1_1" and row["gin_bindings"] == TINY
  # d 32, 2 + 2 layers, 2 heads of 16, gated-GELU 48, COGS's 1,280 ids: the bindings took effect
  assert row["params"] == 1280 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 48 + 2 * 32) + 2 * (8 * 32 * 32 + 3 * 32 * 48
                                                                                        + 3 * 32) + 2 * 32 \
      + 32 * 1280 + 2 * 32 * 2  # embeddings, layers, final norms, logits, relative position biases (32 buckets)
  assert row["dots_alone_ms"] > 0 and row["step_ms"] > 0 and row["while_loops"] == 0
  assert row["dots_per_step"] >= 3 * 12 * 2  # forward, input and kernel gradient of 12+ Dense layers at least
  # The dots found cover the model's FLOPs as XLA counts them (forward + backward of the loss), within 10%.
  assert row["dot_flops_per_step"] == pytest.approx(row["model_flops_per_step"], rel=0.1)
  assert row["sweep_steps_h"] == pytest.approx(2 * 10 * row["step_ms"] / 3.6e6, abs=1e-3)
  assert sum(d["per_step"] for d in row["dots"]) == row["dots_per_step"]
  assert row["rounds"] == 2 and row["repeats"] == 2
  assert row["cpu_count"] and row["git_commit"] and row["load_average_start"] is not None
  assert "sweep (t5_1_1; 2 seeds x 10 steps, training only): >= " in proc.stdout
  assert "of matmuls at the fastest rate any of them reached" in proc.stdout
  assert proc.stdout.count(" x (") == 3  # --top 3


@pytest.mark.parametrize("args, message", [
    (("--models", "t5_1_1,nope"), "no gin/models/<model>/cogs.gin for nope"),
    (("--seeds", "0"), "--seeds 0: expected a positive count"),
    (("--rounds", "0"), "--rounds 0: expected a positive count"),
])
def test_bad_flags_are_refused(args, message):
  proc = run(*args)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
