"""The fused GPU attention against its references at T5.1.1-base's shapes: forward and forward + backward times.

Forms, each the median of `repeats` calls after `warmup` (compiled first), at each shape:
- `pallas`: kernels/gpu/flash_attention.py with T5's relative bias, packed rows' segment ids and causal masking
  where the shape has them, at each candidate tiling (the forward's and the gradient kernels' alike);
- `xla`: the model's plain-JAX attention (`dot_product_attention`, what `attention_impl='xla'` runs);
- `mha`: JAX's Pallas GPU attention (`jax.experimental.pallas.ops.gpu.attention.mha`) without bias or segment
  ids, where the lengths are whole blocks of 128: the ceiling for a kernel of this design at that shape.
FLOPs: 4 b h q k d for the forward's two products (halved when causal), 2.5 times that more for the backward
(FlashAttention-2's count), as TFLOP/s; `of_mha`: a form's rate over mha's at the same shape. The fastest
tilings (the forward's by forward time, the gradient's by the rest of forward + backward) are the `TILINGS` row
for the GPU (`device_kind`). `max_diff_vs_xla`: each biased form's output against the XLA form's, relative to
its largest magnitude (bfloat16: ~1e-2). On a CPU (`dry=True`) the kernels run in Pallas's interpreter at tiny shapes: a
check that every form runs, not a measurement.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5.bench.train import jit_seconds
from remixer_t5.kernels.bias import RelativeBias
from remixer_t5.kernels.gpu import flash_attention as fa
from remixer_t5.model.mixers.attention import dot_product_attention

# name: (batch, q, k, heads, head dim, causal, segments a row): runs/pretrain.gin's packed rows, T5.1.1-base
SHAPES = {"encoder": (128, 512, 512, 12, 64, False, 4), "decoder": (128, 114, 114, 12, 64, True, 4)}
DRY_SHAPES = {"encoder": (2, 64, 64, 2, 16, False, 2), "decoder": (2, 40, 40, 2, 16, True, 2)}
T = fa.Tiling
CANDIDATES = (T(64, 64, 4, 2), T(64, 64, 4, 3), T(128, 64, 4, 2), T(128, 64, 8, 2), T(64, 128, 4, 2), T(128, 128, 8, 2))
DRY_CANDIDATES = (T(16, 16), T(32, 16))


def _inputs(shape, seed: int = 0):
  b, nq, nk, h, d, causal, pieces = shape
  rng = np.random.default_rng(seed)
  normal = lambda *s, scale=1.0: jnp.asarray(scale * rng.normal(size=s), jnp.bfloat16)
  seg = lambda n: jnp.asarray(
    np.tile(np.repeat(np.arange(1, pieces + 1), np.diff(np.linspace(0, n, pieces + 1).astype(int))), (b, 1)), jnp.int32
  )
  return (
    normal(b, nq, h, d, scale=0.125),
    normal(b, nk, h, d),
    normal(b, nk, h, d),
    jnp.asarray(rng.normal(size=(h, nq + nk - 1)), jnp.float32),
    seg(nq),
    seg(nk),
    normal(b, nq, h, d),
  )


def forms(shape, dry: bool, candidates) -> dict[str, Callable]:
  """name -> attention(q, k, v, rel, q_seg, kv_seg) for the shape's masks."""
  nq, nk, causal = shape[1], shape[2], shape[5]
  out = {
    f"pallas {t.block_q}x{t.block_k} w{t.num_warps} s{t.num_stages}": (
      lambda t: (
        lambda q, k, v, rel, qs, ks: fa.attention(
          q,
          k,
          v,
          bias=RelativeBias(rel, nq),
          q_segment_ids=qs,
          kv_segment_ids=ks,
          causal=causal,
          dtype=jnp.bfloat16,
          interpret=dry,
          tiling=t,
        )
      )
    )(t)
    for t in candidates
  }
  out["xla"] = lambda q, k, v, rel, qs, ks: dot_product_attention(
    q, k, v, RelativeBias(rel, nq), qs, ks, None, causal=causal, dropout_rate=0.0, dtype=jnp.bfloat16
  )
  if nq % 128 == 0 and nk % 128 == 0 or dry:
    from jax.experimental.pallas.ops.gpu import attention as jax_gpu

    out["mha"] = lambda q, k, v, rel, qs, ks: jax_gpu.mha(q, k, v, None, sm_scale=1.0, causal=causal, interpret=dry)
  return out


def measure(shape, form: Callable, repeats: int, warmup: int, want=None) -> dict:
  """Times of the forward and of forward + backward; with `want` (the XLA form's output), the output's largest
  difference from it."""
  q, k, v, rel, qs, ks, g = _inputs(shape)
  diff = {}
  if want is not None:
    got = np.asarray(jax.jit(form)(q, k, v, rel, qs, ks), np.float32)
    diff["max_diff_vs_xla"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
  loss = lambda q, k, v, rel: jnp.sum(form(q, k, v, rel, qs, ks).astype(jnp.float32) * g.astype(jnp.float32))
  fwd = jit_seconds(lambda q, k, v, rel: form(q, k, v, rel, qs, ks), (q, k, v, rel), repeats, warmup)
  both = jit_seconds(jax.grad(loss, argnums=(0, 1, 2, 3)), (q, k, v, rel), repeats, warmup)
  b, nq, nk, h, d, causal, _ = shape
  flops = 4 * b * h * nq * nk * d * (0.5 if causal else 1.0)
  return {
    **diff,
    "fwd_ms": 1e3 * fwd,
    "fwd_bwd_ms": 1e3 * both,
    "fwd_tflops": flops / fwd / 1e12,
    "fwd_bwd_tflops": 3.5 * flops / both / 1e12,
  }


def run(
  *, dry: bool = False, repeats: int = 10, warmup: int = 2, candidates=None, log: Callable[[str], None] = print
) -> list[dict]:
  """Rows per (shape, form), then one `best` row per shape with the fastest tilings."""
  shapes, candidates = (DRY_SHAPES, candidates or DRY_CANDIDATES) if dry else (SHAPES, candidates or CANDIDATES)
  kind = jax.devices()[0].device_kind
  rows = []
  for name, shape in shapes.items():
    timed, named = {}, forms(shape, dry, candidates)
    q, k, v, rel, qs, ks, _ = _inputs(shape)
    want = np.asarray(jax.jit(named["xla"])(q, k, v, rel, qs, ks), np.float32)
    for form_name, form in named.items():
      row = {"shape": name, "dims": list(shape), "form": form_name, "device_kind": kind, "dry": dry}
      try:
        row.update(measure(shape, form, repeats, warmup, None if form_name == "mha" else want))
        timed[form_name] = row
      except Exception as e:  # noqa: BLE001 - a tiling that does not compile (shared memory) costs its row only
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      rows.append(row)
      log(
        f"{name} {form_name}: "
        + (
          row.get("error")
          or f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms ({row['fwd_bwd_tflops']:.1f} TFLOP/s)"
        )
      )
    if "mha" in timed:
      for row in timed.values():
        row["of_mha"] = row["fwd_bwd_tflops"] / timed["mha"]["fwd_bwd_tflops"]
    pallas = {n: r for n, r in timed.items() if n.startswith("pallas")}
    if pallas:
      fwd = min(pallas, key=lambda n: pallas[n]["fwd_ms"])
      bwd = min(pallas, key=lambda n: pallas[n]["fwd_bwd_ms"] - pallas[n]["fwd_ms"])
      rows.append({"shape": name, "form": "best", "device_kind": kind, "dry": dry, "forward": fwd, "gradient": bwd})
      log(f"{name} best: forward {fwd}, gradient {bwd}")
  return rows
