"""Fixed-length token mixers: their length L follows the run, and checkpoints trained at another L are fitted.

Remixer's H, gMLP's spatial W (full or Toeplitz) with its bias b, and MLP-Mixer's encoder token-mixing MLP hold
one weight (or row, or column) per position up to a maximum length L. Two things follow:

1. **One source of truth for L.** The model configs bind each such mixer's `max_length` to the run's
   `TASK_FEATURE_LENGTHS` (`inputs` for the encoder, `targets` for the decoder) through `feature_length`:

       encoder/remixer.RemixerBlock.max_length = @inputs/fixed_length.feature_length()
       fixed_length.feature_length.lengths = %TASK_FEATURE_LENGTHS
       inputs/fixed_length.feature_length.feature = 'inputs'

   The model file also sets a default `TASK_FEATURE_LENGTHS` (pretraining's 512/114; the tiny configs'
   128/64) so that it works alone (`remixer-t5 info`, `models.from_gin`); a run file loaded AFTER it (or a
   `--gin.TASK_FEATURE_LENGTHS=...` flag) overrides the macro, and gin reads macros when the mixer is built, so
   the last binding wins. (Loading the run file first would let the model's default win; the mixers then refuse
   the run's longer sequences with an error naming both lengths.)

2. **Finetuning from a checkpoint trained at another L** (`fit_params`, called where INIT_CHECKPOINT is
   loaded). A leaf whose shape differs between the checkpoint and the model is fitted only along axes whose
   logical name is a position axis (`LENGTH_AXES`: 'mix_length', 'mix_source'); any other difference is
   refused with an error naming the parameter and both shapes. Along a position axis, index p means position p
   (or offset p for gMLP's Toeplitz weights), so the rule for every such parameter is the same:

   - Remixer `remix`, H [L, L] ('mix_length', 'mix_source'): grown, H'[:L, :L] = H and the new rows and
     columns as the model initialises them (N(0, remix_init_stddev²)); shrunk, H' = H[:L', :L'].
   - gMLP `spatial_kernel`, W [L, L], and `spatial_bias`, b [L]: the leading block is kept; new entries start
     near zero (W) and at 1 (b), the block's own start (§2.1).
   - gMLP Toeplitz `spatial_past` [L] and `spatial_future` [L-1] ('mix_length'): offsets below min(L, L') kept,
     new offsets near zero.
   - MLP-Mixer `w1` [L, hidden], `w2` [hidden, L], `b2` [L]: the rows/columns of positions below min(L, L')
     kept, new ones as initialised.

   Every sequence of at most min(L, L') tokens gives exactly the pretrained outputs: each of these mixers reads
   only W[:n, :n] (or offsets < n, or the first n rows) for a sequence of n tokens, and masks or zeroes the
   rest, so the old rows are unchanged. Longer sequences meet the new entries: causal rows i < L never see
   them (a decoder row reads j <= i), bidirectional rows do (e.g. Remixer's softmax over a row then also
   weighs the new columns, which start at its initial logits). Shrinking is exact for every sequence the new
   length admits.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

LENGTH_AXES = ("mix_length", "mix_source")


def feature_length(lengths: Mapping[str, int] | None = None, feature: str | None = None) -> int:
  """`lengths[feature]`: a fixed-length mixer's L from TASK_FEATURE_LENGTHS (see the module docstring)."""
  if lengths is None or feature is None:
    raise ValueError("fixed_length.feature_length needs `lengths` (bind it to %TASK_FEATURE_LENGTHS) and "
                     f"`feature` ('inputs' or 'targets'); got lengths={lengths!r}, feature={feature!r}")
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
      raise ValueError(f"cannot fit a parameter sharded across processes (shape {x.shape}); the position "
                       "axes of fixed-length mixers are replicated by the mesh rules")
    return np.asarray(shard)
  return np.asarray(x)


def fit_leaf(name: str, old: np.ndarray, fresh: np.ndarray, axes: tuple[str | None, ...] | None
             ) -> np.ndarray:
  """`old` copied into the leading block of `fresh` (the model's own initialisation), along position axes only."""
  old, fresh = np.asarray(old), np.asarray(fresh)
  if old.ndim != fresh.ndim:
    raise ValueError(f"INIT_CHECKPOINT parameter {name} has shape {old.shape}, the model {fresh.shape}: "
                     "different ranks cannot be fitted")
  axes = tuple(axes or (None,) * fresh.ndim)
  for i, (a, b) in enumerate(zip(old.shape, fresh.shape)):
    if a != b and axes[i] not in LENGTH_AXES:
      raise ValueError(
          f"INIT_CHECKPOINT parameter {name} has shape {old.shape}, the model {fresh.shape}: axis {i} "
          f"({axes[i] or 'unnamed'}) differs and is not a position axis of a fixed-length mixer "
          f"({' or '.join(LENGTH_AXES)}), so it cannot be resized; the checkpoint is of another model size")
  out = fresh.astype(old.dtype, copy=True)
  common = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, fresh.shape))
  out[common] = old[common]
  return out


def fit_params(params: Any, fresh: Any, logical_axes: Any) -> tuple[Any, list[str]]:
  """The checkpoint's `params` fitted to the model whose freshly initialised params are `fresh`.

  `logical_axes`: a params-shaped tree of PartitionSpec-like logical names (`partitioning.logical_axes`).
  Leaves of equal shape are returned as they are; others go through `fit_leaf`. Returns the fitted tree and
  one line per resized parameter ('path: old shape -> new shape'). Missing or extra parameters are left to the
  caller's structure check.
  """
  flat_axes = {jax.tree_util.keystr(k): tuple(v) for k, v in
               jax.tree_util.tree_leaves_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))}
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
