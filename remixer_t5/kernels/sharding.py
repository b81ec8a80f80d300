"""A custom-call kernel run on each device's own batch rows under a mesh.

XLA does not partition a custom call (a Pallas kernel): traced under a mesh whose rules shard the batch
(`partitioning.activation_sharding`), the kernel would run on the whole gathered batch on every device. `per_batch_shard`
runs it under `shard_map` on each device's rows instead. Other dimensions are gathered (a 'model' axis sharding d'
or the heads is undone here). Inputs shared by the whole batch (attention's [1, h, q, k] position bias) are tiled
once per shard outside the map, so each shard reads its own copy and autodiff sums the shards' gradients.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn


def per_batch_shard(fn: Callable, shared: tuple[int, ...] = ()) -> Callable:
  """`fn(*args)` with every array argument split over the batch shards (leading axis), except the positions in
  `shared`: leading axis 1, the same for every row. None arguments pass through. Without a mesh, with the batch
  unsharded, or with a batch the shards do not divide, `fn` itself."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn
  rules = nn.get_logical_axis_rules()
  axes = nn.logical_to_mesh_axes(("batch",), rules)[0] if rules else None
  if axes is None:
    return fn
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  shards = math.prod(dict(mesh.shape)[a] for a in axes)

  def each_shard(*args):
    if shards == 1 or args[0].shape[0] % shards:
      return fn(*args)
    spec = jax.sharding.PartitionSpec(axes)
    present = [i for i, a in enumerate(args) if a is not None]
    arrays = [jnp.broadcast_to(args[i], (shards,) + args[i].shape[1:]) if i in shared else args[i] for i in present]
    if jax.sharding.AxisType.Explicit in mesh.axis_types:  # (partitioning's meshes are Auto)
      arrays = [jax.sharding.reshard(a, spec) for a in arrays]

    def body(*local):
      full = list(args)
      for i, a in zip(present, local):
        full[i] = a
      return fn(*full)

    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec, check_vma=False)(*arrays)

  return each_shard
