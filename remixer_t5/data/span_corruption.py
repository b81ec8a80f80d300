"""T5's span-corruption pretraining objective, as seqio preprocessors (TF ops).

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer" (JMLR 21),
§3.1.4 "Unsupervised Objective" and §3.3 "Unsupervised Objectives" (§3.3.4 span corruption): 15% of the tokens are
dropped in contiguous spans of mean length 3; every dropped span is replaced in the inputs by a unique sentinel, and
the targets are the dropped spans, each preceded by its sentinel. Sentinels are the last ids of the vocabulary,
counting down: ``<extra_id_0> = vocab_size - 1``, ``<extra_id_1> = vocab_size - 2``, ...
(seqio.SentencePieceVocabulary's reversed ``extra_ids``).

Same semantics as ``t5.data.preprocessors.span_corruption``, written for this project (no dependency on the ``t5``
package). All randomness is stateless: seeds come from ``seqio.map_over_dataset(num_seeds=...)``, so a task's
``get_dataset(seed=...)`` is reproducible.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional

import seqio
import tensorflow as tf


def random_spans_helper(
  inputs_length: int = 512, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
  """Raw token count that span-corrupts to exactly ``inputs_length`` (T5, §3.3.4).

  Finds the largest ``tokens_length`` whose corrupted inputs (non-noise tokens + one sentinel per noise span + EOS)
  fit in ``inputs_length``; returns ``(tokens_length, targets_length)``, the targets length (noise tokens + one
  sentinel per span + EOS) included. ``random_spans_helper(512) == (568, 114)``."""

  def corrupted_lengths(tokens_length: int) -> tuple[int, int]:
    num_noise = int(round(tokens_length * noise_density))
    num_spans = int(round(num_noise / mean_noise_span_length))
    return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1

  tokens_length = inputs_length - 1
  while corrupted_lengths(tokens_length + 1)[0] <= inputs_length:
    tokens_length += 1
  corrupted_inputs_length, targets_length = corrupted_lengths(tokens_length)
  # As in T5: with noise_density 0.5 make targets no longer than the inputs, whose length is more likely round.
  if noise_density == 0.5 and targets_length > corrupted_inputs_length:
    tokens_length -= 1
    targets_length -= 1
  return tokens_length, targets_length


def _random_segmentation(num_items, num_segments, seed):
  """Random split of ``num_items`` items into ``num_segments`` non-empty runs: int32 run lengths summing to
  ``num_items``. Every composition is equally likely: ``num_segments - 1`` of the ``num_items - 1`` gaps between
  items, chosen by a stateless shuffle, start a new run."""
  starts_new_run = seqio.utils.stateless_shuffle(tf.cast(tf.range(num_items - 1) < num_segments - 1, tf.int32), seed)
  run_ids = tf.cumsum(tf.pad(starts_new_run, [[1, 0]]))
  return tf.math.segment_sum(tf.ones_like(run_ids), run_ids)


def random_spans_noise_mask(length, noise_density: float, seeds, mean_noise_span_length: float = 3.0) -> tf.Tensor:
  """Boolean noise mask of ``length`` made of random spans (T5, §3.3.4).

  * noise tokens: ``round(length * noise_density)`` clipped to ``[1, length - 1]``;
  * noise spans: ``round(num_noise / mean_noise_span_length)``, at least 1, and as many non-noise spans;
  * span lengths are random segmentations of the noise and non-noise counts; spans alternate, starting with
    non-noise (so the mask ends with noise).

  ``seeds`` is an int32 tensor shaped [2, 2] (two stateless seeds). Lengths below 2 are handled as length 2 and
  truncated, as in T5."""
  if noise_density == 0.0:
    return tf.zeros([length], tf.bool)
  orig_length = length
  length = tf.maximum(length, 2)
  num_noise = tf.cast(tf.round(tf.cast(length, tf.float32) * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float32) / mean_noise_span_length), tf.int32)
  num_spans = tf.maximum(num_spans, 1)

  noise_lengths = _random_segmentation(num_noise, num_spans, seeds[0])
  nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, seeds[1])
  # [nonnoise_0, noise_0, nonnoise_1, noise_1, ...]
  span_lengths = tf.reshape(tf.stack([nonnoise_lengths, noise_lengths], axis=1), [-1])
  span_is_noise = tf.tile(tf.constant([False, True]), [num_spans])
  return tf.repeat(span_is_noise, span_lengths)[:orig_length]


def noise_span_to_unique_sentinel(tokens, noise_mask, vocabulary, seeds=None) -> tf.Tensor:
  """Replaces each noise span by one sentinel: vocab_size - 1, vocab_size - 2, ... Example (S0 = vocab_size - 1):
  tokens ``a b c d e``, noise ``c d`` -> ``a b S0 e``."""
  del seeds  # deterministic
  prev_is_noise = tf.pad(noise_mask[:-1], [[1, 0]])
  span_start = tf.logical_and(noise_mask, tf.logical_not(prev_is_noise))
  span_rest = tf.logical_and(noise_mask, prev_is_noise)
  sentinels = vocabulary.vocab_size - tf.cumsum(tf.cast(span_start, tokens.dtype))
  tokens = tf.where(span_start, sentinels, tokens)
  return tf.boolean_mask(tokens, tf.logical_not(span_rest))


def nonnoise_span_to_unique_sentinel(tokens, noise_mask, vocabulary, seeds=None) -> tf.Tensor:
  """The targets side: each non-noise span becomes a sentinel, noise is kept. With spans starting with non-noise,
  the targets read ``S0 <noise span 0> S1 <noise span 1> ...``, the same sentinels in the same order as the inputs."""
  return noise_span_to_unique_sentinel(tokens, tf.logical_not(noise_mask), vocabulary, seeds)


def select_random_chunk(dataset: tf.data.Dataset, max_length: int, feature_key: str = "targets") -> tf.data.Dataset:
  """Keeps one random chunk of at most ``max_length`` tokens of each example. Like T5: the document is cut into
  consecutive chunks of ``max_length`` (the last may be shorter) and one is chosen uniformly; empty examples are
  dropped; only ``feature_key`` is kept."""

  @seqio.map_over_dataset(num_seeds=1)
  def chunk(x, seed):
    tokens = x[feature_key]
    num_chunks = (tf.size(tokens) + max_length - 1) // max_length
    start = max_length * tf.random.stateless_uniform([], maxval=num_chunks, dtype=tf.int32, seed=seed)
    return {feature_key: tokens[start : start + max_length]}

  dataset = dataset.filter(lambda x: tf.size(x[feature_key]) > 0)
  return chunk(dataset)


def reduce_concat_tokens(
  dataset: tf.data.Dataset, feature_key: str = "targets", batch_size: int = 128
) -> tf.data.Dataset:
  """Concatenates ``batch_size`` consecutive documents into one token sequence. Used before ``split_tokens`` so
  that examples come out at exactly the wanted length, without padding. Relies on pad id 0 never being a token."""
  dataset = dataset.map(lambda x: {feature_key: x[feature_key]}, num_parallel_calls=tf.data.AUTOTUNE)
  dataset = dataset.padded_batch(batch_size, padded_shapes={feature_key: [-1]})

  def concat(x):
    tokens = tf.reshape(x[feature_key], [-1])
    return {feature_key: tf.boolean_mask(tokens, tokens != 0)}

  return dataset.map(concat, num_parallel_calls=tf.data.AUTOTUNE)


def split_tokens(
  dataset: tf.data.Dataset, max_tokens_per_segment: int, feature_key: str = "targets"
) -> tf.data.Dataset:
  """Splits each example into segments of ``max_tokens_per_segment`` tokens. Only the last segment of an example
  may be shorter; empty examples are dropped; only ``feature_key`` is kept."""
  length = int(max_tokens_per_segment)
  if length < 1:
    raise ValueError(f"max_tokens_per_segment must be positive, got {length}")

  def segments(x):
    tokens = x[feature_key]
    num_segments = (tf.size(tokens) + length - 1) // length
    return tf.data.Dataset.range(tf.cast(num_segments, tf.int64)).map(
      lambda i: {feature_key: tokens[tf.cast(i, tf.int32) * length : (tf.cast(i, tf.int32) + 1) * length]}
    )

  dataset = dataset.filter(lambda x: tf.size(x[feature_key]) > 0)
  return dataset.flat_map(segments)


def denoise(
  dataset: tf.data.Dataset,
  output_features,
  noise_density: float,
  noise_mask_fn: Callable,
  inputs_fn: Callable,
  targets_fn: Optional[Callable] = None,
) -> tf.data.Dataset:
  """Turns ``{"targets": tokens}`` into a noised ``inputs`` and its ``targets``.

  The generic denoising objective of T5 §3.3: ``noise_mask_fn(length, noise_density, seeds)`` picks the corrupted
  tokens, ``inputs_fn`` / ``targets_fn(tokens, noise_mask, vocabulary, seeds)`` build the two sides
  (``targets_fn=None`` keeps the original tokens as targets)."""
  vocabulary = output_features["targets"].vocabulary
  if "inputs" in output_features and output_features["inputs"].vocabulary != vocabulary:
    raise ValueError(
      "denoise builds inputs from the tokenized targets, so inputs and targets must share one vocabulary."
    )

  @seqio.map_over_dataset(num_seeds=1)
  def noise(x, seed):
    seeds = tf.random.experimental.stateless_split(seed, 6)
    tokens = x["targets"]
    mask = noise_mask_fn(tf.size(tokens), noise_density, seeds=seeds[0:2])
    inputs = inputs_fn(tokens, mask, vocabulary, seeds=seeds[2:4])
    targets = tokens if targets_fn is None else targets_fn(tokens, mask, vocabulary, seeds=seeds[4:6])
    return {"inputs": inputs, "targets": targets}

  return noise(dataset)


def span_corruption(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features,
  mean_noise_span_length: float = 3.0,
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """T5's final pretraining objective (Raffel et al. 2020, §3.3.4 and §3.7).

  Pipeline, as ``t5.data.preprocessors.span_corruption``: random chunk of at most 65536 tokens per document ->
  concatenate documents in groups of 128 -> split into ``random_spans_helper(inputs_length)[0]`` raw tokens ->
  denoise with ``random_spans_noise_mask`` and unique sentinels. Follow it with
  ``seqio.preprocessors.append_eos_after_trim``: full-length examples then have exactly
  ``sequence_length["inputs"]`` inputs and the helper's targets length (e.g. 512 and 114), EOS included."""
  if not sequence_length or "inputs" not in sequence_length or "targets" not in sequence_length:
    raise ValueError(
      f"span_corruption needs sequence_length with 'inputs' and 'targets' lengths, got {sequence_length!r}."
    )
  inputs_length = sequence_length["inputs"]
  tokens_length, targets_length = random_spans_helper(inputs_length, noise_density, mean_noise_span_length)
  if sequence_length["targets"] < targets_length:
    raise ValueError(
      f"Span corruption of {inputs_length} inputs needs targets length {targets_length}, "
      f"but sequence_length['targets'] is {sequence_length['targets']}."
    )

  ds = select_random_chunk(dataset, max_length=65536)
  ds = reduce_concat_tokens(ds, batch_size=128)
  ds = split_tokens(ds, max_tokens_per_segment=tokens_length)
  return denoise(
    ds,
    output_features,
    noise_density=noise_density,
    noise_mask_fn=functools.partial(random_spans_noise_mask, mean_noise_span_length=mean_noise_span_length),
    inputs_fn=noise_span_to_unique_sentinel,
    targets_fn=nonnoise_span_to_unique_sentinel,
  )
