"""The trainer's input: batches of a seqio task or mixture, whose position is checkpointed in constant time.

``get_batches`` builds the pipeline (seqio's preprocessing, the feature converter's packing, per-process batching,
prefetch) and returns ``Batches``, an iterator of numpy batches that counts its position and can ``save`` / ``restore``
the whole state of its ``tf.data`` iterator with ``tf.train.Checkpoint`` (source offsets, shuffle buffers and their RNG
state, packing and span-corruption buffers, the prefetched batches). Restoring costs the same at step 500,000 as at step
1; the time of ``Dataset.skip(n)``, the fallback for pipelines that cannot be checkpointed (a ``from_generator`` source)
and for checkpoints of older runs, grows with n. Where the files live and when they are written:
remixer_t5/training/checkpoints.py (``*_input_state``); the choice of route: docs/architecture.md, "Input position".
"""

from __future__ import annotations

import time
from typing import Mapping

import jax
import numpy as np
import seqio
import tensorflow as tf


class InputNotCheckpointableError(RuntimeError):
  """The pipeline holds state tf.data cannot save (e.g. a Python generator source)."""


class Batches:
  """Iterator of numpy batches of ``dataset``; ``position`` counts the batches consumed.

  ``save(prefix)`` writes the iterator's state (a TF checkpoint at ``prefix``); ``restore(prefix)`` puts a
  freshly built iterator of the same pipeline back at that state, so the next batch is the one that followed."""

  def __init__(self, dataset, position: int = 0):
    self.dataset = dataset
    self.position = position
    self._iterator = iter(dataset)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    self.position += 1
    return {k: v.numpy() for k, v in batch.items()}

  def save(self, prefix: str) -> str:
    """Writes the iterator state to ``prefix`` (.index + .data files); InputNotCheckpointableError if the
    pipeline cannot be saved, naming the reason."""
    try:
      return tf.train.Checkpoint(iterator=self._iterator).write(prefix)
    except tf.errors.FailedPreconditionError as e:
      reason = str(e).split("}}")[-1].split("[Op:")[0].strip()
      raise InputNotCheckpointableError(
        f"the input pipeline cannot be checkpointed ({reason}): a source built on a Python generator or "
        f"a stateful map; its position is saved as a batch count and replayed with skip on resume"
      ) from None

  def restore(self, prefix: str, position: int) -> float:
    """Restores the state saved at ``prefix`` (``position`` batches consumed); returns the seconds taken."""
    t0 = time.perf_counter()
    tf.train.Checkpoint(iterator=self._iterator).read(prefix).assert_consumed()
    self.position = position
    return time.perf_counter() - t0


def get_batches(
  task,
  feature_lengths: Mapping[str, int],
  split: str,
  batch_size: int,
  *,
  seed: int,
  shuffle: bool,
  repeat: bool,
  pack: bool,
  skip_batches: int = 0,
  process_index: int | None = None,
  process_count: int | None = None,
) -> Batches:
  """Batches in the model's feature format (t5x's EncDecFeatureConverter), this process's shard.

  Each process reads its own shard (``process_index`` of ``process_count``, default JAX's); ``batch_size``
  is the global batch. ``skip_batches``: start there by replaying (``Dataset.skip``, time grows with it);
  ``Batches.restore`` jumps there in constant time instead."""
  num_procs = jax.process_count() if process_count is None else process_count
  index = jax.process_index() if process_index is None else process_index
  if batch_size % num_procs:
    raise ValueError(f"BATCH_SIZE={batch_size} must be divisible by the {num_procs} processes")
  shard = seqio.ShardInfo(index=index, num_shards=num_procs)
  ds = seqio.get_dataset(
    task,
    task_feature_lengths=dict(feature_lengths),
    dataset_split=split,
    shuffle=shuffle,
    num_epochs=None if repeat else 1,
    seed=seed,
    shard_info=shard,
    use_cached=False,
    feature_converter=seqio.EncDecFeatureConverter(pack=pack),
  )
  ds = ds.batch(batch_size // num_procs, drop_remainder=True)
  if skip_batches:
    ds = ds.skip(skip_batches)  # deterministic pipeline: skipping reproduces the position
  return Batches(ds.prefetch(2), position=skip_batches)
