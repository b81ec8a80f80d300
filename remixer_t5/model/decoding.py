"""Autoregressive decoding over a model-agnostic step function: greedy, sampling and beam search.

`tokens_to_logits(tokens [batch, 1], cache) -> (logits [batch, vocab], cache)` advances the cache one position.
Sequences start from token 0 (T5's decoder start) and stop at `eos_id`; positions after EOS are 0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
StepFn = Callable[[Array, object], tuple[Array, object]]
NEG_INF = -1.0e7


def token_and_log_prob(logits: Array) -> tuple[Array, Array]:
  """(argmax over the last axis, first index on ties; its log-probability), as greedy decoding needs them: the
  plain form, `jnp.argmax` of the raw logits (as HF's greedy search takes it) and log_softmax there."""
  token = jnp.argmax(logits, axis=-1)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return token, jnp.take_along_axis(log_probs, token[..., None], axis=-1)[..., 0]


def token_and_log_prob_by_reductions(logits: Array) -> tuple[Array, Array]:
  """`token_and_log_prob` as two plain reductions, which greedy decoding uses: the token is the first index
  holding the row's max, its log-probability max - logsumexp. XLA:CPU vectorises these where `jnp.argmax`'s
  (value, index) pair reduction does not; the greedy decode of a COGS batch pays it back (docs/benchmarks.md,
  "Against an earlier commit"). Equal to the plain form (tests/test_decoding.py)."""
  logits = logits.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  lse = top + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
  iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  token = jnp.min(jnp.where(logits == top, iota, logits.shape[-1]), axis=-1)
  return token, (top - lse)[..., 0]


def greedy_decode(
  tokens_to_logits: StepFn,
  cache,
  batch_size: int,
  max_length: int,
  eos_id: int = 1,
  pick: Callable[[Array, Array], tuple[Array, Array]] | None = None,
) -> tuple[Array, Array]:
  """Argmax decoding, or with `pick(logits, position) -> (token, log-probability)` any one-token choice (as
  `sample_decode` draws); returns (tokens [batch, max_length], sum of log-probabilities [batch])."""

  def cond(state):
    i, _, _, done, _ = state
    return jnp.logical_and(i < max_length, jnp.logical_not(jnp.all(done)))

  def body(state):
    i, seqs, logp, done, cache = state
    prev = jnp.where(i == 0, 0, jax.lax.dynamic_index_in_dim(seqs, jnp.maximum(i - 1, 0), 1, False))
    logits, cache = tokens_to_logits(prev[:, None], cache)
    tok, tok_logp = token_and_log_prob_by_reductions(logits) if pick is None else pick(logits, i)
    tok = jnp.where(done, 0, tok)
    logp = logp + jnp.where(done, 0.0, tok_logp)
    seqs = jax.lax.dynamic_update_index_in_dim(seqs, tok, i, 1)
    return i + 1, seqs, logp, jnp.logical_or(done, tok == eos_id), cache

  init = (
    jnp.array(0),
    jnp.zeros((batch_size, max_length), jnp.int32),
    jnp.zeros((batch_size,)),
    jnp.zeros((batch_size,), bool),
    cache,
  )
  _, seqs, logp, _, _ = jax.lax.while_loop(cond, body, init)
  return seqs, logp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Ancestral sampling from the model's next-token distribution, reshaped as Holtzman et al. 2020 ("The Curious
  Case of Neural Text Degeneration") and HF's `generate` do: logits divided by `temperature`, then only the
  `top_k` most likely tokens kept (0: all), then only the smallest set of most likely tokens whose probability
  reaches `top_p` (the nucleus; 1.0: all). `seed` fixes the draws. A temperature of 0 is greedy decoding."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
      raise ValueError(
        f"sampling: temperature {self.temperature}, top_k {self.top_k}, top_p {self.top_p}: expected "
        "temperature >= 0 (0: greedy), top_k >= 0 (0: every token) and 0 < top_p <= 1"
      )


def sampling_logits(logits: Array, sampling: Sampling) -> Array:
  """The logits the next token is drawn from: scaled by 1/temperature, then every token outside the top k and
  outside the nucleus set to NEG_INF. The most likely token always stays (a nucleus smaller than it keeps it)."""
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if sampling.top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens more likely than each
    kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the nucleus: reached top_p only with this one
    logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), NEG_INF, logits)
  return logits


def sample_token(logits: Array, key: Array, sampling: Sampling) -> tuple[Array, Array]:
  """(a token drawn from `sampling_logits`, its log-probability under the model's own distribution)."""
  token = jax.random.categorical(key, sampling_logits(logits, sampling), axis=-1)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return token, jnp.take_along_axis(log_probs, token[..., None], axis=-1)[..., 0]


def sample_decode(
  tokens_to_logits: StepFn, cache, batch_size: int, max_length: int, rng: Array, sampling: Sampling, eos_id: int = 1
) -> tuple[Array, Array]:
  """Sampling as `sampling` says, position i drawing with key fold_in(rng, i); temperature 0 is greedy. Returns
  (tokens [batch, max_length], the model's log-probability of them [batch])."""
  if sampling.temperature == 0:
    return greedy_decode(tokens_to_logits, cache, batch_size, max_length, eos_id)
  pick = lambda logits, i: sample_token(logits, jax.random.fold_in(rng, i), sampling)
  return greedy_decode(tokens_to_logits, cache, batch_size, max_length, eos_id, pick)


def brevity_penalty(alpha: float, length) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016), as in T5's beam search."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def _gather_beams(tree, beam_indices: Array, batch_size: int, old_beams: int, new_beams: int, flat: bool = False):
  """Gather [batch, old_beams, ...] leaves (or [batch * old_beams, ...] with flat=True, as in the cache) by
  [batch, new_beams] beam indices."""
  flat_idx = (jnp.arange(batch_size)[:, None] * old_beams + beam_indices).reshape(-1)
  # The indices are in range by construction: mode="clip" spares the bounds check and NaN fill of the default
  # mode, which slow every cache gather on CPU.
  take = lambda x: jnp.take(x, flat_idx, axis=0, mode="clip")

  def gather(x):
    if x.ndim == 0:  # cache indices are shared by all beams
      return x
    if flat:
      return take(x)
    return take(x.reshape((batch_size * old_beams,) + x.shape[2:])).reshape((batch_size, new_beams) + x.shape[2:])

  return jax.tree_util.tree_map(gather, tree)


def beam_search(
  tokens_to_logits: StepFn, cache, batch_size: int, beam_size: int, max_length: int, eos_id: int = 1, alpha: float = 0.6
) -> tuple[Array, Array]:
  """Beam search with length penalty; returns (tokens [batch, beams, max_length], scores [batch, beams]).

  Beams are sorted best first. `cache` must already be expanded to batch * beam_size rows (see
  `expand_to_beams`). Each step keeps the 2k best continuations so that k live beams survive even when k of
  them end in EOS; finished hypotheses are scored log p / brevity_penalty(length)."""
  k, b = beam_size, batch_size

  def cond(state):
    i, _, alive_logp, _, fin_scores, _ = state
    # Stop when no live beam can still beat the worst kept finished hypothesis.
    best_alive = alive_logp[:, 0] / brevity_penalty(alpha, max_length)
    worst_fin = jnp.min(fin_scores, axis=1)
    done = jnp.all(worst_fin > best_alive)
    return jnp.logical_and(i < max_length, jnp.logical_not(done))

  def body(state):
    i, alive_seqs, alive_logp, fin_seqs, fin_scores, cache = state
    prev = jnp.where(i == 0, 0, jax.lax.dynamic_index_in_dim(alive_seqs, jnp.maximum(i - 1, 0), 2, False))
    logits, cache = tokens_to_logits(prev.reshape(b * k, 1), cache)
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(b, k, vocab)
    cand = (alive_logp[:, :, None] + log_probs).reshape(b, k * vocab)
    top_logp, top_idx = jax.lax.top_k(cand, 2 * k)
    top_beam, top_tok = top_idx // vocab, (top_idx % vocab).astype(jnp.int32)
    top_seqs = jax.lax.dynamic_update_index_in_dim(_gather_beams(alive_seqs, top_beam, b, k, 2 * k), top_tok, i, 2)
    is_eos = top_tok == eos_id

    # Live beams: best k continuations that did not end.
    alive_cand = jnp.where(is_eos, NEG_INF, top_logp)
    new_alive_logp, pick = jax.lax.top_k(alive_cand, k)
    alive_seqs = _gather_beams(top_seqs, pick, b, 2 * k, k)
    cache = _gather_beams(cache, jnp.take_along_axis(top_beam, pick, 1), b, k, k, flat=True)

    # Finished: merge the old finished set with the continuations that ended here.
    new_fin = jnp.where(is_eos, top_logp / brevity_penalty(alpha, i + 1), NEG_INF)
    all_scores = jnp.concatenate([fin_scores, new_fin], 1)
    all_seqs = jnp.concatenate([fin_seqs, top_seqs], 1)
    fin_scores, pick = jax.lax.top_k(all_scores, k)
    fin_seqs = _gather_beams(all_seqs, pick, b, 3 * k, k)
    return i + 1, alive_seqs, new_alive_logp, fin_seqs, fin_scores, cache

  # Only the first beam is live at the start, so the k copies do not yield k identical hypotheses.
  alive_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1)), (b, 1))
  seqs = jnp.zeros((b, k, max_length), jnp.int32)
  init = (jnp.array(0), seqs, alive_logp, seqs, jnp.full((b, k), NEG_INF), cache)
  _, alive_seqs, alive_logp, fin_seqs, fin_scores, _ = jax.lax.while_loop(cond, body, init)

  # Live beams that reached max_length count as finished there. When the loop stopped early they cannot beat
  # the worst kept finished hypothesis, so merging them changes nothing.
  alive_scores = alive_logp / brevity_penalty(alpha, max_length)
  scores, pick = jax.lax.top_k(jnp.concatenate([fin_scores, alive_scores], 1), k)
  seqs = _gather_beams(jnp.concatenate([fin_seqs, alive_seqs], 1), pick, b, 2 * k, k)
  seen = jnp.cumsum(seqs == eos_id, axis=-1)  # every position after the first EOS becomes 0 (the EOS is kept)
  after = jnp.concatenate([jnp.zeros_like(seen[..., :1]), seen[..., :-1]], axis=-1) > 0
  return jnp.where(after, 0, seqs), scores


def expand_to_beams(tree, beam_size: int):
  """Repeat every batch-major leaf beam_size times: [batch, ...] -> [batch * beam_size, ...]."""
  return jax.tree_util.tree_map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)
