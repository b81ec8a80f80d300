"""Encoder-decoder stacks built from (token mixer, feature mixer) pairs, with t5x's module contract.

With the defaults this is T5.1.1 (Raffel et al. 2020 + the T5.1.1 changes: gated-GELU feed-forward, untied
embedding and output layer, RMS norms without bias, relative position biases shared per stack) with t5x's
parameter names. The mixers of each stack come from gin (`remixer_t5/model/mixers/`, one file per paper); a layer is
"token mixing + feature mixing" (HyperMixer paper, Fig. 1), each slot norm + mixer + dropout + residual, wired as
`T5Config.layer_layout` says (config.LAYER_LAYOUTS: HyperMixer paper App. F).
Absolute position embeddings (`Transformer.encoder_position_embeddings` / `decoder_position_embeddings`) can be
added to the token embeddings, for mixers that carry no position information of their own.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

from remixer_t5.kernels import bias as kernels_bias
from remixer_t5.model import layers
from remixer_t5.model.config import REMAT_POLICIES, T5Config  # noqa: F401  (gin files name network.T5Config)
from remixer_t5.model.mixers import base
from remixer_t5.model.mixers.attention import Attention
from remixer_t5.model.mixers.feed_forward import GatedMlp

Array = jax.Array
Factory = Callable[..., nn.Module]


# Slot names: t5x's for attention and the gated MLP (so T5 checkpoints line up), descriptive otherwise.
_ATTENTION_SLOTS = {"encoder": "attention", "self": "self_attention", "cross": "encoder_decoder_attention"}
_OTHER_SLOTS = {"encoder": "token_mixer", "self": "token_mixer", "cross": "cross_mixer"}
_NORM_NAMES = {"encoder_decoder_attention": "pre_cross_attention_layer_norm"}


def slot_name(factory: Factory, role: str) -> str:
  kind = getattr(factory, "KIND", "")
  if role == "feature":
    return kind or "feature_mixer"
  return (_ATTENTION_SLOTS if kind == "attention" else _OTHER_SLOTS)[role]


def _apply_slot(layer: nn.Module, x, factory: Factory, role: str, kv, ctx, deterministic: bool, residual=None):
  """The residual wrapper of every slot, as `T5Config.layer_layout` says (HyperMixer paper App. F):

  pre_norm and serialized: residual + dropout(mixer(norm(x))), where the residual is x except for the
  serialized layout's feature slot, whose residual is the layer's input (`residual`); post_norm:
  norm(x + dropout(mixer(x))). The norm is the project's RMSNorm (T5.1.1) in every layout."""
  cfg = layer.config
  name = slot_name(factory, role)
  post = cfg.layer_layout == "post_norm"
  mixer = factory(config=cfg, name=name)
  y = (
    x
    if post
    else layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name=_NORM_NAMES.get(name, f"pre_{name}_layer_norm"))(x)
  )
  if role == "feature":
    y = mixer(y, ctx, deterministic=deterministic)
  else:
    y = mixer(y, y if kv is None else kv, ctx, deterministic=deterministic)
  y = layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(y, deterministic=deterministic)
  if post:
    return layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name=f"post_{name}_layer_norm")(x + y)
  return (x if residual is None else residual) + y


def _feature_slot(layer: nn.Module, x, layer_input, ctx, deterministic: bool):
  """The layer's feature slot (its residual the layer's input in the serialized layout), then its output."""
  if layer.feature_mixer is not None:
    residual = layer_input if layer.config.layer_layout == "serialized" else None
    x = _apply_slot(layer, x, layer.feature_mixer, "feature", None, ctx, deterministic, residual)
  x = layers.with_sharding_constraint(x, ("batch", "length", "embed"))
  return (x, None) if layer.scanned else x


def _with_table(ctx: base.MixerContext, cfg: T5Config, table: Array | None) -> base.MixerContext:
  """`ctx` whose `relpos` applies the stack's relative position biases to `table`, when given (inside a lifted layer).

  A remat'd or scanned layer cannot call the stack's bound module (its parameter lives outside the lifted
  scope), so the stack hands the table in as an argument and this applies the same module to it."""
  if table is None:
    return ctx
  module = layers.RelativePositionBiases(
    cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads, cfg.dtype, parent=None
  )
  return ctx.replace(
    relpos=lambda q, k, bidirectional: module.apply(
      {"params": {"rel_embedding": table}}, q, k, bidirectional=bidirectional
    )
  )


class EncoderLayer(nn.Module):
  """`relpos_table` (set by remat/scan stacks) replaces `ctx.relpos`; `scanned` returns (x, None) for nn.scan."""

  config: T5Config
  token_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp
  scanned: bool = False

  @nn.compact
  def __call__(self, x, ctx: base.MixerContext, deterministic: bool, relpos_table: Array | None = None):
    ctx = _with_table(ctx, self.config, relpos_table)
    y = _apply_slot(self, x, self.token_mixer, "encoder", None, ctx, deterministic)
    return _feature_slot(self, y, x, ctx, deterministic)


class DecoderLayer(nn.Module):
  """As `EncoderLayer`; the table is the decoder self-attention's (cross-mixing has no position bias)."""

  config: T5Config
  token_mixer: Factory = Attention
  cross_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp
  scanned: bool = False

  @nn.compact
  def __call__(
    self,
    x,
    encoded,
    self_ctx: base.MixerContext,
    cross_ctx: base.MixerContext,
    deterministic: bool,
    relpos_table: Array | None = None,
  ):
    self_ctx = _with_table(self_ctx, self.config, relpos_table)
    y = _apply_slot(self, x, self.token_mixer, "self", None, self_ctx, deterministic)
    y = _apply_slot(self, y, self.cross_mixer, "cross", encoded, cross_ctx, deterministic)
    return _feature_slot(self, y, x, self_ctx, deterministic)


# Position of `deterministic` in the layers' __call__ (self = 0), static under remat.
_DETERMINISTIC_ARGNUM = {EncoderLayer: 3, DecoderLayer: 5}


def _uses_relpos(layer: nn.Module, cfg: T5Config, args: tuple, ctx_index: int, deterministic: bool) -> bool:
  """Whether a layer calls `ctx.relpos`: an abstract init of one unbound layer with a recording stand-in.

  Only needed when initialising a lifted stack, which must know before the lifted call whether to create the
  stack's table (attention-free stacks have none, as unrolled)."""
  calls = []

  def record(q, k, bidirectional):
    del bidirectional
    calls.append(True)
    if isinstance(q, int):  # lengths: the row indices
      return kernels_bias.RelativeBias(jnp.zeros((cfg.num_heads, q + k - 1), cfg.dtype), q)
    return jnp.zeros((q.shape[0], cfg.num_heads, q.shape[1], k.shape[1]), cfg.dtype)

  args = list(args)
  args[ctx_index] = args[ctx_index].replace(relpos=record)
  key = jax.random.PRNGKey(0)
  jax.eval_shape(lambda *a: layer.init({"params": key, "dropout": key}, *a, deterministic), *args)
  return bool(calls)


def _scan_cache_layout(target):
  """Decode caches of a scanned stack kept batch-major: [batch, layers, ...] leaves and one shared index.

  Inside the scan each layer's cache is a slice of a [layers, batch, ...] array and its position counter an
  element of a [layers] vector; outside, `decoding` gathers beams along axis 0 and treats 0-d leaves as the
  shared position, so the cache is stored transposed and with one counter (all layers step together).
  The static cache (`base.static_cache`) stays [layers, batch, ...]: the decode loop never gathers it."""

  def to_scan(tree, length):
    return jax.tree_util.tree_map(
      lambda x: jnp.broadcast_to(x, (length,)) if x.ndim == 0 else jnp.swapaxes(x, 0, 1), tree
    )

  def from_scan(tree):
    return jax.tree_util.tree_map(lambda x: x[0] if x.ndim == 1 else jnp.swapaxes(x, 0, 1), tree)

  return lambda length: nn.map_variables(target, "cache", lambda t: to_scan(t, length), from_scan, mutable=True)


def _run_layers(
  stack: nn.Module,
  layer_cls,
  factories: Mapping[str, Any],
  num_layers: int,
  relpos: nn.Module,
  x: Array,
  rest: tuple,
  ctx_index: int,
  deterministic: bool,
  decode: bool = False,
) -> Array:
  """The stack's layers applied in order: unrolled (default), remat'd per layer, or one nn.scan.

  `rest` are the layer arguments between `x` and `deterministic`; `rest[ctx_index]` is the context whose
  `relpos` is the stack's shared module. Remat is for training: a decode step is never rematerialised."""
  cfg = stack.config
  policy = None if decode else REMAT_POLICIES[cfg.remat_policy]
  if num_layers == 0:
    return x
  table = None
  # Initialising a remat'd stack unrolled gives the same parameters; only scan changes the tree.
  if cfg.scan_layers or (policy is not None and not stack.is_initializing()):
    if stack.is_initializing():
      needed = _uses_relpos(layer_cls(cfg, **factories, parent=None), cfg, (x, *rest), ctx_index + 1, deterministic)
      if needed:  # create the table now, outside the lifted layers
        relpos(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), bidirectional=True)
    else:
      needed = stack.has_variable("params", relpos.name)
    table = relpos.variables["params"]["rel_embedding"] if needed else None
    rest = tuple(a.replace(relpos=None) if i == ctx_index else a for i, a in enumerate(rest))
    if policy is not None:
      # prevent_cse guards unrolled remat against XLA merging the recomputation back; a scan body needs none.
      layer_cls = nn.remat(
        layer_cls, policy=policy, prevent_cse=not cfg.scan_layers, static_argnums=(_DETERMINISTIC_ARGNUM[layer_cls],)
      )
  if not cfg.scan_layers:
    for i in range(num_layers):
      x = layer_cls(cfg, **factories, name=f"layers_{i}")(x, *rest, deterministic, table)
    return x

  scanned = nn_partitioning.scan_with_axes(
    layer_cls,
    variable_axes={"params": 0, "cache": 0, base.STATIC_CACHE: 0},
    split_rngs={"params": True, "dropout": True},
    in_axes=(nn.broadcast,) * (len(rest) + 2),
    length=num_layers,
    axis_name="layers",
  )
  if decode:
    scanned = _scan_cache_layout(scanned)(num_layers)
  x, _ = scanned(cfg, **factories, scanned=True, name="layers")(x, *rest, deterministic, table)
  return x


def _positions(tokens: Array, positions: Array | None, segment_ids: Array | None = None) -> Array:
  """Given positions; else positions restarting in each packed segment; else 0..len-1."""
  if positions is not None:
    return positions.astype(jnp.int32)
  idx = jnp.arange(tokens.shape[-1], dtype=jnp.int32)[None, :]
  if segment_ids is None:
    return idx
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def _add_position_embeddings(stack: nn.Module, x: Array, positions: Array) -> Array:
  """x + the stack's absolute position embeddings at `positions` (none when `position_embeddings='none'`)."""
  if stack.position_embeddings == "none":
    return x
  cfg = stack.config
  emb = layers.AbsolutePositionEmbedding(
    stack.position_embeddings, cfg.emb_dim, stack.max_position_embeddings, cfg.dtype, name="position_embedder"
  )(positions)
  return x + emb


class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module
  token_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp
  input_layer: Factory | None = None  # e.g. the pNLP-Mixer projection instead of the token embedding
  position_embeddings: str = "none"  # layers.POSITION_EMBEDDINGS
  max_position_embeddings: int = 512

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None, *, deterministic=True):
    cfg = self.config
    # Created here, materialised only if a mixer calls it (attention), so attention-free stacks have no table.
    relpos = layers.RelativePositionBiases(
      cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads, cfg.dtype, name="relpos_bias"
    )
    mask = (tokens > 0).astype(jnp.float32)
    pos = _positions(tokens, positions, segment_ids)
    ctx = base.MixerContext(
      q_mask=mask,
      kv_mask=mask,
      q_positions=pos,
      kv_positions=pos,
      q_segment_ids=segment_ids,
      kv_segment_ids=segment_ids,
      relpos=relpos,
    )
    if self.input_layer is not None:
      x = self.input_layer(config=cfg, name="input_projection")(
        tokens.astype(jnp.int32), ctx, deterministic=deterministic
      )
    else:
      x = self.shared_embedding(tokens.astype(jnp.int32))
    x = _add_position_embeddings(self, x, pos)
    x = layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(x, deterministic=deterministic)
    x = layers.with_sharding_constraint(x, ("batch", "length", "embed"))
    x = _run_layers(
      self,
      EncoderLayer,
      dict(token_mixer=self.token_mixer, feature_mixer=self.feature_mixer),
      cfg.num_encoder_layers,
      relpos,
      x,
      (ctx,),
      0,
      deterministic,
    )
    x = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="encoder_norm")(x)
    return layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(x, deterministic=deterministic)


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module
  token_mixer: Factory = Attention
  cross_mixer: Factory = Attention
  feature_mixer: Factory | None = GatedMlp
  position_embeddings: str = "none"  # layers.POSITION_EMBEDDINGS
  max_position_embeddings: int = 512

  @nn.compact
  def __call__(
    self,
    encoded,
    encoder_input_tokens,
    decoder_input_tokens,
    decoder_target_tokens,
    encoder_segment_ids=None,
    decoder_segment_ids=None,
    positions=None,
    *,
    deterministic=True,
    decode=False,
    max_decode_length=None,
  ):
    cfg = self.config
    relpos = layers.RelativePositionBiases(
      cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads, cfg.dtype, name="relpos_bias"
    )
    enc_mask = (encoder_input_tokens > 0).astype(jnp.float32)
    if decode:
      # One position per call (after the cache-creating first call); mixers track the step in their cache.
      length = max_decode_length or decoder_input_tokens.shape[-1]
      pos = jnp.arange(length, dtype=jnp.int32)[None, :]
      dec_mask = jnp.ones(decoder_input_tokens.shape, jnp.float32)
    else:
      pos = _positions(decoder_input_tokens, positions, decoder_segment_ids)
      dec_mask = (decoder_target_tokens > 0).astype(jnp.float32)
    self_ctx = base.MixerContext(
      q_mask=dec_mask,
      kv_mask=dec_mask,
      q_positions=pos,
      kv_positions=pos,
      q_segment_ids=decoder_segment_ids,
      kv_segment_ids=decoder_segment_ids,
      causal=True,
      decode=decode,
      max_decode_length=max_decode_length,
      relpos=relpos,
    )
    enc_pos = _positions(encoder_input_tokens, None, encoder_segment_ids)
    cross_ctx = base.MixerContext(
      q_mask=dec_mask,
      kv_mask=enc_mask,
      q_positions=pos,
      kv_positions=enc_pos,
      q_segment_ids=decoder_segment_ids,
      kv_segment_ids=encoder_segment_ids,
      static_kv=decode,
    )

    y = self.shared_embedding(decoder_input_tokens.astype(jnp.int32))
    if decode and self.position_embeddings != "none":
      # A decode step is not told its position: the stack counts its steps in the cache (the first call,
      # which only creates the cache, carries every position).
      stepping = self.has_variable("cache", "position_index")
      index = base.cache_index(self, "position_index")
      if stepping:
        if y.shape[1] != 1:
          raise ValueError(f"decode step expects one position at a time, got length {y.shape[1]}")
        y = _add_position_embeddings(self, y, jnp.broadcast_to(index.value, (1, 1)))
        index.value = index.value + 1
      else:
        y = _add_position_embeddings(self, y, pos[:, : y.shape[1]])
    else:
      y = _add_position_embeddings(self, y, pos)
    y = layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(y, deterministic=deterministic)
    y = layers.with_sharding_constraint(y, ("batch", "length", "embed"))
    y = _run_layers(
      self,
      DecoderLayer,
      dict(token_mixer=self.token_mixer, cross_mixer=self.cross_mixer, feature_mixer=self.feature_mixer),
      cfg.num_decoder_layers,
      relpos,
      y,
      (encoded, self_ctx, cross_ctx),
      1,
      deterministic,
      decode,
    )
    y = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name="decoder_norm")(y)
    y = layers.Dropout(cfg.dropout_rate, broadcast_dims=(-2,), impl=cfg.dropout_impl)(y, deterministic=deterministic)
    # Logits in float32 whatever the activation dtype: the softmax over the vocabulary needs the range (with
    # `logits_in_activation_dtype`, from activation-dtype operands).
    logits = layers.Dense(
      cfg.vocab_size,
      ("embed", "vocab"),
      dtype=cfg.dtype if cfg.logits_in_activation_dtype else "float32",
      accumulate="float32",
      name="logits_dense",
    )(y)
    return layers.with_sharding_constraint(logits, ("batch", "length", "vocab"))


class Transformer(nn.Module):
  """Encoder-decoder with t5x's call contract. Token id 0 is padding (masks come from the tokens).

  The defaults give T5.1.1; gin picks other mixers per stack (see gin/models/<arch>/)."""

  config: T5Config
  encoder_token_mixer: Factory = Attention
  encoder_feature_mixer: Factory | None = GatedMlp
  decoder_token_mixer: Factory = Attention
  decoder_cross_mixer: Factory = Attention
  decoder_feature_mixer: Factory | None = GatedMlp
  encoder_input_layer: Factory | None = None
  # Absolute position embeddings added to each stack's token embeddings (layers.AbsolutePositionEmbedding):
  # 'none' (T5: relative biases inside attention), 'sinusoidal' or 'learned' (a max_position_embeddings table).
  encoder_position_embeddings: str = "none"
  decoder_position_embeddings: str = "none"
  max_position_embeddings: int = 512

  def setup(self):
    cfg = self.config.for_target()  # dtype 'auto' resolved for the platform compiled for
    for which in ("encoder", "decoder"):
      kind = getattr(self, f"{which}_position_embeddings")
      if kind not in layers.POSITION_EMBEDDINGS:
        raise ValueError(
          f"Transformer.{which}_position_embeddings must be one of {layers.POSITION_EMBEDDINGS}, got {kind!r}"
        )
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype)
    self.encoder = Encoder(
      cfg,
      self.token_embedder,
      self.encoder_token_mixer,
      self.encoder_feature_mixer,
      self.encoder_input_layer,
      self.encoder_position_embeddings,
      self.max_position_embeddings,
    )
    self.decoder = Decoder(
      cfg,
      self.token_embedder,
      self.decoder_token_mixer,
      self.decoder_cross_mixer,
      self.decoder_feature_mixer,
      self.decoder_position_embeddings,
      self.max_position_embeddings,
    )

  @property
  def packable(self) -> bool:
    """False when a mixer cannot mix packed examples exactly (it then refuses packed batches)."""
    factories = (
      self.encoder_token_mixer,
      self.encoder_feature_mixer,
      self.decoder_token_mixer,
      self.decoder_cross_mixer,
      self.decoder_feature_mixer,
      self.encoder_input_layer,
    )
    return all(getattr(f(config=self.config), "packable", True) for f in factories if f is not None)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None, *, enable_dropout=True):
    return self.encoder(encoder_input_tokens, encoder_segment_ids, encoder_positions, deterministic=not enable_dropout)

  def decode(
    self,
    encoded,
    encoder_input_tokens,
    decoder_input_tokens,
    decoder_target_tokens,
    encoder_segment_ids=None,
    decoder_segment_ids=None,
    decoder_positions=None,
    *,
    enable_dropout=True,
    decode=False,
    max_decode_length=None,
  ):
    """Logits for decoder inputs given the encoder output; `decode=True` steps one position with the cache."""
    return self.decoder(
      encoded,
      encoder_input_tokens,
      decoder_input_tokens,
      decoder_target_tokens,
      encoder_segment_ids,
      decoder_segment_ids,
      decoder_positions,
      deterministic=not enable_dropout,
      decode=decode,
      max_decode_length=max_decode_length,
    )

  def __call__(
    self,
    encoder_input_tokens,
    decoder_input_tokens,
    decoder_target_tokens,
    encoder_segment_ids=None,
    decoder_segment_ids=None,
    encoder_positions=None,
    decoder_positions=None,
    *,
    enable_dropout=True,
    decode=False,
  ):
    if (encoder_segment_ids is None) != (decoder_segment_ids is None):
      raise ValueError("packed inputs need both encoder_segment_ids and decoder_segment_ids")
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions, enable_dropout=enable_dropout)
    return self.decode(
      encoded,
      encoder_input_tokens,
      decoder_input_tokens,
      decoder_target_tokens,
      encoder_segment_ids,
      decoder_segment_ids,
      decoder_positions,
      enable_dropout=enable_dropout,
      decode=decode,
    )


_STACKS = ("encoder", "decoder")


def unstack_scanned_params(params: Mapping) -> dict:
  """A `scan_layers` tree (`<stack>/layers/...` [num_layers, ...]) as the unrolled one (`<stack>/layers_<i>/...`).

  Works on any tree shaped like the parameters (e.g. optimizer moments); other entries pass through."""
  out = dict(params)
  for stack in _STACKS:
    if stack in out and "layers" in out[stack]:
      tree = dict(out[stack])
      stacked = tree.pop("layers")
      sizes = {x.shape[0] for x in jax.tree_util.tree_leaves(stacked)}
      if len(sizes) != 1:
        raise ValueError(f"{stack}/layers leaves disagree on the number of layers: {sorted(sizes)}")
      for i in range(sizes.pop()):
        tree[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
      out[stack] = tree
  return out


def stack_params(params: Mapping) -> dict:
  """The inverse: an unrolled tree (`<stack>/layers_<i>/...`) as a `scan_layers` one (`<stack>/layers/...`)."""
  out = dict(params)
  for stack in _STACKS:
    if stack not in out:
      continue
    tree = dict(out[stack])
    names = [k for k in tree if k.startswith("layers_") and k[len("layers_") :].isdigit()]
    if not names:
      continue
    indices = sorted(int(k[len("layers_") :]) for k in names)
    if indices != list(range(len(indices))):
      raise ValueError(f"{stack} layers are not numbered 0..{len(indices) - 1}: {indices}")
    per_layer = [tree.pop(f"layers_{i}") for i in indices]
    try:
      tree["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per_layer)
    except ValueError as e:  # different structures: these layers cannot share one scan
      raise ValueError(f"{stack} layers differ in structure and cannot be stacked for scan_layers: {e}") from e
    out[stack] = tree
  return out
