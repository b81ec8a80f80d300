"""Hugging Face T5 v1.1 interop: read/write `T5ForConditionalGeneration` checkpoints as `network.Transformer`.

Only T5 v1.1-style models (`feed_forward_proj: "gated-gelu"`, e.g. google/t5-v1_1-*, mT5) map onto `network.Transformer`
(parameter names: `_weight_map`). Torch `Linear` weights are (out, in) and our Dense kernels (in, out), so every kernel
is the transpose of its HF weight; relative position tables are (buckets, heads) in HF and (heads, buckets) here.

The output layer on import (`lm_head_convention`): `lm_head.weight` when the checkpoint has it (untied even if
the config says tied, as transformers 5.x does when both tensors are present and differ), else `shared.weight`
if the config ties embeddings (a missing-weight error otherwise). It is scaled by `d_model**-0.5` (the original
T5 1.0's tied head) when the config says `scale_decoder_outputs: true`, or has no such key and
`tie_word_embeddings` is not false; the scale is folded into `logits_dense/kernel = W.T * d_model**-0.5`. So
transformers 4.x's v1.1 configs (`tie_word_embeddings: false`), 5.x's (`tie_word_embeddings: true` with
`scale_decoder_outputs: false`) and T5 1.0's each read as the model they describe. Export always writes the v1.1
form (untied `lm_head.weight`, `tie_word_embeddings: false`, `scale_decoder_outputs: false`), which
transformers 4.x and 5.x both load as the same model.

Import needs only numpy + safetensors (+ jax/flax for the module); torch is imported lazily, only to read
`pytorch_model.bin` checkpoints (`pip install remixer_t5[hf]`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from typing import Any, Mapping

import numpy as np
import safetensors.numpy
import sentencepiece as spm
from flax import traverse_util
from sentencepiece import sentencepiece_model_pb2 as pb

from remixer_t5.model import network

SUPPORTED_FEED_FORWARD_PROJ = ("gated-gelu",)
SUPPORTED_MODEL_TYPES = ("t5", "mt5")
CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, TORCH_NAME, TORCH_INDEX_NAME)

# HF's own T5Config defaults, used for keys a config.json leaves out (so we read it as transformers does).
_HF_DEFAULTS = dict(
  vocab_size=32128,
  d_model=512,
  d_kv=64,
  d_ff=2048,
  num_layers=6,
  num_heads=8,
  relative_attention_num_buckets=32,
  relative_attention_max_distance=128,
  dropout_rate=0.1,
  layer_norm_epsilon=1e-6,
  feed_forward_proj="relu",
)
# Present in some HF checkpoints, unused by HF itself (its `_keys_to_ignore_on_load_unexpected`).
_IGNORED_KEYS = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
# Copies of shared.weight that older checkpoints (pytorch_model.bin) store.
_EMBED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")

Params = dict


# --- config -------------------------------------------------------------------------------------------------
def config_from_hf(hf_config: Mapping[str, Any]) -> network.T5Config:
  """`network.T5Config` of an HF T5 v1.1 config.json dict. Anything but gated-GELU is a ValueError."""
  get = lambda key: hf_config.get(key, _HF_DEFAULTS.get(key))
  model_type = hf_config.get("model_type", "t5")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
      f"HF config model_type={model_type!r} is not supported; expected one of "
      f"{SUPPORTED_MODEL_TYPES} (T5 v1.1 architecture)"
    )
  ff = get("feed_forward_proj")
  if ff not in SUPPORTED_FEED_FORWARD_PROJ:
    raise ValueError(
      f"HF config feed_forward_proj={ff!r} is not supported: only {SUPPORTED_FEED_FORWARD_PROJ} "
      "(T5 v1.1, gated GELU) maps onto network.Transformer; original T5 ('relu') does not"
    )
  num_layers, num_decoder_layers = get("num_layers"), hf_config.get("num_decoder_layers")
  return network.T5Config(
    vocab_size=get("vocab_size"),
    emb_dim=get("d_model"),
    num_heads=get("num_heads"),
    num_encoder_layers=num_layers,
    num_decoder_layers=num_layers if num_decoder_layers is None else num_decoder_layers,
    head_dim=get("d_kv"),
    mlp_dim=get("d_ff"),
    mlp_activations=("gelu", "linear"),
    dropout_rate=float(get("dropout_rate")),
    relpos_num_buckets=get("relative_attention_num_buckets"),
    relpos_max_distance=get("relative_attention_max_distance"),
    layer_norm_epsilon=float(get("layer_norm_epsilon")),
    dtype="auto",
  )


def config_to_hf(cfg: network.T5Config) -> dict:
  """config.json dict that transformers 4.x and 5.x both load as this T5 v1.1 (untied, unscaled head)."""
  if tuple(cfg.mlp_activations) != ("gelu", "linear"):
    raise ValueError(
      f"T5Config.mlp_activations={tuple(cfg.mlp_activations)!r} has no HF T5 equivalent; "
      "only ('gelu', 'linear') (feed_forward_proj 'gated-gelu') can be exported"
    )
  return {
    "architectures": ["T5ForConditionalGeneration"],
    "model_type": "t5",
    "vocab_size": cfg.vocab_size,
    "d_model": cfg.emb_dim,
    "d_kv": cfg.head_dim,
    "d_ff": cfg.mlp_dim,
    "num_layers": cfg.num_encoder_layers,
    "num_decoder_layers": cfg.num_decoder_layers,
    "num_heads": cfg.num_heads,
    "relative_attention_num_buckets": cfg.relpos_num_buckets,
    "relative_attention_max_distance": cfg.relpos_max_distance,
    "dropout_rate": cfg.dropout_rate,
    "layer_norm_epsilon": cfg.layer_norm_epsilon,
    "initializer_factor": 1.0,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "is_encoder_decoder": True,
    "use_cache": True,
    # 4.x: false = untied lm_head, no output scaling. 5.x forces tying in its config object but reads
    # the scaling from this key (or from tie_word_embeddings: false) and unties a differing lm_head.
    "tie_word_embeddings": False,
    "scale_decoder_outputs": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
  }


def lm_head_convention(hf_config: Mapping[str, Any] | None, has_lm_head: bool) -> tuple[bool, bool]:
  """(use shared.weight as output weight, scale by d_model**-0.5) for a checkpoint; see module docstring."""
  if hf_config is None:  # plain T5 v1.1
    return (not has_lm_head), False
  tied = hf_config.get("tie_word_embeddings", True) is not False  # transformers' default is True
  scale = hf_config.get("scale_decoder_outputs")
  return not has_lm_head and tied, tied if scale is None else bool(scale)


# --- weights ------------------------------------------------------------------------------------------------
def _weight_map(cfg: network.T5Config) -> list[tuple[str, tuple[str, ...], bool, tuple[int, ...]]]:
  """(HF name, our param path, transpose, HF shape) of every weight of the model but shared/lm_head.weight."""
  e, inner, m = cfg.emb_dim, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  attention = {
    "q": ("query", (inner, e)),
    "k": ("key", (inner, e)),
    "v": ("value", (inner, e)),
    "o": ("out", (e, inner)),
  }
  # A block's sublayers in HF's order (layer.0, layer.1, ...): (HF module, our pre-norm, our module, weights).
  mlp = (
    "DenseReluDense",
    "pre_mlp_layer_norm",
    "mlp",
    {"wi_0": ("wi_0", (m, e)), "wi_1": ("wi_1", (m, e)), "wo": ("wo", (e, m))},
  )
  encoder = [("SelfAttention", "pre_attention_layer_norm", "attention", attention), mlp]
  decoder = [
    ("SelfAttention", "pre_self_attention_layer_norm", "self_attention", attention),
    ("EncDecAttention", "pre_cross_attention_layer_norm", "encoder_decoder_attention", attention),
    mlp,
  ]
  out = []
  for stack, num_layers, sublayers in (
    ("encoder", cfg.num_encoder_layers, encoder),
    ("decoder", cfg.num_decoder_layers, decoder),
  ):
    out.append(
      (
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        (stack, "relpos_bias", "rel_embedding"),
        True,
        (cfg.relpos_num_buckets, cfg.num_heads),
      )
    )
    for i in range(num_layers):
      for j, (hf, norm, ours, weights) in enumerate(sublayers):
        block, layer = f"{stack}.block.{i}.layer.{j}", (stack, f"layers_{i}")
        out.append((f"{block}.layer_norm.weight", layer + (norm, "scale"), False, (e,)))
        out += [
          (f"{block}.{hf}.{a}.weight", layer + (ours, b, "kernel"), True, shape) for a, (b, shape) in weights.items()
        ]
    out.append((f"{stack}.final_layer_norm.weight", (stack, f"{stack}_norm", "scale"), False, (e,)))
  return out


def hf_weight_shapes(cfg: network.T5Config) -> dict[str, tuple[int, ...]]:
  """Expected HF state_dict shapes (torch layout) of a T5 v1.1 with an untied lm_head."""
  shapes = {"shared.weight": (cfg.vocab_size, cfg.emb_dim), "lm_head.weight": (cfg.vocab_size, cfg.emb_dim)}
  return shapes | {name: shape for name, _, _, shape in _weight_map(cfg)}


def _float32(x) -> np.ndarray:
  return np.asarray(x).astype(np.float32)  # also from bfloat16/float16 (ml_dtypes) arrays


def hf_state_dict_to_params(
  state: Mapping[str, Any], cfg: network.T5Config, *, hf_config: Mapping[str, Any] | None = None
) -> Params:
  """Nested float32 numpy params of `network.Transformer(cfg)` from an HF T5 state dict.

  `hf_config` (the config.json dict) decides the output-layer convention (module docstring); without it
  the checkpoint must be a plain T5 v1.1 with `lm_head.weight`. Missing or unexpected weights and shape
  mismatches raise one ValueError listing them all."""
  state = dict(state)
  for key in _IGNORED_KEYS:
    state.pop(key, None)
  # shared.weight, or a tied copy of it under the stacks' names.
  copies = {k: state.pop(k) for k in _EMBED_COPIES if k in state}
  if "shared.weight" not in state and copies:
    state["shared.weight"] = copies[next(iter(copies))]
  has_lm_head = "lm_head.weight" in state
  use_shared, scale = lm_head_convention(hf_config, has_lm_head)

  expected = hf_weight_shapes(cfg)
  if use_shared:
    del expected["lm_head.weight"]
  missing = sorted(k for k in expected if k not in state)
  unexpected = sorted(k for k in state if k not in expected)
  wrong = [
    f"{k}: expected {expected[k]}, got {tuple(np.shape(state[k]))}"
    for k in sorted(expected)
    if k in state and tuple(np.shape(state[k])) != expected[k]
  ]
  wrong += [
    f"{k}: expected {expected['shared.weight']} equal to shared.weight, got a different "
    f"{tuple(np.shape(v))} tensor (untied input embeddings are not supported)"
    for k, v in copies.items()
    if "shared.weight" in state
    and not (np.shape(v) == np.shape(state["shared.weight"]) and np.array_equal(v, state["shared.weight"]))
  ]
  if missing or unexpected or wrong:
    lines = [
      "HF T5 checkpoint does not match the config "
      f"(emb_dim={cfg.emb_dim}, heads={cfg.num_heads}x{cfg.head_dim}, mlp_dim={cfg.mlp_dim}, "
      f"vocab={cfg.vocab_size}, layers={cfg.num_encoder_layers}+{cfg.num_decoder_layers}, "
      f"relpos_buckets={cfg.relpos_num_buckets}):"
    ]
    if missing:
      lines.append(f"missing weights ({len(missing)}): " + ", ".join(f"{k} {expected[k]}" for k in missing))
    if unexpected:
      lines.append(
        f"unexpected weights ({len(unexpected)}): " + ", ".join(f"{k} {tuple(np.shape(state[k]))}" for k in unexpected)
      )
    if wrong:
      lines.append("shape mismatches: " + "; ".join(wrong))
    raise ValueError("\n".join(lines))

  flat = {("token_embedder", "embedding"): _float32(state["shared.weight"])}
  for name, path, transpose, _ in _weight_map(cfg):
    w = _float32(state[name])
    flat[path] = np.ascontiguousarray(w.T) if transpose else w
  head = _float32(state["shared.weight"] if use_shared else state["lm_head.weight"]).T
  if scale:
    head = head * np.float32(cfg.emb_dim**-0.5)
  flat[("decoder", "logits_dense", "kernel")] = np.ascontiguousarray(head)
  return traverse_util.unflatten_dict(flat)


def is_scanned(params: Mapping) -> bool:
  """Whether a stack of `params` is scanned (`T5Config.scan_layers=True`): its layers stored as one subtree
  `<stack>/layers/...` with a leading [num_layers] axis, where an unrolled stack has `<stack>/layers_<i>/...`."""
  return any(isinstance(params.get(stack), Mapping) and "layers" in params[stack] for stack in ("encoder", "decoder"))


def params_to_hf_state_dict(params: Mapping, cfg: network.T5Config) -> dict[str, np.ndarray]:
  """HF T5 v1.1 state dict (float32 numpy, torch layout) of `network.Transformer` params.

  Writes what transformers' own `save_pretrained` writes for an untied T5 v1.1: `shared.weight`, `lm_head.weight` and
  the blocks (the stacks' `embed_tokens.weight` are tied to `shared.weight` and left out, as transformers does).
  Scanned stacks (`is_scanned`) are unstacked first (`network.unstack_scanned_params`): HF has one block per
  layer, and layer i of the scan is the unrolled model's `layers_<i>`, so both trees export the same weights."""
  if is_scanned(params):
    params = network.unstack_scanned_params(params)
  head = (cfg.vocab_size, cfg.emb_dim)
  entries = [
    ("shared.weight", ("token_embedder", "embedding"), False, head),
    ("lm_head.weight", ("decoder", "logits_dense", "kernel"), True, head),
  ] + _weight_map(cfg)
  flat, state, problems = traverse_util.flatten_dict(params), {}, []
  for name, path, transpose, shape in entries:
    if path not in flat:
      problems.append(f"missing param {'/'.join(path)} (for {name})")
      continue
    w = _float32(flat[path])
    w = np.ascontiguousarray(w.T if transpose else w)
    if w.shape != shape:
      problems.append(
        f"param {'/'.join(path)}: expected {shape[::-1] if transpose else shape}, "
        f"got {w.shape[::-1] if transpose else w.shape}"
      )
      continue
    state[name] = w
  known = {p for _, p, _, _ in entries}
  extra = sorted("/".join(p) for p in flat if p not in known)
  if extra:
    problems.append("unexpected params: " + ", ".join(extra))
  if problems:
    raise ValueError("params do not match the T5 v1.1 config:\n" + "\n".join(problems))
  return state


# --- checkpoints --------------------------------------------------------------------------------------------
def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of a .safetensors file as numpy (bfloat16 as ml_dtypes' type, which safetensors reads)."""
  return safetensors.numpy.load_file(path)


def _read_torch(path: str) -> dict[str, np.ndarray]:
  try:
    import torch
  except ImportError as e:
    raise ImportError(
      f"reading {path} needs torch: pip install remixer_t5[hf] (or convert the checkpoint to model.safetensors)"
    ) from e
  state = torch.load(path, map_location="cpu", weights_only=True)
  return {
    k: v.detach().to(torch.float32).numpy() if v.is_floating_point() else v.detach().numpy() for k, v in state.items()
  }


def _read_sharded(directory: str, index_name: str, reader) -> dict[str, np.ndarray]:
  with open(os.path.join(directory, index_name)) as f:
    weight_map = json.load(f)["weight_map"]
  state = {}
  for shard in sorted(set(weight_map.values())):
    shard_path = os.path.join(directory, shard)
    if not os.path.isfile(shard_path):
      raise FileNotFoundError(f"{index_name} in {directory} lists shard {shard}, which does not exist")
    state.update(reader(shard_path))
  return state


def read_hf_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json dict, state dict of numpy arrays) of an HF checkpoint directory.

  Weights from model.safetensors, model.safetensors.index.json (sharded), pytorch_model.bin or
  pytorch_model.bin.index.json, in that order of preference (torch only for the .bin ones)."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(
      f"HF checkpoint directory {path} does not exist (expected a directory with "
      f"{CONFIG_NAME} and one of {', '.join(WEIGHT_FILES)})"
    )
  config_path = os.path.join(path, CONFIG_NAME)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"no {CONFIG_NAME} in HF checkpoint directory {path}")
  with open(config_path) as f:
    hf_config = json.load(f)
  for name, read in zip(WEIGHT_FILES, (_read_safetensors, _read_safetensors, _read_torch, _read_torch)):
    if os.path.isfile(os.path.join(path, name)):
      sharded = name in (SAFETENSORS_INDEX_NAME, TORCH_INDEX_NAME)
      return hf_config, _read_sharded(path, name, read) if sharded else read(os.path.join(path, name))
  raise FileNotFoundError(f"no weights in HF checkpoint directory {path}: looked for {', '.join(WEIGHT_FILES)}")


# --- tokenizer ----------------------------------------------------------------------------------------------
SPIECE_NAME = "spiece.model"
TOKENIZER_JSON_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"
TOKENIZER_FILES = (SPIECE_NAME, TOKENIZER_JSON_NAME, TOKENIZER_CONFIG_NAME, SPECIAL_TOKENS_MAP_NAME)
_T5_SPECIAL_PIECES = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 in T5's SentencePiece models (and ours)
_SPACE = "\u2581"  # SentencePiece's whitespace mark "▁"


def fast_tokenizer_json(spiece_model: bytes, extra_ids: int = 100) -> dict:
  """`tokenizer.json` (the `tokenizers` library's serialization) of T5's tokenizer over `spiece_model`, as a dict.

  It mirrors what transformers' `T5Converter` (an `SpmConverter`, transformers/convert_slow_tokenizer.py) makes of
  a T5 SentencePiece model, but is written here from the model proto alone, so exporting needs neither
  transformers nor tokenizers, and it follows the proto's normalizer spec step by step so that
  `tokenizers.Tokenizer.from_file` encodes text to the ids `SentencePieceProcessor` and seqio give (+ `</s>`):

  * model: `Unigram` over the pieces and their scores, the trainer spec's `unk_id` and byte fallback, then the
    `extra_ids` sentinels `<extra_id_{extra_ids-1}>` ... `<extra_id_0>` (score 0), `<extra_id_0>` the last id;
  * normalizer: the proto's `precompiled_charsmap` as a `Precompiled` normalizer (T5's is NFKC and folds
    newlines, tabs and other spaces to " "), then, with `remove_extra_whitespaces`, trailing spaces dropped and
    runs of spaces made one (a leading run becomes the "▁" that SentencePiece's dummy prefix gives);
  * pre-tokenizer: `Metaspace` (" " -> "▁") with SentencePiece's dummy prefix on the first chunk of the text only
    (`prepend_scheme: "first"`: none after a sentinel, as SentencePiece adds one to the whole text) and no split
    (SentencePiece runs one Viterbi pass over the text; its pieces never hold an inner "▁" anyway);
  * decoder: `Metaspace` ("▁" -> " ", the dummy prefix's space dropped), or for byte-fallback models "▁" -> " ",
    `ByteFallback`, `Fuse` and a one-space `Strip`; sentinels decode to " <extra_id_N>" as seqio's pieces
    "▁<extra_id_N>" do;
  * post-processor: `TemplateProcessing` appending `</s>` to each sequence, as `T5Converter`'s;
  * added tokens: the control and unknown pieces (`<pad>` 0, `</s>` 1, `<unk>` 2) and the sentinels, special
    and matched in the raw text; a sentinel takes the whitespace before it (`lstrip`), as seqio's piece
    "▁<extra_id_N>" takes the "▁" before it.

  It differs from SentencePiece only where the text names special pieces, and on some whitespace of models that keep
  extra whitespace: "<pad>", "</s>", "<unk>" in the text are those tokens here (SentencePiece spells them out); a
  sentinel right after a non-space ("a<extra_id_0>", where seqio's "▁<extra_id_0>" does not match) is a sentinel here;
  `<unk>` decodes as "<unk>", not " ⁇ "; and without `remove_extra_whitespaces` (e.g. the COGS word vocabularies) text
  that starts with spaces or "▁" gets one "▁" fewer, and a sentinel takes all the whitespace before it, not one "▁".
  Models that are not unigram ones starting words with "▁" are refused (ValueError)."""
  proto = _t5_like_proto(spiece_model, extra_ids)
  trainer, norm = proto.trainer_spec, proto.normalizer_spec
  Piece = pb.ModelProto.SentencePiece
  n = len(proto.pieces)
  sentinels = [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]  # ids n, n + 1, ...: <extra_id_0> last

  def added(token_id, content, special, lstrip=False):
    return {
      "id": token_id,
      "content": content,
      "single_word": False,
      "lstrip": lstrip,
      "rstrip": False,
      "normalized": False,
      "special": special,
    }

  added_tokens = [
    added(i, p.piece, p.type != Piece.USER_DEFINED)
    for i, p in enumerate(proto.pieces)
    if p.type in (Piece.CONTROL, Piece.UNKNOWN, Piece.USER_DEFINED)
  ]
  added_tokens += [added(n + i, s, True, lstrip=True) for i, s in enumerate(sentinels)]

  def replace(regex, content):
    return {"type": "Replace", "pattern": {"Regex": regex}, "content": content}

  normalizers = []
  if norm.precompiled_charsmap:
    normalizers.append(
      {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(norm.precompiled_charsmap).decode("ascii")}
    )
  if norm.remove_extra_whitespaces:
    normalizers += [replace(r" +\z", ""), replace(" {2,}", " ")]
  # Per token, before the rest: a sentinel decodes as seqio's piece "▁<extra_id_N>".
  decoders = [replace(r"\A<(?=extra_id_\d+>\z)", _SPACE + "<")] if extra_ids else []
  if trainer.byte_fallback:
    decoders += [
      {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
      {"type": "ByteFallback"},
      {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]
  else:
    decoders.append({"type": "Metaspace", "replacement": _SPACE, "prepend_scheme": "first", "split": True})
  eos = {"SpecialToken": {"id": "</s>", "type_id": 0}}
  seq_a, seq_b = ({"Sequence": {"id": x, "type_id": 0}} for x in "AB")
  return {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": added_tokens,
    "normalizer": {"type": "Sequence", "normalizers": normalizers} if normalizers else None,
    "pre_tokenizer": {"type": "Metaspace", "replacement": _SPACE, "prepend_scheme": "first", "split": False},
    "post_processor": {
      "type": "TemplateProcessing",
      "single": [seq_a, eos],
      "pair": [seq_a, eos, seq_b, eos],
      "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}},
    },
    "decoder": {"type": "Sequence", "decoders": decoders} if len(decoders) > 1 else decoders[0],
    "model": {
      "type": "Unigram",
      "unk_id": trainer.unk_id,
      "byte_fallback": trainer.byte_fallback,
      "vocab": [[p.piece, p.score] for p in proto.pieces] + [[s, 0.0] for s in sentinels],
    },
  }


def _t5_like_proto(spiece_model: bytes, extra_ids: int):
  """The SentencePiece model proto, refused (ValueError) unless it is a unigram model starting words with "▁"
  and without a denormalizer, as T5's tokenizer is."""
  proto = pb.ModelProto.FromString(spiece_model)
  trainer, norm = proto.trainer_spec, proto.normalizer_spec
  if trainer.model_type != pb.TrainerSpec.UNIGRAM:
    raise ValueError(
      f"the SentencePiece model is a {pb.TrainerSpec.ModelType.Name(trainer.model_type)} model; "
      "T5's tokenizer is a unigram one"
    )
  if not (norm.escape_whitespaces and norm.add_dummy_prefix) or trainer.treat_whitespace_as_suffix:
    raise ValueError(
      "the SentencePiece model does not start words with '\u2581' (escape_whitespaces or "
      "add_dummy_prefix off, or treat_whitespace_as_suffix on); T5's tokenizer does"
    )
  if proto.denormalizer_spec.precompiled_charsmap:
    raise ValueError("the SentencePiece model has a denormalizer, which HF's tokenizer cannot apply")
  if extra_ids < 0:
    raise ValueError(f"extra_ids must be >= 0, got {extra_ids}")
  return proto


def hf_tokenizer_files(spiece_model: bytes, extra_ids: int = 100, model_max_length: int = 512) -> dict[str, bytes]:
  """{file name: bytes} of a T5 tokenizer for transformers' `AutoTokenizer` (4.x or 5.x, sentencepiece or not).

  As in the published google/t5-v1_1-* repositories: `spiece.model` is the plain SentencePiece model (pad=0, eos=1,
  unk=2, no sentinels inside it) and the tokenizer adds `extra_ids` sentinels after its pieces in reverse order,
  `<extra_id_0>` = the last id; seqio's `SentencePieceVocabulary(extra_ids=...)` numbers them the same way, so ids
  agree. `tokenizer.json` is the same tokenizer for the `tokenizers` library (`fast_tokenizer_json`), so transformers
  needs no `sentencepiece` (without it transformers 5 cannot read `spiece.model` and falls back to a tiktoken reader,
  which fails). `tokenizer_config.json` names `PreTrainedTokenizerFast` (`TokenizersBackend` in transformers 5), which
  runs `tokenizer.json` as written: transformers 5's `T5Tokenizer` would take only its vocabulary and rebuild the rest
  its own way (no byte fallback, a "▁" added to text right after a sentinel), so its ids would differ from seqio's. It
  also carries `extra_ids` and the sentinels as `additional_special_tokens` (also in `special_tokens_map.json`);
  `model_max_length` 512 is T5's value (transformers only warns beyond it; relative positions have no hard limit)."""
  try:
    sp = spm.SentencePieceProcessor(model_proto=spiece_model)
  except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError for bad protos
    raise ValueError(f"not a SentencePiece model ({len(spiece_model)} bytes): {e}") from e
  n = sp.get_piece_size()
  special = tuple(sp.id_to_piece(i) for i in range(min(3, n)))
  if special != _T5_SPECIAL_PIECES:
    raise ValueError(
      f"the SentencePiece model's ids 0, 1, 2 are {special}; T5's tokenizer needs {_T5_SPECIAL_PIECES} (pad, eos, unk)"
    )
  inside = [sp.id_to_piece(i) for i in range(n) if "<extra_id_" in sp.id_to_piece(i)]
  if inside:
    raise ValueError(
      f"the SentencePiece model already holds {len(inside)} sentinel pieces (e.g. {inside[0]!r}); "
      "write the plain model, without seqio's extra ids"
    )
  sentinels = [f"<extra_id_{i}>" for i in range(extra_ids)]  # extra_ids < 0: refused by fast_tokenizer_json
  tokens = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "additional_special_tokens": sentinels}
  config = {
    **tokens,
    "extra_ids": extra_ids,
    "model_max_length": model_max_length,
    "tokenizer_class": "PreTrainedTokenizerFast",
    "clean_up_tokenization_spaces": False,
  }
  dump = lambda d: (json.dumps(d, indent=2, sort_keys=True) + "\n").encode()
  fast = json.dumps(fast_tokenizer_json(spiece_model, extra_ids), indent=2, ensure_ascii=False) + "\n"
  return {
    SPIECE_NAME: bytes(spiece_model),
    TOKENIZER_JSON_NAME: fast.encode(),
    TOKENIZER_CONFIG_NAME: dump(config),
    SPECIAL_TOKENS_MAP_NAME: dump(tokens),
  }


def vocabulary_tokenizer_files(vocabulary) -> dict[str, bytes]:
  """`hf_tokenizer_files` of a seqio `SentencePieceVocabulary` (the run's vocabulary): its model file's bytes
  (read with tf.io.gfile, so gs:// works) and its extra ids. Vocabularies HF's T5 tokenizer cannot reproduce
  (not SentencePiece, normalizer overrides, sentinels numbered upwards) are refused with the reason."""
  model_file = getattr(vocabulary, "sentencepiece_model_file", None)
  if not model_file:
    raise ValueError(f"{vocabulary!r} is not a SentencePiece vocabulary; HF's T5 tokenizer needs one")
  if getattr(vocabulary, "_normalizer_spec_overrides", None):
    raise ValueError(f"{vocabulary!r} overrides the SentencePiece normalizer, which spiece.model would not carry")
  if vocabulary.extra_ids and not getattr(vocabulary, "_reverse_extra_ids", True):
    raise ValueError(
      f"{vocabulary!r} numbers its extra ids upwards; HF's T5 tokenizer numbers them downwards "
      "(<extra_id_0> = the last id)"
    )
  import tensorflow as tf

  with tf.io.gfile.GFile(model_file, "rb") as f:
    return hf_tokenizer_files(f.read(), vocabulary.extra_ids)


def write_hf_checkpoint(
  path: str | os.PathLike,
  cfg: network.T5Config,
  params: Mapping,
  *,
  overwrite: bool = False,
  tokenizer: Mapping[str, bytes] | None = None,
) -> None:
  """Write config.json + model.safetensors to directory `path`, atomically (temp dir, then rename).

  `tokenizer`: files to write beside them ({name: bytes}, from `hf_tokenizer_files`), so that
  `AutoTokenizer.from_pretrained(path)` works too. An existing non-empty `path` is an error unless `overwrite`; then it
  is replaced only once the new checkpoint is completely written."""
  path = os.path.abspath(os.fspath(path))
  parent = os.path.dirname(path)
  if os.path.exists(path) and not overwrite and (not os.path.isdir(path) or os.listdir(path)):
    raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
  hf_config = config_to_hf(cfg)
  state = params_to_hf_state_dict(params, cfg)  # validates before anything is written
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
      f.write("\n")
    # transformers refuses safetensors files without {"format": "pt"} metadata.
    safetensors.numpy.save_file(state, os.path.join(tmp, SAFETENSORS_NAME), metadata={"format": "pt"})
    for name, data in (tokenizer or {}).items():
      with open(os.path.join(tmp, name), "wb") as f:
        f.write(data)
    if os.path.exists(path):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
      os.rename(path, os.path.join(old, "ckpt"))
      os.rename(tmp, path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def load_hf_t5(path: str | os.PathLike) -> tuple[network.Transformer, Params]:
  """(`network.Transformer`, float32 params) of an HF T5 v1.1 checkpoint directory.

  `module.apply({"params": params}, enc, dec_in, dec_tgt, enable_dropout=False)` gives HF's logits
  (token id 0 = padding on both sides, decoder inputs = targets shifted right with start id 0)."""
  hf_config, state = read_hf_checkpoint(path)
  cfg = config_from_hf(hf_config)
  params = hf_state_dict_to_params(state, cfg, hf_config=hf_config)
  return network.Transformer(cfg), params
