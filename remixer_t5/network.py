"""Encoder-decoder stacks built from (token mixer, feature mixer) pairs, with t5x's module contract.

With the defaults this is T5.1.1 (Raffel et al. 2020 + the T5.1.1 changes: gated-GELU feed-forward, untied
embedding and output layer, RMS norms without bias, relative position biases shared per stack) with t5x's
parameter names. The mixers of each stack come from gin (`remixer_t5/mixers/`, one file per paper); a layer is
pre-norm + mixer + dropout + residual for each slot (HyperMixer paper, Fig. 1).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from remixer_t5 import layers
from remixer_t5.mixers import base
from remixer_t5.mixers.attention import Attention
from remixer_t5.mixers.feed_forward import GatedMlp

Array = jax.Array
Factory = Callable[..., nn.Module]


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Sizes and options shared by all mixers; field names follow t5x's `T5Config`."""
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


# Slot names: t5x's for attention and the gated MLP (so T5 checkpoints line up), descriptive otherwise.
_ATTENTION_SLOTS = {"encoder": "attention", "self": "self_attention", "cross": "encoder_decoder_attention"}
_OTHER_SLOTS = {"encoder": "token_mixer", "self": "token_mixer", "cross": "cross_mixer"}
_NORM_NAMES = {"encoder_decoder_attention": "pre_cross_attention_layer_norm"}


def slot_name(factory: Factory, role: str) -> str:
  kind = getattr(factory, "KIND", "")
  if role == "feature":
    return kind or "feature_mixer"
  return (_ATTENTION_SLOTS if kind == "attention" else _OTHER_SLOTS)[role]


def _apply_slot(layer: nn.Module, x, factory: Factory, role: str, kv, ctx, deterministic: bool):
  """x + dropout(mixer(norm(x), ...)): the pre-norm residual wrapper of every slot (ψ in the papers)."""
  cfg = layer.config
  name = slot_name(factory, role)
  y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name=_NORM_NAMES.get(name, f"pre_{name}_layer_norm"))(x)
  mixer = factory(config=cfg, name=name)
  if role == "feature":
    y = mixer(y, ctx, deterministic=deterministic)
  else:
    y = mixer(y, y if kv is None else kv, ctx, deterministic=deterministic)
  return x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)


class EncoderLayer(nn.Module):
  config: T5Config
  token_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp

  @nn.compact
  def __call__(self, x, ctx: base.MixerContext, deterministic: bool):
    x = _apply_slot(self, x, self.token_mixer, "encoder", None, ctx, deterministic)
    if self.feature_mixer is not None:
      x = _apply_slot(self, x, self.feature_mixer, "feature", None, ctx, deterministic)
    return layers.with_sharding_constraint(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
  config: T5Config
  token_mixer: Factory = Attention
  cross_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp

  @nn.compact
  def __call__(self, x, encoded, self_ctx: base.MixerContext, cross_ctx: base.MixerContext,
               deterministic: bool):
    x = _apply_slot(self, x, self.token_mixer, "self", None, self_ctx, deterministic)
    x = _apply_slot(self, x, self.cross_mixer, "cross", encoded, cross_ctx, deterministic)
    if self.feature_mixer is not None:
      x = _apply_slot(self, x, self.feature_mixer, "feature", None, self_ctx, deterministic)
    return layers.with_sharding_constraint(x, ("batch", "length", "embed"))


def _positions(tokens: Array, positions: Array | None, segment_ids: Array | None = None) -> Array:
  """Given positions; else positions restarting in each packed segment; else 0..len-1."""
  if positions is not None:
    return positions.astype(jnp.int32)
  idx = jnp.arange(tokens.shape[-1], dtype=jnp.int32)[None, :]
  if segment_ids is None:
    return idx
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                           axis=1)
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module
  token_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp
  input_layer: Factory | None = None  # e.g. the pNLP-Mixer projection instead of the token embedding

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None, *, deterministic=True):
    cfg = self.config
    # Created here, materialised only if a mixer calls it (attention), so attention-free stacks have no table.
    relpos = layers.RelativePositionBiases(cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads,
                                           cfg.dtype, name="relpos_bias")
    mask = (tokens > 0).astype(jnp.float32)
    pos = _positions(tokens, positions, segment_ids)
    ctx = base.MixerContext(q_mask=mask, kv_mask=mask, q_positions=pos, kv_positions=pos,
                            q_segment_ids=segment_ids, kv_segment_ids=segment_ids, relpos=relpos)
    if self.input_layer is not None:
      x = self.input_layer(config=cfg, name="input_projection")(tokens.astype(jnp.int32), ctx,
                                                               deterministic=deterministic)
    else:
      x = self.shared_embedding(tokens.astype(jnp.int32))
    x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    x = layers.with_sharding_constraint(x, ("batch", "length", "embed"))
    for i in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, self.token_mixer, self.feature_mixer, name=f"layers_{i}")(x, ctx, deterministic)
    x = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="encoder_norm")(x)
    return nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module
  token_mixer: Factory = Attention
  cross_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp

  @nn.compact
  def __call__(self, encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
               encoder_segment_ids=None, decoder_segment_ids=None, positions=None, *, deterministic=True,
               decode=False, max_decode_length=None):
    cfg = self.config
    relpos = layers.RelativePositionBiases(cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads,
                                           cfg.dtype, name="relpos_bias")
    enc_mask = (encoder_input_tokens > 0).astype(jnp.float32)
    if decode:
      # One position per call (after the cache-creating first call); mixers track the step in their cache.
      length = max_decode_length or decoder_input_tokens.shape[-1]
      pos = jnp.arange(length, dtype=jnp.int32)[None, :]
      dec_mask = jnp.ones(decoder_input_tokens.shape, jnp.float32)
    else:
      pos = _positions(decoder_input_tokens, positions, decoder_segment_ids)
      dec_mask = (decoder_target_tokens > 0).astype(jnp.float32)
    self_ctx = base.MixerContext(q_mask=dec_mask, kv_mask=dec_mask, q_positions=pos, kv_positions=pos,
                                 q_segment_ids=decoder_segment_ids, kv_segment_ids=decoder_segment_ids,
                                 causal=True, decode=decode, max_decode_length=max_decode_length,
                                 relpos=relpos)
    enc_pos = _positions(encoder_input_tokens, None, encoder_segment_ids)
    cross_ctx = base.MixerContext(q_mask=dec_mask, kv_mask=enc_mask, q_positions=pos, kv_positions=enc_pos,
                                  q_segment_ids=decoder_segment_ids, kv_segment_ids=encoder_segment_ids)

    y = self.shared_embedding(decoder_input_tokens.astype(jnp.int32))
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    y = layers.with_sharding_constraint(y, ("batch", "length", "embed"))
    for i in range(cfg.num_decoder_layers):
      y = DecoderLayer(cfg, self.token_mixer, self.cross_mixer, self.feature_mixer, name=f"layers_{i}")(
          y, encoded, self_ctx, cross_ctx, deterministic)
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="decoder_norm")(y)
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
    # Logits in float32 whatever the activation dtype: the softmax over the vocabulary needs the range.
    logits = layers.Dense(cfg.vocab_size, ("embed", "vocab"), dtype="float32", name="logits_dense")(y)
    return layers.with_sharding_constraint(logits, ("batch", "length", "vocab"))


class Transformer(nn.Module):
  """Encoder-decoder with t5x's call contract. Token id 0 is padding (masks come from the tokens).

  The defaults give T5.1.1; gin picks other mixers per stack (see gin/models/<arch>/).
  """
  config: T5Config
  encoder_token_mixer: Factory = Attention
  encoder_feature_mixer: Factory | None = GatedMlp
  decoder_token_mixer: Factory = Attention
  decoder_cross_mixer: Factory = Attention
  decoder_feature_mixer: Factory | None = GatedMlp
  encoder_input_layer: Factory | None = None

  def setup(self):
    cfg = self.config
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype)
    self.encoder = Encoder(cfg, self.token_embedder, self.encoder_token_mixer, self.encoder_feature_mixer,
                           self.encoder_input_layer)
    self.decoder = Decoder(cfg, self.token_embedder, self.decoder_token_mixer, self.decoder_cross_mixer,
                           self.decoder_feature_mixer)

  @property
  def packable(self) -> bool:
    """False when a mixer cannot mix packed examples exactly (it then refuses packed batches)."""
    factories = (self.encoder_token_mixer, self.encoder_feature_mixer, self.decoder_token_mixer,
                 self.decoder_cross_mixer, self.decoder_feature_mixer, self.encoder_input_layer)
    return all(getattr(f(config=self.config), "packable", True) for f in factories if f is not None)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None, *,
             enable_dropout=True):
    return self.encoder(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                        deterministic=not enable_dropout)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
             encoder_segment_ids=None, decoder_segment_ids=None, decoder_positions=None, *,
             enable_dropout=True, decode=False, max_decode_length=None):
    """Logits for decoder inputs given the encoder output; `decode=True` steps one position with the cache."""
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
                        encoder_segment_ids, decoder_segment_ids, decoder_positions,
                        deterministic=not enable_dropout, decode=decode, max_decode_length=max_decode_length)

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
