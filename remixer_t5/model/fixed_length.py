"""Fixed-length token mixers: their length L follows the run, and checkpoints trained at another L are fitted.

Remixer's H, gMLP's spatial W (full or Toeplitz) with its bias b, and MLP-Mixer's encoder token-mixing MLP hold
one weight (or row, or column) per position up to a maximum length L (docs/architectures.md, "Sequence lengths
of the fixed-length mixers", says how a run sets and changes it):

1. The model configs bind each such mixer's `max_length` to the run's `TASK_FEATURE_LENGTHS` (`inputs` for the
   encoder, `targets` for the decoder) through `feature_length`:

       encoder/remixer.RemixerBlock.max_length = @inputs/fixed_length.feature_length()
       fixed_length.feature_length.lengths = %TASK_FEATURE_LENGTHS
       inputs/fixed_length.feature_length.feature = 'inputs'

2. `fit_params` (where INIT_CHECKPOINT is loaded) fits a checkpoint trained at another L. A leaf whose shape
   differs is fitted only along axes whose logical name is a position axis (`LENGTH_AXES`); any other
   difference is refused with an error naming the parameter and both shapes. Index p of a position axis means
   position p (or offset p for gMLP's Toeplitz weights), so every such parameter keeps its leading block
   (positions or offsets below min(L, L')) and takes the model's own initialisation for the rest. Each of these
   mixers reads only W[:n, :n] (or offsets < n, or the first n rows) for n tokens, so every sequence of at most
   min(L, L') tokens gives exactly the pretrained outputs; shrinking is exact for every sequence it admits.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

LENGTH_AXES = ("mix_length", "mix_source")


def feature_length(lengths: Mapping[str, int] | None = None, feature: str | None = None) -> int:
  """`lengths[feature]`: a fixed-length mixer's L from TASK_FEATURE_LENGTHS (see the module docstring)."""
  if lengths is None or feature is None:
    raise ValueError(
      "fixed_length.feature_length needs `lengths` (bind it to %TASK_FEATURE_LENGTHS) and "
      f"`feature` ('inputs' or 'targets'); got lengths={lengths!r}, feature={feature!r}"
    )
  if not isinstance(lengths, Mapping) or feature not in lengths:
    raise ValueError(f"TASK_FEATURE_LENGTHS must map {feature!r} to a length, got {lengths!r}")
  value = lengths[feature]
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"TASK_FEATURE_LENGTHS[{feature!r}] must be a positive int, got {value!r}")
  return int(value)


def _host(x) -> np.ndarray:
  """A leaf on the host: whole arrays as they are; a replicated global array from this process's copy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    shard = x.addressable_data(0)
    if tuple(shard.shape) != tuple(x.shape):
      raise ValueError(
        f"cannot fit a parameter sharded across processes (shape {x.shape}); the position "
        "axes of fixed-length mixers are replicated by the mesh rules"
      )
    return np.asarray(shard)
  return np.asarray(x)


def fit_leaf(name: str, old: np.ndarray, fresh: np.ndarray, axes: tuple[str | None, ...] | None) -> np.ndarray:
  """`old` copied into the leading block of `fresh` (the model's own initialisation), along position axes only."""
  old, fresh = np.asarray(old), np.asarray(fresh)
  if old.ndim != fresh.ndim:
    raise ValueError(
      f"INIT_CHECKPOINT parameter {name} has shape {old.shape}, the model {fresh.shape}: "
      "different ranks cannot be fitted"
    )
  axes = tuple(axes or (None,) * fresh.ndim)
  for i, (a, b) in enumerate(zip(old.shape, fresh.shape)):
    if a != b and axes[i] not in LENGTH_AXES:
      raise ValueError(
        f"INIT_CHECKPOINT parameter {name} has shape {old.shape}, the model {fresh.shape}: axis {i} "
        f"({axes[i] or 'unnamed'}) differs and is not a position axis of a fixed-length mixer "
        f"({' or '.join(LENGTH_AXES)}), so it cannot be resized; the checkpoint is of another model size"
      )
  out = fresh.astype(old.dtype, copy=True)
  common = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, fresh.shape))
  out[common] = old[common]
  return out


def fit_params(params: Any, fresh: Any, logical_axes: Any) -> tuple[Any, list[str]]:
  """The checkpoint's `params` fitted to the model whose freshly initialised params are `fresh`.

  `logical_axes`: a params-shaped tree of PartitionSpec-like logical names (`partitioning.logical_axes`). Leaves of
  equal shape are returned as they are; others go through `fit_leaf`. Returns the fitted tree and one line per resized
  parameter ('path: old shape -> new shape'). Missing or extra parameters are left to the caller's structure check."""
  flat_axes = {
    jax.tree_util.keystr(k): tuple(v)
    for k, v in jax.tree_util.tree_leaves_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))
  }
  flat_fresh = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(fresh)}
  resized: list[str] = []

  def fit(path, old):
    key = jax.tree_util.keystr(path)
    new = flat_fresh.get(key)
    if new is None or tuple(old.shape) == tuple(new.shape):
      return old
    out = fit_leaf(key, _host(old), _host(new), flat_axes.get(key))
    resized.append(f"{key}: {tuple(old.shape)} -> {tuple(out.shape)}")
    return out

  return jax.tree_util.tree_map_with_path(fit, params), resized
