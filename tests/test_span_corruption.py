"""T5 span corruption (remixer_t5.data.span_corruption) on synthetic token ids."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from remixer_t5.data import span_corruption as sc

VOCAB_SIZE = 1000
NUM_SENTINELS = 100
VOCAB = seqio.PassThroughVocabulary(VOCAB_SIZE, eos_id=1)
FEATURES = {
  "inputs": seqio.Feature(VOCAB, add_eos=True, required=False),
  "targets": seqio.Feature(VOCAB, add_eos=True),
}


def _corrupted_lengths(tokens_length, density=0.15, mean_span=3.0):
  noise = int(round(tokens_length * density))
  spans = int(round(noise / mean_span))
  return tokens_length - noise + spans + 1, noise + spans + 1


def test_random_spans_helper_matches_t5():
  assert sc.random_spans_helper(512) == (568, 114)
  assert sc.random_spans_helper(inputs_length=512, noise_density=0.15, mean_noise_span_length=3.0) == (568, 114)


@pytest.mark.parametrize("inputs_length", [32, 64, 128, 256, 626, 1024])
def test_random_spans_helper_is_the_longest_fit(inputs_length):
  tokens_length, targets_length = sc.random_spans_helper(inputs_length)
  inputs_used, expected_targets = _corrupted_lengths(tokens_length)
  assert inputs_used <= inputs_length < _corrupted_lengths(tokens_length + 1)[0]
  assert targets_length == expected_targets


def _mask(length, seed, density=0.15, mean_span=3.0):
  seeds = tf.constant([[seed, 1], [seed, 2]], tf.int32)
  return sc.random_spans_noise_mask(length, density, seeds, mean_noise_span_length=mean_span).numpy()


def _runs(mask):
  """[(is_noise, length), ...] of the mask's runs."""
  edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
  return [(bool(run[0]), len(run)) for run in np.split(mask, edges)]


def test_noise_mask_counts_and_span_statistics():
  length = 568
  num_noise = round(length * 0.15)  # 85
  num_spans = round(num_noise / 3.0)  # 28
  span_lengths, first_noise = [], set()
  for seed in range(100):
    mask = _mask(length, seed)
    assert mask.shape == (length,) and mask.dtype == bool
    assert mask.sum() == num_noise
    runs = _runs(mask)
    # Alternating spans, starting with non-noise and ending with noise.
    assert runs[0][0] is False and runs[-1][0] is True
    assert sum(is_noise for is_noise, _ in runs) == num_spans
    assert len(runs) == 2 * num_spans
    span_lengths += [n for is_noise, n in runs if is_noise]
    first_noise.add(int(np.argmax(mask)))
  assert abs(np.mean(span_lengths) - 3.0) < 0.1
  assert min(span_lengths) == 1 and max(span_lengths) >= 8  # random, not fixed-size spans
  assert len(first_noise) > 20  # the segmentation varies with the seed


def test_noise_mask_fraction_over_lengths_and_determinism():
  fractions = [_mask(n, seed).mean() for seed in range(10) for n in (100, 333, 1000)]
  assert abs(np.mean(fractions) - 0.15) < 0.01
  np.testing.assert_array_equal(_mask(200, 7), _mask(200, 7))
  assert not np.array_equal(_mask(200, 7), _mask(200, 8))


@pytest.mark.parametrize("length", [1, 2, 3, 10])
def test_noise_mask_short_sequences_are_not_degenerate(length):
  mask = _mask(length, 3)
  assert mask.shape == (length,)
  if length >= 2:
    assert 1 <= mask.sum() <= length - 1
  assert not mask[0]


def test_unique_sentinels_count_down_from_the_top_of_the_vocabulary():
  tokens = tf.constant([10, 11, 12, 13, 14, 15, 16, 17], tf.int32)
  noise = tf.constant([0, 1, 1, 0, 0, 1, 0, 1]) > 0
  s0, s1, s2 = VOCAB_SIZE - 1, VOCAB_SIZE - 2, VOCAB_SIZE - 3
  inputs = sc.noise_span_to_unique_sentinel(tokens, noise, VOCAB, seeds=None)
  targets = sc.nonnoise_span_to_unique_sentinel(tokens, noise, VOCAB, seeds=None)
  assert inputs.numpy().tolist() == [10, s0, 13, 14, s1, 16, s2]
  # Non-noise spans become sentinels in the targets (here the mask starts with non-noise).
  assert targets.numpy().tolist() == [s0, 11, 12, s1, 15, s2, 17]


def _documents(lengths, seed=0):
  rng = np.random.RandomState(seed)
  # Ids 3.. below the sentinels; 0 (pad) must never be a token.
  return [rng.randint(3, VOCAB_SIZE - NUM_SENTINELS, size=n).astype(np.int32) for n in lengths]


def _corrupt(docs, sequence_length, seed=42):
  ds = tf.data.Dataset.from_generator(
    lambda: ({"targets": d} for d in docs), output_signature={"targets": tf.TensorSpec([None], tf.int32)}
  )
  with seqio.utils.map_seed_manager(seed):
    ds = sc.span_corruption(ds, sequence_length, FEATURES)
    ds = seqio.preprocessors.append_eos_after_trim(ds, output_features=FEATURES, sequence_length=sequence_length)
  return list(ds.as_numpy_iterator())


def _is_sentinel(t):
  return t >= VOCAB_SIZE - NUM_SENTINELS


def _reconstruct(inputs, targets):
  """Puts the target spans back in place of the input sentinels (EOS stripped)."""
  assert inputs[-1] == 1 and targets[-1] == 1
  inputs, targets = inputs[:-1].tolist(), targets[:-1].tolist()
  spans, current = {}, None
  for t in targets:
    if _is_sentinel(t):
      current = spans.setdefault(t, [])
    else:
      current.append(t)
  out = []
  for t in inputs:
    out.extend(spans.pop(t) if _is_sentinel(t) else [t])
  assert not spans, "every target span must have its sentinel in the inputs"
  return out


def test_568_tokens_give_exactly_512_inputs_and_114_targets_and_reconstruct():
  (doc,) = _documents([568])
  (ex,) = _corrupt([doc], {"inputs": 512, "targets": 114})
  assert ex["inputs"].dtype == np.int32 and ex["targets"].dtype == np.int32
  assert len(ex["inputs"]) == 512 and len(ex["targets"]) == 114
  assert _reconstruct(ex["inputs"], ex["targets"]) == doc.tolist()

  in_sentinels = [t for t in ex["inputs"] if _is_sentinel(t)]
  tgt_sentinels = [t for t in ex["targets"] if _is_sentinel(t)]
  assert in_sentinels == list(range(VOCAB_SIZE - 1, VOCAB_SIZE - 1 - 28, -1))
  assert tgt_sentinels == in_sentinels
  assert ex["targets"][0] == VOCAB_SIZE - 1  # targets open with <extra_id_0>


def test_full_pipeline_concatenates_splits_and_reconstructs_every_document():
  docs = _documents([300, 1200, 50, 568, 2000, 7])
  examples = _corrupt(docs, {"inputs": 512, "targets": 114})
  assert len(examples) == -(-sum(map(len, docs)) // 568)
  for ex in examples[:-1]:  # all but the remainder are full length
    assert (len(ex["inputs"]), len(ex["targets"])) == (512, 114)
  assert len(examples[-1]["inputs"]) < 512
  rebuilt = sum((_reconstruct(ex["inputs"], ex["targets"]) for ex in examples), [])
  assert rebuilt == np.concatenate(docs).tolist()


def test_span_corruption_is_seeded():
  docs = _documents([1500])
  a, b, c = (_corrupt(docs, {"inputs": 128, "targets": 64}, seed=s) for s in (1, 1, 2))
  assert [e["inputs"].tolist() for e in a] == [e["inputs"].tolist() for e in b]
  assert [e["inputs"].tolist() for e in a] != [e["inputs"].tolist() for e in c]


def test_span_corruption_rejects_too_short_targets():
  with pytest.raises(ValueError, match="targets length 114"):
    _corrupt(_documents([600]), {"inputs": 512, "targets": 100})


def test_split_tokens_and_reduce_concat():
  ds = tf.data.Dataset.from_generator(
    lambda: ({"targets": d} for d in _documents([1000, 0, 5])),
    output_signature={"targets": tf.TensorSpec([None], tf.int32)},
  )
  lengths = [len(x["targets"]) for x in sc.split_tokens(ds, 300).as_numpy_iterator()]
  assert lengths == [300, 300, 300, 100, 5]
  merged = list(sc.reduce_concat_tokens(ds, batch_size=2).as_numpy_iterator())
  assert [len(x["targets"]) for x in merged] == [1000, 5]
  assert 0 not in merged[0]["targets"]
