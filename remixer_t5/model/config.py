"""`T5Config`: the sizes and options that layers, mixers and the network read; of ours it imports only the kernel
registry (kernels/__init__.py), for the implementation names its fields take.

The network (`network.py`) builds stacks from mixers; mixers and layers read their sizes from this config, so
dependencies run downward: network -> mixers/layers -> config. gin files name it `network.T5Config` (re-exported).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from remixer_t5 import kernels


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Sizes and options shared by all mixers; field names follow t5x's `T5Config`."""

  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  mlp_activations: Sequence[str] = ("gelu", "linear")
  dropout_rate: float = 0.0
  dtype: str = "float32"  # activations (ACTIVATION_DTYPES; the model files: 'auto'); parameters always float32
  relpos_num_buckets: int = 32
  relpos_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  float32_attention_logits: bool = True
  # Memory options (same numbers, different memory/compile time): per-layer rematerialisation of the stacks'
  # layers (REMAT_POLICIES), and one `nn.scan` over each stack with parameters stacked on a leading 'layers'
  # axis (`<stack>/layers/...`; `unstack_scanned_params` gives the unrolled `<stack>/layers_<i>/...` tree).
  remat_policy: str = "none"
  scan_layers: bool = False
  # How each layer wires norms and residuals around its slots (LAYER_LAYOUTS; HyperMixer paper App. F).
  layer_layout: str = "pre_norm"
  # Which implementation computes attention and dropout's keep mask (remixer_t5/kernels/: 'auto' picks by the
  # platform the program is lowered for; 'xla' is the plain-JAX reference everywhere).
  attention_impl: str = "auto"
  dropout_impl: str = "auto"
  # Step layout (the same parameters, checkpoints and function, rounding aside): the products that read one
  # input as one product each (attention's query/key/value, cross-attention's key/value, the gated MLP's
  # wi_0/wi_1: `layers.fused_dense`); the logits product with activation-dtype operands and float32 output, its
  # gradient's products too (`layers.accumulating_einsum`; else all float32: on GPUs TF32).
  fuse_projections: bool = False
  logits_in_activation_dtype: bool = False

  def __post_init__(self):
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    if self.dtype != "auto":  # a name or a dtype (jnp.bfloat16), kept as its name
      try:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
      except TypeError:
        pass  # not a dtype: refused below, with the choices
    for name, choices in (
      ("dtype", ACTIVATION_DTYPES),
      ("remat_policy", tuple(REMAT_POLICIES)),
      ("layer_layout", LAYER_LAYOUTS),
      ("attention_impl", ATTENTION_IMPLS),
      ("dropout_impl", DROPOUT_IMPLS),
    ):
      if getattr(self, name) not in choices:
        raise ValueError(f"T5Config.{name} must be one of {choices}, got {getattr(self, name)!r}")
    expected = {
      "int": (numbers.Integral, "an integer"),
      "float": (numbers.Real, "a number"),
      "bool": (bool, "True or False"),
    }
    for f in dataclasses.fields(self):  # a wrong type here, not deep inside a traced step
      kind, words = expected.get(str(f.type), (None, ""))
      value = getattr(self, f.name)
      if kind is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise ValueError(f"T5Config.{f.name} = {value!r}: expected {words}")
    for name in ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"T5Config.{name} must be positive, got {getattr(self, name)}")
    if not 0 <= self.dropout_rate < 1:
      raise ValueError(f"T5Config.dropout_rate = {self.dropout_rate!r}: expected a number in [0, 1)")

  def for_target(self) -> "T5Config":
    """This config with `dtype='auto'` resolved for the platform being compiled for (`kernels.target_device`,
    read at trace time: under a mesh, its devices'; so `remixer-t5 compile --topology v3-32` on a CPU host gets
    the TPU's): bfloat16 on TPUs and GPUs, whose matrix units take it at full rate (T5 and t5x train in it),
    float32 on CPUs, where XLA has no faster bfloat16 products and the exact-parity tests run."""
    if self.dtype != "auto":
      return self
    platform = kernels.target_device().platform
    return dataclasses.replace(self, dtype="bfloat16" if platform in ("tpu", "gpu") else "float32")


# Activation dtypes: 'auto' (bfloat16 on TPUs and GPUs, float32 on CPUs; the network resolves it where it is
# traced: `T5Config.for_target`, network.Transformer) or one named. A mixer built on its own takes a named one.
ACTIVATION_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Implementations: remixer_t5/kernels/__init__.py's operations say what each computes and which `auto` picks.
ATTENTION_IMPLS = kernels.choices("network.T5Config.attention_impl")
DROPOUT_IMPLS = kernels.choices("network.T5Config.dropout_impl")

# Layer layouts, as the HyperMixer paper's App. F writes them (TM = token mixing, FM = feature mixing, N = the
# stack's norm; decoder layers chain their self and cross slots as token-mixing slots):
#   'pre_norm' (Wang et al. 2019; T5):       x1 = x + TM(N(x));   out = x1 + FM(N(x1))
#   'post_norm' (Vaswani et al. 2017):       x1 = N(x + TM(x));   out = N(x1 + FM(x1))
#   'serialized' (Chowdhery et al. 2022's "standard serialized"; every HyperMixer experiment, App. F and Fig. 1):
#                                            x1 = x + TM(N(x));   out = x + FM(N(x1))
LAYER_LAYOUTS = ("pre_norm", "post_norm", "serialized")

# What each layer saves for the backward pass (the rest is recomputed); names as in MaxText's `remat_policy`.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
  "none": None,  # no rematerialisation: every intermediate is kept
  "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's inputs
  "dots": jax.checkpoint_policies.checkpoint_dots,  # keep every matmul output
  # keep the weight matmuls, recompute those with batch dimensions (attention scores and their mixing)
  "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
