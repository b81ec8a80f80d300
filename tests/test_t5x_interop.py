"""t5x interop (remixer_t5/interop/t5x.py, gin/t5x/): t5x's trainer runs our module; t5x checkpoints load
(remixer_t5/training/t5x_checkpoints.py).

t5x is not on PyPI. Without it, stand-ins with the signatures of t5x's configurables (google-research/t5x at
cc342d4: models.EncoderDecoderModel, adafactor.Adafactor, decoding.beam_search,
partitioning.standard_logical_axis_rules) let gin check every name and parameter our gin/t5x files bind, and
the module is driven through the exact calls t5x.models.EncoderDecoderModel makes. With t5x installed, the
real classes are used and t5x itself trains a step's loss, decodes, and reads our test checkpoints.
Checkpoints are written in t5x's on-disk layouts (t5x/checkpoints.py) with msgpack + TensorStore or orbax.
"""

import copy
import importlib.util
import inspect
import re
import shutil
import sys
import types

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from flax.linen import partitioning as flax_partitioning

from remixer_t5.training import checkpoints, t5x_checkpoints
from remixer_t5 import gin_utils
from remixer_t5.model import models, network
from tiers import tiered

REAL_T5X = importlib.util.find_spec("t5x") is not None
NO_T5X = "t5x is not installed (not on PyPI: pip install it from a clone of github.com/google-research/t5x)"
GIN_DIR = gin_utils.gin_dir()
# The per-model files; t5x/model.gin is the wrapper they include after a model file.
T5X_GIN = sorted(str(p.relative_to(GIN_DIR)) for p in GIN_DIR.glob("t5x/*.gin") if p.name != "model.gin")
# t5x-style bindings ('NAME = VALUE', as t5x's --gin.NAME=VALUE becomes) for a CPU-sized model.
SHRINK = [
  "network.T5Config.vocab_size = 96",
  "network.T5Config.emb_dim = 32",
  "network.T5Config.num_heads = 2",
  "network.T5Config.head_dim = 8",
  "network.T5Config.mlp_dim = 48",
  "network.T5Config.num_encoder_layers = 1",
  "network.T5Config.num_decoder_layers = 1",
  "ACTIVATION_DTYPE = 'float32'",
]

# Stand-ins: t5x's signatures (what gin validates bindings against), no behaviour.
_STANDINS = {
  "t5x": "",
  "t5x.decoding": """
def beam_search(inputs, cache, tokens_to_logits, eos_id, num_decodes=4, alpha=0.6, max_decode_len=None,
                max_decode_step=-1, min_log_prob=-1e10, decode_rng=None, cache_offset=0, initial_index=None):
  raise NotImplementedError('stand-in')
""",
  "t5x.adafactor": """
import enum
import types
class FactorDim(enum.Enum):
  NONE = None
  BATCH = 1
  ROW = 2
  COLUMN = 3
def standard_logical_factor_rules():
  F = FactorDim
  return {'vocab': F.COLUMN, 'embed': F.ROW, 'mlp': F.COLUMN, 'heads': F.COLUMN, 'kv': F.COLUMN,
          'joined_kv': F.COLUMN, 'relpos_buckets': F.NONE, 'layers': F.BATCH, 'stack': F.BATCH,
          'q_wi_fused': F.COLUMN, 'o_wo_fused': F.COLUMN, 'multiquery_heads': F.COLUMN, 'kv_fused': F.COLUMN,
          'layer_norm_scale': F.NONE, 'mlp_activations': F.COLUMN}
class Adafactor:
  def __init__(self, learning_rate=None, factored=True, multiply_by_parameter_scale=True, beta1=None,
               decay_rate=0.8, step_offset=0, clipping_threshold=1.0, weight_decay_rate=None,
               min_dim_size_to_factor=128, epsilon1=1e-30, epsilon2=1e-3, dtype_momentum=None, factor_map=None,
               logical_factor_rules=None, weight_decay_rate_lr_exponent=None, global_norm_clip_threshold=None,
               max_parameter_scale=None, skip_nan_updates=False):
    self.hyper_params = types.SimpleNamespace(decay_rate=decay_rate, logical_factor_rules=logical_factor_rules)
""",
  "t5x.partitioning": """
def standard_logical_axis_rules(activation_partitioning_dims=1, parameter_partitioning_dims=1,
                                additional_rules=None):
  rules = [('batch', 'data'), ('vocab', 'model'), ('embed', None), ('mlp', 'model'), ('heads', 'model'),
           ('kv', None), ('joined_kv', 'model'), ('relpos_buckets', None), ('abspos_buckets', None),
           ('length', None), ('layers', None), ('stack', None), ('mlp_activations', None)]
  return rules + list(additional_rules or [])
""",
  "t5x.models": """
from t5x import decoding
class EncoderDecoderModel:
  def __init__(self, module, input_vocabulary, output_vocabulary, optimizer_def, decode_fn=decoding.beam_search,
               feature_converter_cls=None, label_smoothing=0.0, z_loss=0.0, loss_normalizing_factor=None,
               default_decoder_params=None):
    self.module, self.optimizer_def, self.decode_fn = module, optimizer_def, decode_fn
    self.input_vocabulary, self.output_vocabulary = input_vocabulary, output_vocabulary
    self.z_loss, self.label_smoothing, self.loss_normalizing_factor = z_loss, label_smoothing, loss_normalizing_factor
""",
}


@pytest.fixture(scope="module")
def t5x_api():
  """The t5x modules gin/t5x uses: the real ones when installed, else the stand-ins (removed afterwards)."""
  if REAL_T5X:
    yield
    return
  assert not any(name in sys.modules for name in _STANDINS)
  for name, source in _STANDINS.items():  # in order: t5x.models imports t5x.decoding
    module = types.ModuleType(name)
    if name == "t5x":
      module.__path__ = []  # a package
    sys.modules[name] = module
    if "." in name:
      setattr(sys.modules["t5x"], name.split(".")[1], module)
    exec(compile(source, f"<stand-in {name}>", "exec"), module.__dict__)  # noqa: S102
  yield
  for name in _STANDINS:
    sys.modules.pop(name, None)
  gin.clear_config()


def _parse_like_t5x(gin_file: str, bindings=()):
  """MODEL after parsing as t5x's binaries do (t5x.gin_utils.parse_gin_flags: search paths, files, bindings)."""
  gin.clear_config()
  if REAL_T5X:
    from t5x import gin_utils as t5x_gin_utils

    t5x_gin_utils.parse_gin_flags([str(GIN_DIR)], [gin_file], list(bindings))
  else:
    gin.add_config_file_search_path(str(GIN_DIR))
    gin.parse_config_files_and_bindings([gin_file], list(bindings), finalize_config=True)
  return gin_utils.macro("MODEL")


def _counterpart(gin_file: str) -> str:
  """The model file a gin/t5x file wraps (its first include)."""
  return re.search(r"^include '([^']+)'", (GIN_DIR / gin_file).read_text(), re.MULTILINE).group(1)


def _init_like_t5x(module, enc_len=8, dec_len=5, batch=2, abstract=False):
  """t5x's EncoderDecoderModel.get_initial_variables: float32 dummy tokens and every keyword."""

  def init():
    return module.init(
      jax.random.PRNGKey(0),
      jnp.ones((batch, enc_len), jnp.float32),
      jnp.ones((batch, dec_len), jnp.float32),
      jnp.ones((batch, dec_len), jnp.float32),
      encoder_positions=None,
      decoder_positions=None,
      encoder_segment_ids=None,
      decoder_segment_ids=None,
      decode=False,
      enable_dropout=False,
    )

  return jax.eval_shape(init) if abstract else jax.jit(init)()  # one compile beats op-by-op init on CPU


def _axis_names(variables) -> list[tuple[str, ...]]:
  return [a.names for _, a in _axes_with_paths(variables)]


def _axes_with_paths(variables):
  return jax.tree_util.tree_leaves_with_path(
    variables["params_axes"], is_leaf=lambda x: isinstance(x, flax_partitioning.AxisMetadata)
  )


def _shapes(tree):
  return {
    jax.tree_util.keystr(k): (tuple(v.shape), np.dtype(v.dtype)) for k, v in jax.tree_util.tree_leaves_with_path(tree)
  }


# --- parameter names ---------------------------------------------------------------------------------------
def _t5x_t5_1_1_params(cfg: network.T5Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """t5x's T5.1.1 tree (t5x/examples/t5/network.py, layers.py): path -> (shape, logical axes)."""
  e, m, v, h = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size, cfg.num_heads * cfg.head_dim
  out = {"token_embedder/embedding": ((v, e), ("vocab", "embed"))}
  scale = ((e,), ("embed",))
  mlp = {
    "mlp/wi_0/kernel": ((e, m), ("embed", "mlp")),
    "mlp/wi_1/kernel": ((e, m), ("embed", "mlp")),
    "mlp/wo/kernel": ((m, e), ("mlp", "embed")),
  }

  def attention(name):
    qkv = {f"{name}/{p}/kernel": ((e, h), ("embed", "joined_kv")) for p in ("query", "key", "value")}
    return {**qkv, f"{name}/out/kernel": ((h, e), ("joined_kv", "embed"))}

  for stack in ("encoder", "decoder"):
    out[f"{stack}/relpos_bias/rel_embedding"] = ((cfg.num_heads, cfg.relpos_num_buckets), ("heads", "relpos_buckets"))
    out[f"{stack}/{stack}_norm/scale"] = scale
  for i in range(cfg.num_encoder_layers):
    layer = {
      "pre_attention_layer_norm/scale": scale,
      **attention("attention"),
      "pre_mlp_layer_norm/scale": scale,
      **mlp,
    }
    out.update({f"encoder/layers_{i}/{k}": val for k, val in layer.items()})
  for i in range(cfg.num_decoder_layers):
    layer = {
      "pre_self_attention_layer_norm/scale": scale,
      **attention("self_attention"),
      "pre_cross_attention_layer_norm/scale": scale,
      **attention("encoder_decoder_attention"),
      "pre_mlp_layer_norm/scale": scale,
      **mlp,
    }
    out.update({f"decoder/layers_{i}/{k}": val for k, val in layer.items()})
  out["decoder/logits_dense/kernel"] = ((e, v), ("embed", "vocab"))
  return out


def test_our_t5_1_1_tree_is_t5x_s_names_shapes_and_logical_axes():
  cfg = network.T5Config(
    vocab_size=96, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48, num_encoder_layers=2, num_decoder_layers=3
  )
  variables = _init_like_t5x(network.Transformer(cfg), abstract=True)
  ours = {
    "/".join(str(getattr(k, "key", k)) for k in path): (tuple(leaf.shape),)
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
  }
  for path, a in _axes_with_paths(variables):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    ours[name[: -len("_axes")]] += (a.names,)
  assert ours == _t5x_t5_1_1_params(cfg)


# --- gin/t5x -----------------------------------------------------------------------------------------------
def test_there_are_t5x_gin_files():
  assert {"t5x/t5_1_1_base.gin", "t5x/remixer_base.gin", "t5x/hypermixer_base.gin"} <= set(T5X_GIN)


@pytest.mark.parametrize("gin_file", T5X_GIN)
def test_t5x_gin_file_builds_t5x_s_model_around_our_module(gin_file, t5x_api):
  """Every name and parameter the file binds exists (gin checks them against t5x's signatures); MODEL is
  t5x's EncoderDecoderModel around the network of the wrapped model file; t5x's Adafactor and partitioning
  rules cover every logical axis of its parameters."""
  from t5x import adafactor, decoding
  from t5x import models as t5x_models
  from t5x import partitioning as t5x_partitioning

  full_size = gin_file == "t5x/t5_1_1_base.gin"  # t5x's T5.1.1 base: its parameter count is known
  model = _parse_like_t5x(gin_file, () if full_size else SHRINK[:-1])
  assert isinstance(model, t5x_models.EncoderDecoderModel)
  assert isinstance(model.module, network.Transformer) and model.module.config.dtype == "bfloat16"
  assert inspect.unwrap(model.decode_fn) is decoding.beam_search
  assert model.input_vocabulary is not None and model.output_vocabulary is not None
  assert isinstance(model.optimizer_def, adafactor.Adafactor)
  variables = _init_like_t5x(model.module, abstract=True)

  # t5x's Adafactor.set_param_axes looks each axis name up in the rules: a missing one is a KeyError there.
  rules = model.optimizer_def.hyper_params.logical_factor_rules
  names = {n for axes in _axis_names(variables) for n in axes}
  assert names <= set(rules), f"no Adafactor factor rule for {sorted(names - set(rules))}"
  assert all(isinstance(rules[n], adafactor.FactorDim) for n in names)
  # As t5x's run files call it (@partitioning.standard_logical_axis_rules()), with our additional_rules bound.
  covered = {n for n, _ in gin.get_configurable(t5x_partitioning.standard_logical_axis_rules)()}
  assert names <= covered, f"no t5x partitioning rule for {sorted(names - covered)}"

  # The same network as the model file our own CLI parses.
  gin_utils.parse_gin([_counterpart(gin_file)], [] if full_size else [b.replace(" = ", "=") for b in SHRINK[:-1]])
  reference = jax.eval_shape(
    lambda: models.EncoderDecoderModel(gin_utils.macro("MODEL").module).init_variables(
      jax.random.PRNGKey(0),
      {"encoder_input_tokens": (2, 8), "decoder_input_tokens": (2, 5), "decoder_target_tokens": (2, 5)},
    )
  )
  assert _shapes(variables["params"]) == _shapes(reference["params"])
  if full_size:
    assert sum(int(np.prod(s)) for s, _ in _shapes(variables["params"]).values()) == 247_577_856


def _expand_cache_like_t5x(cache, batch: int, beams: int):
  """t5x's decoding.cache_map(flat_batch_beam_expand): every cache leaf but the step counters is batch-major."""

  def expand(path, x):
    if path[-1].key in ("cache_index", "cached_bias", "position_embedder_index"):
      return x
    assert x.shape[0] == batch, f"cache leaf {jax.tree_util.keystr(path)} {x.shape} is not batch-major"
    return jnp.repeat(x, beams, axis=0)

  return jax.tree_util.tree_map_with_path(expand, cache)


@pytest.mark.parametrize("gin_file", tiered(T5X_GIN, ("t5x/t5_1_1_base.gin",)))
def test_module_answers_every_call_t5x_makes(gin_file, t5x_api):
  """The calls of t5x.models.EncoderDecoderModel (_compute_logits, encode, _compute_kv_cache through __call__
  with decode=True, _compute_logits_from_slice on a beam-expanded cache): teacher-forced decode steps give
  the full forward pass's logits."""
  module = _parse_like_t5x(gin_file, SHRINK).module
  batch, enc_len, dec_len, beams, vocab = 2, 8, 4, 2, module.config.vocab_size
  variables = _init_like_t5x(module, enc_len, dec_len, batch)
  assert set(variables) == {"params", "params_axes"}
  params = variables["params"]
  rng = np.random.RandomState(0)
  enc = rng.randint(2, vocab, (batch, enc_len)).astype(np.int32)
  enc[1, -3:] = 0  # padding
  tgt = rng.randint(2, vocab, (batch, dec_len)).astype(np.int32)
  dec_in = np.concatenate([np.zeros((batch, 1), np.int32), tgt[:, :-1]], axis=1)

  # _compute_logits (no dropout, then with the dropout rng of training).
  logits = module.apply(
    {"params": params},
    enc,
    dec_in,
    tgt,
    encoder_segment_ids=None,
    decoder_segment_ids=None,
    encoder_positions=None,
    decoder_positions=None,
    decode=False,
    enable_dropout=False,
    rngs=None,
    mutable=False,
  )
  assert logits.shape == (batch, dec_len, vocab)
  dropped = module.apply(
    {"params": params},
    enc,
    dec_in,
    tgt,
    decode=False,
    enable_dropout=True,
    rngs={"dropout": jax.random.PRNGKey(1)},
    mutable=False,
  )
  assert dropped.shape == logits.shape
  # predict_batch_with_aux: encode, then _compute_kv_cache (no `prefill` in our decode: t5x skips prefilling).
  encoded = module.apply({"params": params}, enc, enable_dropout=False, method=module.encode)
  _, initial = module.apply(
    {"params": params},
    encoder_input_tokens=jnp.ones_like(enc),
    decoder_input_tokens=jnp.ones_like(dec_in),
    decoder_target_tokens=jnp.ones_like(dec_in),
    mutable=["cache"],
    decode=True,
    enable_dropout=False,
  )
  cache = _expand_cache_like_t5x(initial["cache"], batch, beams)
  enc_b, encoded_b = np.repeat(enc, beams, 0), jnp.repeat(encoded, beams, 0)
  for t in range(dec_len):  # _compute_logits_from_slice
    token = np.repeat(dec_in[:, t : t + 1], beams, 0)
    step_logits, new_vars = module.apply(
      {"params": params, "cache": cache},
      encoded_b,
      enc_b,
      token,
      token,
      enable_dropout=False,
      decode=True,
      max_decode_length=dec_len,
      mutable=["cache"],
      method=module.decode,
    )
    cache = new_vars["cache"]
    np.testing.assert_allclose(step_logits[:, 0], np.repeat(logits[:, t], beams, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not REAL_T5X, reason=NO_T5X)
@pytest.mark.parametrize("gin_file", T5X_GIN)
def test_t5x_trains_and_decodes_our_module(gin_file, t5x_api):
  from t5x import train_state as t5x_train_state

  model = _parse_like_t5x(gin_file, SHRINK)
  shapes = {"encoder_input_tokens": (2, 8), "decoder_input_tokens": (2, 5)}
  variables = model.get_initial_variables(jax.random.PRNGKey(0), shapes, {k: jnp.int32 for k in shapes})
  # Builds Adafactor's state with our factor rules (set_param_axes) as t5x's trainer does.
  t5x_train_state.FlaxOptimTrainState.create(model.optimizer_def, variables)
  assert flax_partitioning.get_axis_names(variables["params_axes"])
  rng = np.random.RandomState(0)
  tgt = rng.randint(2, 96, (2, 5)).astype(np.int32)
  batch = {
    "encoder_input_tokens": rng.randint(2, 96, (2, 8)).astype(np.int32),
    "decoder_target_tokens": tgt,
    "decoder_input_tokens": np.concatenate([np.zeros((2, 1), np.int32), tgt[:, :-1]], 1),
    "decoder_loss_weights": np.ones((2, 5), np.float32),
  }
  loss, _ = model.loss_fn(variables["params"], batch, None)
  assert np.isfinite(float(loss))
  decodes, aux = model.predict_batch_with_aux(variables["params"], batch, decoder_params={"eos_id": 1}, num_decodes=2)
  assert decodes.shape == (2, 5) and aux["scores"].shape == (2,)


# --- t5x checkpoints ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_params():
  cfg = network.T5Config(
    vocab_size=96, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48, num_encoder_layers=1, num_decoder_layers=1
  )
  params = _init_like_t5x(network.Transformer(cfg))["params"]
  return jax.tree.map(np.asarray, params)


def _named_leaves(tree, prefix):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _named_leaves(v, f"{prefix}/{k}")
    else:
      yield f"{prefix}/{k}", v


def _map_named(tree, fn, prefix="target"):
  return {
    k: (_map_named(v, fn, f"{prefix}/{k}") if isinstance(v, dict) else fn(f"{prefix}/{k}", v)) for k, v in tree.items()
  }


INLINE = "target/encoder/encoder_norm/scale"  # t5x keeps unpartitioned leaves in the msgpack itself
GCS = "target/decoder/logits_dense/kernel"  # written to gs://: a 'gcs' spec, read from the local copy
OLD = "target/encoder/relpos_bias/rel_embedding"  # t5x with tensorstore < 0.1.14: path beside the kvstore
BF16 = "target/token_embedder/embedding"  # t5x's save_dtype='bfloat16'


def _write_legacy(step_dir, params, step: int):
  """t5x's legacy Checkpointer.save: zarr arrays under the step dir + the msgpack `checkpoint` file."""
  import tensorstore as ts

  step_dir.mkdir(parents=True)

  def leaf(name, arr):
    if name == INLINE:
      return arr
    if name == BF16:
      arr = arr.astype(jnp.bfloat16)
    rel = name.replace("/", ".")
    chunks = [max(1, arr.shape[0] // 2)] + list(arr.shape[1:])  # several chunks, as t5x's chunk choice gives
    metadata = {"compressor": {"id": "gzip"}, "shape": list(arr.shape), "chunks": chunks}
    spec = {
      "driver": "zarr",
      "dtype": jnp.dtype(arr.dtype).name,
      "kvstore": {"driver": "file", "path": rel},
      "metadata": metadata,
    }
    absolute = copy.deepcopy(spec)
    absolute["kvstore"]["path"] = str(step_dir / rel)
    ts.open(absolute, create=True, open=True).result().write(arr).result()
    if name == GCS:  # t5x's _get_spec for a gs:// directory
      spec = {
        "driver": "zarr",
        "dtype": spec["dtype"],
        "kvstore": {"driver": "gcs", "bucket": "t5x-dummy-bucket"},
        "path": rel,
        "metadata": metadata,
      }
    if name == OLD:
      spec = {
        "driver": "zarr",
        "dtype": spec["dtype"],
        "kvstore": {"driver": "file"},
        "path": rel,
        "metadata": metadata,
      }
      return spec  # as old t5x stored it (ts.Spec(...).to_json() would move the path into the kvstore)
    return ts.Spec(spec).to_json()  # what t5x serialises (flax's state dict of a ts.Spec)

  target = _map_named(params, leaf)
  some_param = params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  state = {
    "step": np.int32(step),
    "param_states": {
      "encoder": {
        "layers_0": {
          "mlp": {
            "wi_0": {
              "kernel": {
                "v_row": np.zeros(some_param.shape[:1], np.float32),
                "v_col": np.zeros(some_param.shape[1:], np.float32),
                "v": np.zeros((1,), np.float32),
                "m": np.zeros((1,), np.float32),
              }
            }
          }
        }
      }
    },
  }
  blob = serialization.msgpack_serialize({"version": 3, "optimizer": {"target": target, "state": state}})
  (step_dir / "checkpoint").write_bytes(blob)


def _assert_same(loaded, params, bf16=()):
  want = {k: (v.astype(jnp.bfloat16) if k in bf16 else v) for k, v in _named_leaves(params, "target")}
  got = dict(_named_leaves(loaded, "target"))
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    assert np.array_equal(got[k].view(np.uint8), np.ascontiguousarray(v).view(np.uint8)), k  # bitwise


def test_legacy_t5x_checkpoint_loads_bitwise(tmp_path, tiny_params):
  run = tmp_path / "t5x_run"
  older = jax.tree.map(lambda x: x + 1, tiny_params)
  _write_legacy(run / "checkpoint_5", older, 5)
  _write_legacy(run / "checkpoint_10", tiny_params, 10)
  (run / "checkpoint_20.tmp-1700000000").mkdir()  # an unfinished save is not a step
  for path in (run, run / "checkpoint_10", run / "checkpoint_10" / "checkpoint"):
    assert t5x_checkpoints.is_t5x_checkpoint(path)
    _assert_same(t5x_checkpoints.load_t5x_params(path), tiny_params, bf16={BF16})
  _assert_same(t5x_checkpoints.load_t5x_params(run, step=5), older, bf16={BF16})
  if REAL_T5X:  # t5x's own reader agrees
    from t5x import checkpoints as t5x_own

    state = t5x_own.load_t5x_checkpoint(str(run / "checkpoint_10"))
    _assert_same(jax.tree.map(np.asarray, state["target"]), tiny_params, bf16={BF16})


@pytest.mark.parametrize("use_ocdbt", [True, False])
def test_orbax_t5x_checkpoint_loads_bitwise(tmp_path, tiny_params, use_ocdbt):
  """t5x's OrbaxCheckpointManagerInterface: a 'state' PyTree item in checkpoint_<step>/."""
  import orbax.checkpoint as ocp

  run = tmp_path / "t5x_run"
  manager = ocp.CheckpointManager(
    run,
    item_handlers={"state": ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)},
    options=ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True),
  )
  state = {
    "target": tiny_params,
    "state": {
      "step": np.int32(7),
      "param_states": jax.tree.map(lambda x: {"v": np.full(x.shape, 0.5, np.float32)}, tiny_params),
    },
  }
  manager.save(7, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), force=True)
  manager.wait_until_finished()
  manager.close()
  assert (run / "checkpoint_7" / "state").is_dir()
  for path in (run, run / "checkpoint_7"):
    assert t5x_checkpoints.is_t5x_checkpoint(path)
    _assert_same(t5x_checkpoints.load_t5x_params(path), tiny_params)


def test_our_own_layouts_are_not_t5x_checkpoints(tmp_path, tiny_params):
  checkpoints.save_params(tmp_path / "imported" / "checkpoint", tiny_params)  # import-hf output
  checkpoints.save_params(tmp_path / "checkpoint_5" / "checkpoint", tiny_params)  # ... named like a t5x step
  checkpoints.save_params(tmp_path / "params", tiny_params)  # a params checkpoint
  (tmp_path / "run" / "checkpoints" / "8" / "state").mkdir(parents=True)  # a train MODEL_DIR
  for path in ("imported", "checkpoint_5", "params", "run", "run/checkpoints", "run/checkpoints/8", "absent"):
    assert not t5x_checkpoints.is_t5x_checkpoint(tmp_path / path), path


def test_malformed_t5x_checkpoints_say_what_is_missing(tmp_path, tiny_params):
  def error(path, *needles, exc=t5x_checkpoints.T5xCheckpointError):
    with pytest.raises(exc) as e:
      t5x_checkpoints.load_t5x_params(path)
    for needle in needles:
      assert str(needle) in str(e.value), (needle, str(e.value))

  error(tmp_path / "absent", tmp_path / "absent", exc=FileNotFoundError)
  (tmp_path / "empty").mkdir()
  error(tmp_path / "empty", "checkpoint_<step>", "`checkpoint` msgpack", "state/")
  (tmp_path / "bare" / "checkpoint_3").mkdir(parents=True)
  error(tmp_path / "bare", "checkpoint_3", "`checkpoint` msgpack", "state/")

  _write_legacy(tmp_path / "lost" / "checkpoint_1", tiny_params, 1)
  missing = tmp_path / "lost" / "checkpoint_1" / "target.encoder.layers_0.mlp.wo.kernel"
  shutil.rmtree(missing)
  error(tmp_path / "lost", "target/encoder/layers_0/mlp/wo/kernel", missing)

  (tmp_path / "notarget" / "checkpoint_1").mkdir(parents=True)
  (tmp_path / "notarget" / "checkpoint_1" / "checkpoint").write_bytes(
    serialization.msgpack_serialize({"version": 3, "optimizer": {"state": {"step": 1}}})
  )
  error(tmp_path / "notarget", "optimizer/target", "'state'")

  import orbax.checkpoint as ocp

  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(tmp_path / "orbax_notarget" / "checkpoint_2" / "state", {"params": tiny_params})
  error(tmp_path / "orbax_notarget", "'target'", "'params'", "checkpoint_2")
  with pytest.raises(t5x_checkpoints.T5xCheckpointError, match=r"no checkpoint_9/.*\[2\]"):
    t5x_checkpoints.load_t5x_params(tmp_path / "orbax_notarget", step=9)


def test_init_checkpoint_can_be_a_t5x_checkpoint(tmp_path, tiny_params):
  """INIT_CHECKPOINT / eval / export-hf accept a t5x MODEL_DIR: params placed as the model's (bf16 -> f32)."""
  _write_legacy(tmp_path / "t5x_run" / "checkpoint_3", tiny_params, 3)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
    tiny_params,
  )
  restored = checkpoints.restore_init_params(tmp_path / "t5x_run", abstract)
  want = dict(_named_leaves(tiny_params, "target"))
  for name, value in _named_leaves(jax.tree.map(np.asarray, restored), "target"):
    expected = want[name].astype(jnp.bfloat16).astype(np.float32) if name == BF16 else want[name]
    assert value.dtype == np.float32 and np.array_equal(value, expected), name


# --- one program: the CLI, Python and t5x lower the same model the same way --------------------------------
def _canonical_hlo(text: str) -> str:
  """Optimised HLO without source metadata, stack frames, the module's header (name, the traced mesh's
  annotation) or instruction names (which follow the call stack)."""
  text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:[^\n]+\n)*", "\n", text)
  text = re.sub(r",? metadata=\{[^}]*\}", "", text)
  text = re.sub(r",? stack_frame_id=\d+", "", text)
  text = re.sub(r"^HloModule [^\n]*", "HloModule m", text)  # its name and the mesh it was traced under
  names: dict[str, str] = {}
  return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


@pytest.mark.parametrize(
  "gin_file", tiered(["t5x/hypermixer_base.gin", "t5x/t5_1_1_base.gin"], ("t5x/hypermixer_base.gin",))
)
def test_cli_python_and_t5x_compile_the_same_program(gin_file, t5x_api):
  """The model's gradient (dropout on) compiles to the same optimised program whether its gin file is read as
  `remixer-t5 train` reads it (our parser, traced under the run's mesh and rules), from Python
  (`models.from_gin`, no mesh) or as t5x's binaries read its gin/t5x file (t5x's mesh axes and rules): the
  kernels each operation takes (`auto`) follow the platform compiled for, not who asked. HyperMixer's CPU
  loops and dropout's materialised masks are custom calls that must appear in all three."""
  from flax import linen as nn
  from remixer_t5.model import models as our_models
  from remixer_t5.training import partitioning

  bindings = [b.replace(" = ", "=") for b in SHRINK] + ["DROPOUT_RATE=0.1"]
  # 128 positions: attention's dropout masks ([2, 2, 128, 128]) reach kernels/cpu/threefry.UNROLL_MIN.
  batch = {
    "encoder_input_tokens": jnp.ones((2, 128), jnp.int32),
    "decoder_input_tokens": jnp.ones((2, 128), jnp.int32),
    "decoder_target_tokens": jnp.full((2, 128), 3, jnp.int32),
  }
  rng = jax.random.PRNGKey(1)

  def compiled(module, mesh=None, rules=None):
    model = our_models.EncoderDecoderModel(module)
    params = jax.eval_shape(
      lambda: model.init_variables(jax.random.PRNGKey(0), {k: (1, v.shape[1]) for k, v in batch.items()})["params"]
    )
    grad = jax.jit(jax.grad(lambda p, b, r: model.loss_fn(p, b, r)[0]))
    if mesh is None:
      return _canonical_hlo(grad.lower(params, batch, rng).compile().as_text())
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return _canonical_hlo(grad.lower(params, batch, rng).compile().as_text())

  gin_utils.parse_gin([_counterpart(gin_file)], bindings)
  part = partitioning.partitioner(None)
  cli = compiled(gin_utils.macro("MODEL").module, part.mesh, part.rules)
  gin.clear_config()
  python = compiled(our_models.from_gin(_counterpart(gin_file), *bindings))
  t5x_model = _parse_like_t5x(gin_file, SHRINK + ["network.T5Config.dropout_rate = 0.1"])
  from t5x import partitioning as t5x_partitioning

  t5x_mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  t5x = compiled(t5x_model.module, t5x_mesh, gin.get_configurable(t5x_partitioning.standard_logical_axis_rules)())
  gin.clear_config()
  assert cli == python
  assert cli == t5x
  targets = set(re.findall(r'custom_call_target="(\w+)"', cli))
  if "hypermixer" in gin_file:  # attention-free: HyperMixing's CPU loops
    assert "remixer_hypermixing_causal" in targets
  else:  # dropout_impl 'auto' on a CPU: attention's large masks computed once
    assert "remixer_materialize" in targets
