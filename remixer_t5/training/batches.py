"""Batches between hosts and devices: each process's input iterator, global arrays from process-local rows, and
values fetched back to every host."""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils


def global_from_host(x: np.ndarray, sharding) -> jax.Array:
  """A global array from a host array that every process holds in full (identical on all processes)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(array: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) global array, on every process."""
  if array.is_fully_addressable:
    return np.asarray(jax.device_get(array))
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def global_batch(batch: Mapping[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def real_tokens(batch: Mapping[str, np.ndarray]) -> int:
  return int((batch["encoder_input_tokens"] > 0).sum() + (batch["decoder_target_tokens"] > 0).sum())
