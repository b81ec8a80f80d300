"""bench/hypermixing.py: the arithmetic-only kernels do the causal kernel's arithmetic (checked against numpy
loops of the same recurrences in Pallas's interpreter), and the dry run times every form."""

import jax
import numpy as np
from scipy.special import erf

from remixer_t5.bench import hypermixing as bench


def gelu_and_slope(a):
  cdf = 0.5 * (1.0 + erf(a / np.sqrt(2.0)))
  return a * cdf, cdf + a * np.exp(-a * a / 2) / np.sqrt(2 * np.pi)


def test_the_arithmetic_kernels_compute_their_recurrences():
  b, n, h, d, bh, bd = 2, 6, 32, 32, 16, 16
  rng = np.random.default_rng(0)
  w1, x, w2, g = (rng.normal(size=s).astype(np.float32) for s in ((b, n, h), (b, n, d), (b, n, h), (b, n, d)))
  forward, backward = bench.arithmetic((b, n, h, d), bh, bd, 2, interpret=True)
  with jax.default_matmul_precision("highest"):
    out = np.asarray(forward(w1, x, w2))
    dw1, dx, dw2 = map(np.asarray, backward(w1, x, w2, g))
  assert out.shape == (h // bh, b, d) and dw1.shape == (d // bd, b, h) and dx.shape == (h // bh, b, d)
  for r in range(b):
    for k in range(h // bh):
      for c in range(d // bd):
        rows, cols = slice(k * bh, (k + 1) * bh), slice(c * bd, (c + 1) * bd)
        u, v, w, gg = w1[r, 0, rows], x[r, 0, cols], w2[r, 0, rows], g[r, 0, cols]
        # forward: the state after i + 1 steps is (i + 1) u v^T, read at scale 1 / (i + 1)
        want, state = np.zeros(bd), np.zeros((bh, bd))
        for i in range(n):
          state = state + np.outer(u, v)
          want += w @ gelu_and_slope(state / (i + 1))[0]
        np.testing.assert_allclose(out[k, r, cols], want, rtol=2e-5, atol=2e-5)
        # backward: from n u v^T down, one outer product less a step
        state, adj = n * np.outer(u, v), np.zeros((bh, bd))
        a1, a3, a2 = np.zeros(bh), np.zeros(bd), np.zeros(bh)
        for t in range(n):
          scale = 1.0 / (n - t)
          act, slope = gelu_and_slope(state * scale)
          a2 += (act * gg).sum(1)
          adj = adj + np.outer(w, gg) * slope * scale
          a1 += (adj * v).sum(1)
          a3 += (adj * u[:, None]).sum(0)
          state = state - np.outer(u, v)
        np.testing.assert_allclose(dw1[c, r, rows], a1, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dx[k, r, cols], a3, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dw2[c, r, rows], a2, rtol=1e-4, atol=1e-4)


def test_the_dry_run_times_the_kernel_and_its_arithmetic():
  rows = bench.run(dry=True, repeats=1, warmup=0, log=lambda s: None)
  assert [r["form"] for r in rows] == ["kernel 16x16 w2", "arithmetic"]
  for r in rows:
    assert "error" not in r, r
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["decoder_ms"] == 12 * r["fwd_bwd_ms"]
    assert r["gelu_per_s"] == 2 * 8 * 32 * 32 / (r["fwd_ms"] / 1e3)
  assert rows[-1]["of_arithmetic"] == 1.0
