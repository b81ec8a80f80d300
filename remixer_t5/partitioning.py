"""Device mesh, logical-axis rules and shardings: the only place that knows about mesh axes.

Parameters and activations carry logical names (layers.py); `DEFAULT_RULES` maps them onto a ('data', 'model')
mesh as t5x's standard rules do: batch over data, heads/mlp/vocab over model.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
import optax
from flax import linen as nn
from flax.core import meta
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
    ("relpos_buckets", None),
    ("length", None),
    ("mix_length", None),   # fixed-length position axes of token-mixing weights (MLP-Mixer, Remixer's H)
    ("mix_source", None),   # the source-position axis of an L x L mixing matrix (H, gMLP's W)
    ("mix_hidden", None),   # hidden width of token-mixing MLPs (HyperMixer, MLP-Mixer)
    ("projection", None),   # pNLP-Mixer projection features
)


def make_mesh(num_partitions: int = 1, shape: Sequence[int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'model') mesh: `shape` explicitly, or all devices with `num_partitions` along 'model'."""
  devices = list(devices) if devices is not None else jax.devices()
  if shape is None:
    if len(devices) % num_partitions:
      raise ValueError(f"num_partitions={num_partitions} does not divide the {len(devices)} devices")
    shape = (len(devices) // num_partitions, num_partitions)
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f"mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices, have {len(devices)}")
  return Mesh(mesh_utils.create_device_mesh(tuple(shape), devices), ("data", "model"))


def param_shardings(params_axes, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedSharding per parameter from the `params_axes` collection that `param_with_axes` records."""
  axes = jax.tree_util.tree_map(lambda a: P(*a.names), meta.unbox(params_axes),
                                is_leaf=lambda x: isinstance(x, nn.partitioning.AxisMetadata))
  axes = _strip_axes_suffix(axes)
  return jax.tree_util.tree_map(lambda spec: nn.logical_to_mesh_sharding(spec, mesh, rules), axes,
                                is_leaf=lambda x: isinstance(x, P))


def _strip_axes_suffix(tree):
  """`params_axes` names leaves '<param>_axes'; rename them to the parameter names."""
  if not isinstance(tree, dict):
    return tree
  return {(k[:-len("_axes")] if k.endswith("_axes") else k): _strip_axes_suffix(v) for k, v in tree.items()}


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_state, params, param_sh, mesh):
  """Optimizer-state leaves shaped like their parameter share its sharding; the rest are replicated.

  Adafactor's factored row/column statistics have reduced shapes and are replicated here (small).
  """
  replicated = NamedSharding(mesh, P())

  def per_param(leaf, sh, param):
    return sh if getattr(leaf, "shape", None) == param.shape else replicated

  return optax.tree_map_params(optimizer, per_param, abstract_state, param_sh, params,
                               transform_non_params=lambda _: replicated,
                               is_leaf=lambda x: isinstance(x, NamedSharding))


def data_sharding(mesh: Mesh) -> NamedSharding:
  """Batch-major arrays: split along 'data', replicated along 'model'."""
  return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
