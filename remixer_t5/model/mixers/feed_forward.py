"""T5.1.1's position-wise feature mixer: the gated-GELU feed-forward (Shazeer 2020, GEGLU)."""

from __future__ import annotations

import jax
from flax import linen as nn

from remixer_t5.model import layers
from remixer_t5.model.mixers import base


class GatedMlp(nn.Module):
  """wo(act_0(x wi_0) * act_1(x wi_1)) with cfg.mlp_activations; parameters wi_0, wi_1, wo as in t5x."""

  KIND = "mlp"  # slot naming in network.py (t5x parameter names)
  config: object
  hidden_dim: int = 0  # 0: config.mlp_dim

  @nn.compact
  def __call__(self, x: jax.Array, ctx: base.MixerContext | None = None, *, deterministic: bool = True):
    cfg = self.config
    acts = cfg.mlp_activations
    wi = [
      layers.Dense(
        self.hidden_dim or cfg.mlp_dim, ("embed", "mlp"), dtype=cfg.dtype, name=f"wi_{i}" if len(acts) > 1 else "wi"
      )
      for i in range(len(acts))
    ]
    hidden = None
    for act, h in zip(acts, layers.fused_dense(x, wi) if cfg.fuse_projections and len(wi) > 1 else [d(x) for d in wi]):
      h = layers.activation(act)(h)
      hidden = h if hidden is None else hidden * h
    hidden = layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(
      hidden, deterministic=deterministic
    )
    hidden = layers.with_sharding_constraint(hidden, ("batch", "length", "mlp"))
    return layers.Dense(x.shape[-1], ("mlp", "embed"), dtype=cfg.dtype, name="wo")(hidden)
