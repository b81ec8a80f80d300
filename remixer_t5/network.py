"""T5.1.1 encoder-decoder with t5x's module contract (`examples/t5/network.py` names and call signature).

T5.1.1 = T5 (Raffel et al. 2020) with gated-GELU feed-forward, no parameter sharing between embedding and
output layer, RMS norms without bias, relative position biases shared per stack, dropout only in training.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5 import layers

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Sizes and options of a T5.1.1 model; field names follow t5x's `T5Config`."""
  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  mlp_activations: Sequence[str] = ("gelu", "linear")
  dropout_rate: float = 0.0
  dtype: str = "float32"  # activations; parameters are always float32
  relpos_num_buckets: int = 32
  relpos_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  float32_attention_logits: bool = True

  def __post_init__(self):
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    for name in ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"T5Config.{name} must be positive, got {getattr(self, name)}")


def _positions(tokens: Array, positions: Array | None) -> Array:
  if positions is not None:
    return positions
  return jnp.arange(tokens.shape[-1], dtype=jnp.int32)[None, :]


class EncoderLayer(nn.Module):
  config: T5Config
  relpos_bias: nn.Module

  @nn.compact
  def __call__(self, x, mask_bias, positions, deterministic):
    cfg = self.config
    bias = layers.combine_biases(mask_bias, self.relpos_bias(positions, positions, bidirectional=True))
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="pre_attention_layer_norm")(x)
    y = layers.MultiHeadDotProductAttention(cfg.num_heads, cfg.head_dim, cfg.dropout_rate, cfg.dtype,
                                            cfg.float32_attention_logits, name="attention")(
                                                y, y, bias, deterministic=deterministic)
    x = x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="pre_mlp_layer_norm")(x)
    y = layers.MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate, cfg.dtype, name="mlp")(
        y, deterministic=deterministic)
    x = x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    return layers.with_sharding_constraint(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
  config: T5Config
  relpos_bias: nn.Module

  @nn.compact
  def __call__(self, x, encoded, self_mask_bias, cross_mask_bias, positions, deterministic, decode):
    cfg = self.config
    # When decoding, `positions` are all max_decode_length positions; the attention slices the bias row of
    # the current cache index.
    relpos = self.relpos_bias(positions, positions, bidirectional=False)
    self_bias = layers.combine_biases(self_mask_bias, relpos)
    attn = lambda name: layers.MultiHeadDotProductAttention(
        cfg.num_heads, cfg.head_dim, cfg.dropout_rate, cfg.dtype, cfg.float32_attention_logits, name=name)
    drop = lambda y: nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)

    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="pre_self_attention_layer_norm")(x)
    x = x + drop(attn("self_attention")(y, y, self_bias, deterministic=deterministic, decode=decode))
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="pre_cross_attention_layer_norm")(x)
    x = x + drop(attn("encoder_decoder_attention")(y, encoded, cross_mask_bias, deterministic=deterministic))
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="pre_mlp_layer_norm")(x)
    y = layers.MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate, cfg.dtype, name="mlp")(
        y, deterministic=deterministic)
    x = x + drop(y)
    return layers.with_sharding_constraint(x, ("batch", "length", "embed"))

class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None, *, deterministic=True):
    cfg = self.config
    relpos = layers.RelativePositionBiases(cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads,
                                           cfg.dtype, name="relpos_bias")
    mask = layers.make_attention_mask(tokens > 0, tokens > 0)
    if segment_ids is not None:
      mask = layers.combine_masks(mask, layers.make_attention_mask(segment_ids, segment_ids, jnp.equal))
    mask_bias = layers.mask_to_bias(mask, cfg.dtype)
    pos = _positions(tokens, positions)

    x = self.shared_embedding(tokens.astype(jnp.int32))
    x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    x = layers.with_sharding_constraint(x, ("batch", "length", "embed"))
    for i in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, relpos, name=f"layers_{i}")(x, mask_bias, pos, deterministic)
    x = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="encoder_norm")(x)
    return nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded, decoder_input_tokens, self_mask_bias, cross_mask_bias, positions=None, *,
               deterministic=True, decode=False, max_decode_length=None):
    cfg = self.config
    relpos = layers.RelativePositionBiases(cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads,
                                           cfg.dtype, name="relpos_bias")
    if decode:
      length = max_decode_length or decoder_input_tokens.shape[-1]
      pos = jnp.arange(length, dtype=jnp.int32)[None, :]
    else:
      pos = _positions(decoder_input_tokens, positions)
    y = self.shared_embedding(decoder_input_tokens.astype(jnp.int32))
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    y = layers.with_sharding_constraint(y, ("batch", "length", "embed"))
    for i in range(cfg.num_decoder_layers):
      y = DecoderLayer(cfg, relpos, name=f"layers_{i}")(y, encoded, self_mask_bias, cross_mask_bias, pos,
                                                       deterministic, decode)
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="decoder_norm")(y)
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    # Logits in float32 whatever the activation dtype: the softmax over the vocabulary needs the range.
    logits = layers.Dense(cfg.vocab_size, ("embed", "vocab"), dtype="float32", name="logits_dense")(y)
    return layers.with_sharding_constraint(logits, ("batch", "length", "vocab"))


class Transformer(nn.Module):
  """T5.1.1 encoder-decoder. Token id 0 is padding (masks come from the tokens, as in t5x)."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype)
    self.encoder = Encoder(cfg, self.token_embedder)
    self.decoder = Decoder(cfg, self.token_embedder)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None, *,
             enable_dropout=True):
    return self.encoder(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                        deterministic=not enable_dropout)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
             encoder_segment_ids=None, decoder_segment_ids=None, decoder_positions=None, *,
             enable_dropout=True, decode=False, max_decode_length=None):
    """Logits for decoder inputs given the encoder output; `decode=True` steps one position with the cache."""
    dtype = self.config.dtype
    if decode:
      # The cache decides which positions are visible; only padding of the encoder side matters here.
      self_bias = None
      cross_mask = layers.make_attention_mask(jnp.ones_like(decoder_input_tokens) > 0,
                                              encoder_input_tokens > 0)
    else:
      length = decoder_input_tokens.shape[-1]
      self_mask = layers.combine_masks(
          layers.make_causal_mask(length),
          layers.make_attention_mask(decoder_target_tokens > 0, decoder_target_tokens > 0))
      cross_mask = layers.make_attention_mask(decoder_target_tokens > 0, encoder_input_tokens > 0)
      if decoder_segment_ids is not None:
        self_mask = layers.combine_masks(
            self_mask, layers.make_attention_mask(decoder_segment_ids, decoder_segment_ids, jnp.equal))
        cross_mask = layers.combine_masks(
            cross_mask, layers.make_attention_mask(decoder_segment_ids, encoder_segment_ids, jnp.equal))
      self_bias = layers.mask_to_bias(self_mask, dtype)
    return self.decoder(encoded, decoder_input_tokens, self_bias, layers.mask_to_bias(cross_mask, dtype),
                        decoder_positions, deterministic=not enable_dropout, decode=decode,
                        max_decode_length=max_decode_length)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout=True, decode=False):
    if (encoder_segment_ids is None) != (decoder_segment_ids is None):
      raise ValueError("packed inputs need both encoder_segment_ids and decoder_segment_ids")
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                          enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
                       encoder_segment_ids, decoder_segment_ids, decoder_positions,
                       enable_dropout=enable_dropout, decode=decode)
