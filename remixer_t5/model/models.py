"""The model wrapper: loss, metrics and prediction around a t5x-contract encoder-decoder module.

Mirrors t5x's `EncoderDecoderModel`: batches are dicts of `encoder_input_tokens`, `decoder_input_tokens`,
`decoder_target_tokens` (+ optional `*_segment_ids`, `*_positions`, `decoder_loss_weights`).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from remixer_t5 import gin_utils
from remixer_t5.model import decoding
from remixer_t5.model.mixers import base

Array = jax.Array
Batch = Mapping[str, Array]

_MODULE_KEYS = ("encoder_segment_ids", "decoder_segment_ids", "encoder_positions", "decoder_positions")


def cross_entropy_with_z_loss(
  logits: Array, targets: Array, weights: Array, z_loss: float = 0.0, label_smoothing: float = 0.0
) -> tuple[Array, Array, Array, Array]:
  """Summed token cross-entropy (+ z_loss * log(Z)^2, the PaLM/mesh-TF stabiliser), its z part and the tokens
  whose target is the top logit, as t5x's `cross_entropy_with_logits` on (smoothed) one-hot targets and
  `compute_weighted_accuracy`; a target id outside [0, V) has a zero row and is never correct.

  Returns (total_loss_sum, z_loss_sum, weight_sum, correct_sum); `total` includes the z term as in t5x."""
  logits = logits.astype(jnp.float32)
  w = weights.astype(jnp.float32)
  if label_smoothing == 0:
    ce_z, zl, correct = _one_hot_cross_entropy(logits, targets, z_loss)
    return jnp.sum(ce_z * w), jnp.sum(zl * w), jnp.sum(w), jnp.sum(correct * w)
  vocab = logits.shape[-1]
  log_z = jax.nn.logsumexp(logits, axis=-1)
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1) if vocab > 1 else 0.0
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  # less the entropy of the smoothed target, so that the minimum is 0
  ce = (
    log_z
    - jnp.sum(soft * logits, axis=-1)
    + (confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
  )
  zl = z_loss * jnp.square(log_z)
  correct = jnp.argmax(logits, axis=-1) == targets
  return jnp.sum((ce + zl) * w), jnp.sum(zl * w), jnp.sum(w), jnp.sum(correct * w)


def _one_hot_cross_entropy(logits: Array, targets: Array, z_loss: float) -> tuple[Array, Array, Array]:
  """Per token: log Z - logit[target] + z_loss log(Z)^2, its z term, and whether the target's logit is the row's
  largest (1.0; ties count as correct, where argmax would take the first). Each row's max, its sum of exp and the
  target's logit (a masked sum that XLA fuses with the max: two passes over the logits, where the smoothed form's
  one-hot product and argmax add more). JAX differentiates it: the gradient, softmax (1 + 2 z_loss log Z) -
  one-hot, is elementwise, so XLA fuses it into the logits product's gradient, which a custom gradient (opaque
  to XLA) would prevent."""
  vocab = logits.shape[-1]
  valid = (targets >= 0) & (targets < vocab)
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
  log_z = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
  target = jnp.sum(jnp.where(jnp.arange(vocab) == targets[..., None], logits, 0.0), axis=-1)
  zl = z_loss * jnp.square(log_z)
  return log_z - target + zl, zl, (valid & (target >= top)).astype(logits.dtype)


class EncoderDecoderModel:
  """Loss, evaluation and decoding for an encoder-decoder `module` (e.g. `network.Transformer`)."""

  def __init__(
    self,
    module: nn.Module,
    vocabulary: Any = None,
    z_loss: float = 1e-4,
    label_smoothing: float = 0.0,
    loss_normalizing_factor: float | None = None,
  ):
    """`loss_normalizing_factor=None` divides by the number of real target tokens (a per-token mean)."""
    self.module = module
    self.vocabulary = vocabulary
    self.z_loss = z_loss
    self.label_smoothing = label_smoothing
    self.loss_normalizing_factor = loss_normalizing_factor

  # --- parameters -----------------------------------------------------------------------------------
  def init_variables(self, rng: Array, input_shapes: Mapping[str, tuple[int, ...]]):
    """{'params', 'params_axes'} for batches of the given shapes (use under jax.eval_shape for shapes)."""
    b = {k: jnp.ones(v, jnp.int32) for k, v in input_shapes.items()}
    return self.module.init(
      rng, b["encoder_input_tokens"], b["decoder_input_tokens"], b["decoder_target_tokens"], enable_dropout=False
    )

  # --- training and evaluation ---------------------------------------------------------------------
  def logits(self, params, batch: Batch, dropout_rng: Array | None = None) -> Array:
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    extra = {k: batch[k] for k in _MODULE_KEYS if k in batch}
    return self.module.apply(
      {"params": params},
      batch["encoder_input_tokens"],
      batch["decoder_input_tokens"],
      batch["decoder_target_tokens"],
      **extra,
      enable_dropout=dropout_rng is not None,
      rngs=rngs,
    )

  def loss_fn(self, params, batch: Batch, dropout_rng: Array | None) -> tuple[Array, dict[str, Array]]:
    """Normalised loss and summed metrics (`*_sum` are additive across batches and devices)."""
    logits = self.logits(params, batch, dropout_rng)
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights", (targets > 0).astype(jnp.float32))
    total, z, weight_sum, correct = cross_entropy_with_z_loss(
      logits, targets, weights, self.z_loss, self.label_smoothing
    )
    norm = self.loss_normalizing_factor or jnp.maximum(weight_sum, 1.0)
    metrics = {"loss_sum": total, "z_loss_sum": z, "weight_sum": weight_sum, "correct_sum": correct}
    return total / norm, metrics

  # --- decoding ------------------------------------------------------------------------------------
  def _init_cache(self, params, encoded, encoder_tokens, batch_size: int, max_length: int):
    """(the decode cache, {base.STATIC_CACHE: values computed once from `encoded`} or {})."""
    dec = jnp.ones((batch_size, max_length), jnp.int32)
    _, variables = self.module.apply(
      {"params": params},
      encoded,
      encoder_tokens,
      dec,
      dec,
      enable_dropout=False,
      decode=True,
      mutable=["cache", base.STATIC_CACHE],
      method=self.module.decode,
    )
    return variables["cache"], {k: v for k, v in variables.items() if k == base.STATIC_CACHE}

  def predict_batch(
    self,
    params,
    batch: Batch,
    max_decode_length: int | None = None,
    beam_size: int = 1,
    alpha: float = 0.6,
    eos_id: int = 1,
    return_scores: bool = False,
    sampling: decoding.Sampling | None = None,
    rng: Array | None = None,
  ):
    """Greedy (beam_size=1), beam-search or, with `sampling` and `rng`, sampled decoding; returns tokens [batch,
    max_decode_length] (the best beam), and with `return_scores` their log-probability [batch] (beam search: the
    beam's length-penalised score)."""
    if sampling is not None and (beam_size != 1 or rng is None):
      raise ValueError(f"predict_batch: sampling needs beam_size 1 (got {beam_size}) and an rng (got {rng})")
    enc_tokens = batch["encoder_input_tokens"]
    max_len = max_decode_length or batch["decoder_target_tokens"].shape[-1]
    batch_size = enc_tokens.shape[0]
    encoded = self.module.apply({"params": params}, enc_tokens, enable_dropout=False, method=self.module.encode)
    # The cache is created for the batch, then repeated per beam; the static cache (cross-attention keys and
    # values) is not: a row's beams share one encoder output, so attention reads it once for all of them.
    cache, static = self._init_cache(params, encoded, enc_tokens, batch_size, max_len)
    if beam_size > 1:
      enc_tokens, encoded, cache = decoding.expand_to_beams((enc_tokens, encoded, cache), beam_size)

    def step(tokens, cache):  # `static` enters every step as a constant, not as loop state (base.static_cache)
      logits, variables = self.module.apply(
        {"params": params, "cache": cache, **static},
        encoded,
        enc_tokens,
        tokens,
        tokens,
        enable_dropout=False,
        decode=True,
        max_decode_length=max_len,
        mutable=["cache"],
        method=self.module.decode,
      )
      return logits[:, -1, :], variables["cache"]

    if sampling is not None:
      tokens, scores = decoding.sample_decode(step, cache, batch_size, max_len, rng, sampling, eos_id)
    elif beam_size == 1:
      tokens, scores = decoding.greedy_decode(step, cache, batch_size, max_len, eos_id)
    else:
      beams, beam_scores = decoding.beam_search(step, cache, batch_size, beam_size, max_len, eos_id, alpha)
      tokens, scores = beams[:, 0], beam_scores[:, 0]
    return (tokens, scores) if return_scores else tokens


def from_gin(gin_file: str, *bindings: str) -> nn.Module:
  """The Flax module a model config describes, e.g. `from_gin('models/remixer/tiny.gin')`.

  `bindings` are 'NAME=VALUE' strings as on the command line (`'network.T5Config.emb_dim=64'`)."""
  gin_utils.parse_gin([gin_file], list(bindings))
  model = gin_utils.macro("MODEL")
  if model is None:
    raise gin_utils.GinError(f"{gin_file} defines no MODEL")
  return model.module
