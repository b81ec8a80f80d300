"""Greedy and beam search against naive references (full forward per prefix; brute-force enumeration)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.model import decoding, models, network

TINY = network.T5Config(
  vocab_size=24, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=24, num_encoder_layers=1, num_decoder_layers=2
)


def _toy_step(table):
  """A step function whose next-token logits depend on the whole prefix (kept in the cache)."""
  vocab = table.shape[-1]

  def step(tokens, cache):
    hist, i = cache["hist"], cache["i"]
    hist = jax.lax.dynamic_update_index_in_dim(hist, tokens[:, 0], i, 1)
    # Hash of the prefix so far picks a row of the table.
    weights = jnp.arange(1, hist.shape[1] + 1)
    row = jnp.sum(hist * weights * (jnp.arange(hist.shape[1]) <= i), axis=1) % table.shape[0]
    return table[row], {"hist": hist, "i": i + 1}

  return step, vocab


def _sequence_logp(step, cache, seq, eos_id):
  """Log-probability of a sequence under `step`, stopping at EOS; its length including EOS."""
  total, prev = 0.0, jnp.zeros((1, 1), jnp.int32)
  for t, tok in enumerate(seq):
    logits, cache = step(prev, cache)
    total += float(jax.nn.log_softmax(logits[0])[tok])
    if tok == eos_id:
      return total, t + 1
    prev = jnp.array([[tok]], jnp.int32)
  return total, len(seq)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_search_exhaustive_equals_brute_force(alpha):
  vocab, max_len, eos = 3, 3, 1
  table = jax.random.normal(jax.random.PRNGKey(3), (17, vocab)) * 2.0
  step, _ = _toy_step(table)
  cache0 = {"hist": jnp.zeros((1, max_len + 1), jnp.int32), "i": jnp.array(0)}

  best = {}
  for seq in itertools.product(range(vocab), repeat=max_len):
    seq = list(seq)
    if eos in seq:
      seq = seq[: seq.index(eos) + 1] + [0] * (max_len - seq.index(eos) - 1)
    key = tuple(seq)
    if key in best:
      continue
    logp, length = _sequence_logp(step, cache0, [t for t in seq[:max_len]], eos)
    best[key] = logp / float(decoding.brevity_penalty(alpha, length))
  ranked = sorted(best.items(), key=lambda kv: -kv[1])

  beam = vocab**max_len  # wide enough to be exhaustive
  seqs, scores = jax.jit(lambda c: decoding.beam_search(step, c, 1, beam, max_len, eos, alpha))(
    decoding.expand_to_beams(cache0, beam)
  )
  assert tuple(np.asarray(seqs[0, 0]).tolist()) == ranked[0][0]
  np.testing.assert_allclose(float(scores[0, 0]), ranked[0][1], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(scores[0, :3]), [r[1] for r in ranked[:3]], rtol=1e-5)


def _model_and_batch():
  module = network.Transformer(TINY)
  rng = np.random.RandomState(0)
  enc = rng.randint(2, TINY.vocab_size, (3, 9)).astype(np.int32)
  enc[1, 6:] = 0
  # Jitted: op by op, init compiles every primitive alone (several seconds for each call of this helper).
  params = jax.jit(
    lambda e: module.init(
      jax.random.PRNGKey(1), e, jnp.ones((3, 7), jnp.int32), jnp.ones((3, 7), jnp.int32), enable_dropout=False
    )
  )(jnp.asarray(enc))["params"]
  return models.EncoderDecoderModel(module), params, enc


@pytest.mark.parametrize("form", ["token_and_log_prob", "token_and_log_prob_by_reductions"])
def test_greedy_token_pick_matches_numpy_with_ties(form):
  """Greedy's token pick is the first index of the row's max (numpy's argmax), its score log_softmax there: the
  plain form and the reductions greedy decoding uses, each against numpy, and through greedy_decode."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 1000)).astype(np.float32) * 4
  logits[1, [7, 500, 999]] = logits[1].max() + 1.0  # a three-way tie for the max: the first index wins
  logits[2, -1] = logits[2].max() + 2.0  # the max in the last column
  logits[3] = -3.0  # all equal: index 0
  token, logp = jax.jit(getattr(decoding, form))(jnp.asarray(logits))
  expected = np.argmax(logits, axis=-1)
  np.testing.assert_array_equal(np.asarray(token), expected)
  assert list(np.asarray(token)[1:4]) == [7, 999, 0]
  x = logits.astype(np.float64)
  lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
  np.testing.assert_allclose(np.asarray(logp), x[np.arange(6), expected] - lse, rtol=0, atol=2e-5)
  step = lambda tokens, cache: (jnp.asarray(logits), cache)  # every row's logits at the one position decoded
  tokens, scores = jax.jit(lambda c: decoding.greedy_decode(step, c, 6, 1, eos_id=-1))(jnp.zeros(()))
  np.testing.assert_array_equal(np.asarray(tokens[:, 0]), expected)
  np.testing.assert_allclose(np.asarray(scores), x[np.arange(6), expected] - lse, rtol=0, atol=2e-5)


def test_greedy_equals_argmax_of_full_forward_per_prefix():
  model, params, enc = _model_and_batch()
  max_len = 7
  predict = jax.jit(lambda p, e: model.predict_batch(p, {"encoder_input_tokens": e}, max_decode_length=max_len))
  tokens = np.asarray(predict(params, jnp.asarray(enc)))
  # Naive reference: re-run the full model (no cache) on each prefix, right-padded to one shape so it
  # compiles once, and take the argmax at the prefix's last position.
  forward = jax.jit(lambda e, d: model.module.apply({"params": params}, e, d, jnp.ones_like(d), enable_dropout=False))
  for row in range(enc.shape[0]):
    prefix = [0]
    for t in range(max_len):
      dec_in = np.zeros((1, max_len), np.int32)
      dec_in[0, : len(prefix)] = prefix
      nxt = int(np.argmax(forward(enc[row : row + 1], dec_in)[0, len(prefix) - 1]))
      assert tokens[row, t] == nxt, (row, t)
      if nxt == 1:
        assert np.all(tokens[row, t + 1 :] == 0)
        break
      prefix.append(nxt)


def test_beam_one_is_greedy_and_wider_beam_scores_at_least_as_well():
  model, params, enc = _model_and_batch()
  batch = {"encoder_input_tokens": jnp.asarray(enc)}
  greedy, greedy_scores = jax.jit(lambda p, b: model.predict_batch(p, b, max_decode_length=6, return_scores=True))(
    params, batch
  )
  beam, beam_scores = jax.jit(
    lambda p, b: model.predict_batch(p, b, max_decode_length=6, beam_size=4, alpha=0.0, return_scores=True)
  )(params, batch)
  forward = jax.jit(lambda e, d: model.module.apply({"params": params}, e, d, jnp.ones_like(d), enable_dropout=False))
  # With alpha=0 the beam score is the sequence log-probability; beam search can only find better ones.
  assert np.all(np.asarray(beam_scores) >= np.asarray(greedy_scores) - 1e-5)
  # And its score is the true log-probability of the returned tokens under a full forward pass.
  for row in range(enc.shape[0]):
    seq = np.asarray(beam[row])
    dec_in = np.concatenate([[0], seq[:-1]])[None].astype(np.int32)
    logp = jax.nn.log_softmax(forward(enc[row : row + 1], dec_in)[0])
    n = int(np.argmax(seq == 1)) + 1 if 1 in seq else len(seq)
    ref = sum(float(logp[t, seq[t]]) for t in range(n))
    np.testing.assert_allclose(float(beam_scores[row]), ref, rtol=1e-4, atol=1e-4)


def test_cross_attention_keys_and_values_are_computed_once_per_decode():
  """predict_batch computes cross-attention keys/values in the cache-creating call (the 'static_cache'
  collection) and the steps read them: steps run with NaN cross key/value kernels still give the tokens of
  the unbroken model. A caller that makes only 'cache' mutable (t5x's decoding) gets no static cache."""
  from flax import traverse_util
  from remixer_t5.model.mixers import base

  model, params, enc = _model_and_batch()
  enc = jnp.asarray(enc)
  max_len = 5
  encoded = model.module.apply({"params": params}, enc, enable_dropout=False, method=model.module.encode)
  cache, static = model._init_cache(params, encoded, enc, enc.shape[0], max_len)
  names = {k[-1] for k in traverse_util.flatten_dict(static[base.STATIC_CACHE])}
  assert names == {"projected_key", "projected_value"}
  # [batch, heads, head_dim, encoder length], as the attention products read them.
  assert all(
    v.shape == (enc.shape[0], TINY.num_heads, TINY.head_dim, enc.shape[1])
    for v in traverse_util.flatten_dict(static[base.STATIC_CACHE]).values()
  )
  flat = traverse_util.flatten_dict(params)
  broken = traverse_util.unflatten_dict(
    {
      k: (jnp.full_like(v, jnp.nan) if "encoder_decoder_attention" in k and k[-2] in ("key", "value") else v)
      for k, v in flat.items()
    }
  )

  def decode(step_params):
    def step(tokens, c):
      logits, variables = model.module.apply(
        {"params": step_params, "cache": c, **static},
        encoded,
        enc,
        tokens,
        tokens,
        enable_dropout=False,
        decode=True,
        max_decode_length=max_len,
        mutable=["cache"],
        method=model.module.decode,
      )
      return logits[:, -1], variables["cache"]

    return decoding.greedy_decode(step, cache, enc.shape[0], max_len)[0]

  expected = model.predict_batch(params, {"encoder_input_tokens": enc}, max_decode_length=max_len)
  np.testing.assert_array_equal(np.asarray(decode(broken)), np.asarray(expected))
  # Without the collection the step projects the encoder output itself (and the broken kernels show).
  _, t5x_style = model.module.apply(
    {"params": params},
    enc,
    jnp.ones((enc.shape[0], max_len), jnp.int32),
    jnp.ones((enc.shape[0], max_len), jnp.int32),
    decode=True,
    enable_dropout=False,
    mutable=["cache"],
  )
  assert set(t5x_style) == {"cache"}
  logits, _ = model.module.apply(
    {"params": broken, "cache": t5x_style["cache"]},
    encoded,
    enc,
    jnp.zeros((enc.shape[0], 1), jnp.int32),
    jnp.zeros((enc.shape[0], 1), jnp.int32),
    enable_dropout=False,
    decode=True,
    max_decode_length=max_len,
    mutable=["cache"],
    method=model.module.decode,
  )
  assert np.all(np.isnan(np.asarray(logits)))


# --- sampling --------------------------------------------------------------------------------------------
def _nucleus(probs: np.ndarray, p: float) -> set[int]:
  """The smallest set of most likely tokens whose probability reaches p (Holtzman et al. 2020), by numpy."""
  order = np.argsort(-probs, kind="stable")
  n = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1
  return set(order[: min(n, len(order))].tolist())


@pytest.mark.parametrize(
  "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.8, 6, 0.9)]
)
def test_sampling_draws_the_distribution_it_claims(temperature, top_k, top_p):
  """40,000 draws of one row's next token: every draw inside the top k and the nucleus, and the frequencies those
  of softmax(logits / temperature) renormalised over the kept tokens, as numpy computes it."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(12,)).astype(np.float32) * 2
  sampling = decoding.Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
  scaled = np.exp((logits - logits.max()) / temperature)
  probs = scaled / scaled.sum()
  kept = set(np.argsort(-logits)[:top_k].tolist()) if top_k else set(range(12))
  if top_p < 1.0:  # the nucleus of the top-k distribution
    masked = np.where(np.isin(np.arange(12), list(kept)), probs, 0.0)
    kept = _nucleus(masked / masked.sum(), top_p)
  want = np.where(np.isin(np.arange(12), list(kept)), probs, 0.0)
  want /= want.sum()
  keys = jax.random.split(jax.random.PRNGKey(1), 40_000)
  tokens, logp = jax.jit(jax.vmap(lambda k: decoding.sample_token(jnp.asarray(logits), k, sampling)))(keys)
  tokens = np.asarray(tokens)
  assert set(np.unique(tokens).tolist()) <= kept
  freq = np.bincount(tokens, minlength=12) / len(tokens)
  np.testing.assert_allclose(freq, want, atol=0.012)
  # the log-probability reported is the model's own (untempered, unfiltered)
  np.testing.assert_allclose(np.asarray(logp), jax.nn.log_softmax(logits)[tokens], rtol=1e-5, atol=1e-6)


def test_sampling_temperature_zero_and_top_1_are_greedy_and_a_seed_fixes_the_draws():
  model, params, enc = _model_and_batch()
  batch = {"encoder_input_tokens": jnp.asarray(enc)}
  decode = jax.jit(
    lambda p, b, rng, s: model.predict_batch(p, b, max_decode_length=7, sampling=s, rng=rng, return_scores=True),
    static_argnums=3,
  )
  greedy, greedy_logp = model.predict_batch(params, batch, max_decode_length=7, return_scores=True)
  key = jax.random.PRNGKey(3)
  for sampling in (
    decoding.Sampling(temperature=0.0),
    decoding.Sampling(temperature=2.0, top_k=1),
    decoding.Sampling(top_p=1e-6),
  ):
    tokens, logp = decode(params, batch, key, sampling)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(greedy), err_msg=str(sampling))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(greedy_logp), rtol=1e-5, atol=1e-5)
  hot = decoding.Sampling(temperature=5.0)
  a, b = decode(params, batch, key, hot)[0], decode(params, batch, key, hot)[0]
  c = decode(params, batch, jax.random.PRNGKey(4), hot)[0]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_sampling_refuses_bad_settings():
  for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
    with pytest.raises(ValueError, match="expected temperature >= 0"):
      decoding.Sampling(**bad)
  model, params, enc = _model_and_batch()
  with pytest.raises(ValueError, match="sampling needs beam_size 1"):
    model.predict_batch(
      params,
      {"encoder_input_tokens": jnp.asarray(enc)},
      beam_size=2,
      sampling=decoding.Sampling(),
      rng=jax.random.PRNGKey(0),
    )
