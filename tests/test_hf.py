"""Hugging Face T5 v1.1 interop (remixer_t5.interop.hf) against a fixture made by transformers.

tests/fixtures/hf_t5_v1_1_tiny.npz comes from tests/fixtures/make_hf_fixture.py (random tiny T5 v1.1, untied
lm_head, encoder length 150 > relpos max distance, padded second rows). Only numpy + safetensors + jax here;
the last test also runs transformers when it is importable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from remixer_t5.interop import hf
from remixer_t5.model import network

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_t5_v1_1_tiny.npz")
ENC_ATOL = 1e-5
LOGITS_ATOL = 5e-5


@pytest.fixture(scope="module")
def fx():
  with np.load(FIXTURE) as z:
    data = {k: z[k] for k in z.files}
  data["weights"] = {k[2:]: v for k, v in data.items() if k.startswith("w/")}
  data["config"] = json.loads(str(data["config_json"]))
  return data


def write_hf_dir(path, fx, *, config_update=None, drop=(), weights=None):
  """An HF checkpoint directory (config.json + model.safetensors) from the fixture's weights."""
  os.makedirs(path, exist_ok=True)
  config = dict(fx["config"], architectures=["T5ForConditionalGeneration"])
  for k, v in (config_update or {}).items():
    if v is None:
      config.pop(k, None)
    else:
      config[k] = v
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  state = {k: v for k, v in (weights or fx["weights"]).items() if k not in drop}
  safetensors.numpy.save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return str(path)


@functools.partial(jax.jit, static_argnums=0)
def _forward(module, params, enc, dec_in, dec_tgt):
  logits, state = module.apply(
    {"params": params},
    enc,
    dec_in,
    dec_tgt,
    enable_dropout=False,
    capture_intermediates=lambda mdl, _: mdl.name == "decoder_norm",
    mutable=["intermediates"],
  )
  hidden = state["intermediates"]["decoder"]["decoder_norm"]["__call__"][0]
  return logits, hidden


def forward(module, params, fx):
  """(logits, final decoder hidden state) of the fixture's batch."""
  logits, hidden = _forward(
    module, params, fx["encoder_input_tokens"], fx["decoder_input_tokens"], fx["decoder_target_tokens"]
  )
  return np.asarray(logits), np.asarray(hidden)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def loaded(fx, tmp_path_factory):
  return hf.load_hf_t5(write_hf_dir(tmp_path_factory.mktemp("hf") / "ckpt", fx))


def test_fixture_is_small_and_described(fx):
  assert os.path.getsize(FIXTURE) < 1 << 20
  assert fx["config"]["feed_forward_proj"] == "gated-gelu"
  assert fx["config"]["num_decoder_layers"] != fx["config"]["num_layers"]
  assert fx["encoder_input_tokens"].shape[1] > fx["config"]["relative_attention_max_distance"]
  assert str(fx["transformers_version"])


def test_config_from_hf(fx, loaded):
  module, _ = loaded
  cfg = module.config
  c = fx["config"]
  assert (cfg.vocab_size, cfg.emb_dim, cfg.head_dim, cfg.num_heads, cfg.mlp_dim) == (
    c["vocab_size"],
    c["d_model"],
    c["d_kv"],
    c["num_heads"],
    c["d_ff"],
  )
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (2, 3)
  assert (cfg.relpos_num_buckets, cfg.relpos_max_distance) == (32, 128)
  assert cfg.mlp_activations == ("gelu", "linear") and cfg.dropout_rate == 0.0
  # num_decoder_layers defaults to num_layers, as in transformers.
  assert hf.config_from_hf({**c, "num_decoder_layers": None}).num_decoder_layers == 2
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


def test_params_tree_matches_module_init(fx, loaded):
  module, params = loaded
  shapes = jax.eval_shape(
    lambda rng: module.init(
      rng, fx["encoder_input_tokens"], fx["decoder_input_tokens"], fx["decoder_target_tokens"], enable_dropout=False
    ),
    jax.random.PRNGKey(0),
  )["params"]
  assert jax.tree.structure(shapes) == jax.tree.structure(params)
  for s, p in zip(jax.tree.leaves(shapes), jax.tree.leaves(params)):
    assert s.shape == p.shape and p.dtype == np.float32


def test_matches_transformers_outputs(fx, loaded):
  module, params = loaded
  enc_mask = fx["encoder_attention_mask"].astype(bool)
  dec_mask = fx["decoder_attention_mask"].astype(bool)
  assert not enc_mask.all() and not dec_mask.all()  # padding is exercised

  encoded = module.apply({"params": params}, fx["encoder_input_tokens"], enable_dropout=False, method=module.encode)
  np.testing.assert_allclose(np.asarray(encoded)[enc_mask], fx["encoder_output"][enc_mask], rtol=0, atol=ENC_ATOL)

  logits, _ = forward(module, params, fx)
  np.testing.assert_allclose(logits[dec_mask], fx["logits"][dec_mask], rtol=0, atol=LOGITS_ATOL)

  targets = fx["decoder_target_tokens"]
  logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
  nll = -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
  weights = (targets > 0).astype(jnp.float32)
  loss = float(jnp.sum(nll * weights) / jnp.sum(weights))
  assert loss == pytest.approx(float(fx["loss"]), rel=1e-5, abs=1e-5)


def test_fused_projections_match_transformers_outputs(fx, loaded):
  """The imported checkpoint with `fuse_projections` (query/key/value, key/value and wi_0/wi_1 as one product
  each, the same parameters) gives HF's logits as closely as the unfused model does."""
  module, params = loaded
  fused = module.clone(config=dataclasses.replace(module.config, fuse_projections=True))
  logits, _ = forward(fused, params, fx)
  dec_mask = fx["decoder_attention_mask"].astype(bool)
  np.testing.assert_allclose(logits[dec_mask], fx["logits"][dec_mask], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize(
  "config_update",
  [
    pytest.param({"tie_word_embeddings": False, "scale_decoder_outputs": None}, id="transformers-4.x"),
    pytest.param({"tie_word_embeddings": True, "scale_decoder_outputs": False}, id="transformers-5.x"),
  ],
)
def test_both_config_conventions(fx, loaded, tmp_path, config_update):
  module, params = hf.load_hf_t5(write_hf_dir(tmp_path / "ckpt", fx, config_update=config_update))
  assert module.config == loaded[0].config
  assert_trees_equal(params, loaded[1])
  logits, _ = forward(module, params, fx)
  dec_mask = fx["decoder_attention_mask"].astype(bool)
  np.testing.assert_allclose(logits[dec_mask], fx["logits"][dec_mask], rtol=0, atol=LOGITS_ATOL)


def test_tied_without_lm_head_is_scaled_shared_embedding(fx, loaded, tmp_path):
  """Original T5 (1.0) convention: tied, no lm_head.weight, decoder output scaled by d_model**-0.5."""
  module, params = hf.load_hf_t5(
    write_hf_dir(
      tmp_path / "ckpt",
      fx,
      config_update={"tie_word_embeddings": True, "scale_decoder_outputs": None},
      drop=("lm_head.weight",),
    )
  )
  shared = fx["weights"]["shared.weight"]
  d = fx["config"]["d_model"]
  logits, hidden = forward(module, params, fx)
  # Independent of the kernel folding: the untied model's final decoder state times the scaled embedding.
  _, untied_hidden = forward(*loaded, fx)
  np.testing.assert_array_equal(hidden, untied_hidden)
  expected = untied_hidden.astype(np.float64) @ shared.T.astype(np.float64) * d**-0.5
  dec_mask = fx["decoder_attention_mask"].astype(bool)
  np.testing.assert_allclose(logits[dec_mask], expected[dec_mask], rtol=0, atol=1e-5)
  assert not np.allclose(logits[dec_mask], fx["logits"][dec_mask], atol=1e-2)


def test_lm_head_convention_rules():
  # (use shared.weight, scale)
  assert hf.lm_head_convention({"tie_word_embeddings": False}, True) == (False, False)
  assert hf.lm_head_convention({"tie_word_embeddings": True, "scale_decoder_outputs": False}, True) == (False, False)
  assert hf.lm_head_convention({"tie_word_embeddings": True}, True) == (False, True)
  assert hf.lm_head_convention({}, False) == (True, True)  # transformers' default ties
  assert hf.lm_head_convention({"scale_decoder_outputs": False}, False) == (True, False)
  assert hf.lm_head_convention({"scale_decoder_outputs": True}, True) == (False, True)
  assert hf.lm_head_convention(None, True) == (False, False)


def test_tied_5x_without_lm_head_unscaled(fx, loaded):
  """transformers 5.x saving a model whose lm_head *is* shared: no lm_head.weight, no scaling."""
  cfg = loaded[0].config
  state = {k: v for k, v in fx["weights"].items() if k != "lm_head.weight"}
  params = hf.hf_state_dict_to_params(
    state, cfg, hf_config={"tie_word_embeddings": True, "scale_decoder_outputs": False}
  )
  np.testing.assert_array_equal(params["decoder"]["logits_dense"]["kernel"], state["shared.weight"].T)
  # An explicitly scaled config with its own lm_head folds the scale into the kernel.
  params = hf.hf_state_dict_to_params(fx["weights"], cfg, hf_config={"scale_decoder_outputs": True})
  np.testing.assert_allclose(
    params["decoder"]["logits_dense"]["kernel"], fx["weights"]["lm_head.weight"].T * cfg.emb_dim**-0.5, rtol=1e-7
  )


def test_embed_tokens_copies_and_ignored_keys(fx, loaded):
  cfg = loaded[0].config
  shared = fx["weights"]["shared.weight"]
  state = dict(
    fx["weights"],
    **{
      "encoder.embed_tokens.weight": shared,
      "decoder.embed_tokens.weight": shared.copy(),
      hf._IGNORED_KEYS[0]: np.zeros((32, 4), np.float32),
    },
  )
  assert_trees_equal(hf.hf_state_dict_to_params(state, cfg), loaded[1])
  state = {k: v for k, v in state.items() if k != "shared.weight"}  # only the stacks' copies
  assert_trees_equal(hf.hf_state_dict_to_params(state, cfg), loaded[1])
  state["decoder.embed_tokens.weight"] = shared + 1
  with pytest.raises(ValueError, match="decoder.embed_tokens.weight"):
    hf.hf_state_dict_to_params(dict(state, **{"shared.weight": shared}), cfg)


def test_state_dict_round_trip(fx, loaded):
  module, params = loaded
  state = hf.params_to_hf_state_dict(params, module.config)
  assert set(state) == set(fx["weights"])  # what transformers' save_pretrained writes
  for k, v in state.items():
    assert v.dtype == np.float32 and v.flags.c_contiguous
    np.testing.assert_array_equal(v, fx["weights"][k], err_msg=k)
  assert_trees_equal(hf.hf_state_dict_to_params(state, module.config), params)


def test_checkpoint_write_read_round_trip(loaded, tmp_path):
  module, params = loaded
  out = tmp_path / "export"
  hf.write_hf_checkpoint(out, module.config, params)
  assert sorted(os.listdir(tmp_path)) == ["export"]  # no temp dir left behind
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  config, state = hf.read_hf_checkpoint(out)
  assert config == hf.config_to_hf(module.config)
  assert config["tie_word_embeddings"] is False and config["feed_forward_proj"] == "gated-gelu"
  module2, params2 = hf.load_hf_t5(out)
  assert module2.config == module.config
  assert_trees_equal(params2, params)

  with pytest.raises(FileExistsError, match="export"):
    hf.write_hf_checkpoint(out, module.config, params)
  hf.write_hf_checkpoint(out, module.config, params, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["export"]
  # A failing write (bad params) leaves nothing behind and the old checkpoint intact.
  bad = jax.tree.map(lambda x: x, params)
  del bad["decoder"]["decoder_norm"]
  with pytest.raises(ValueError, match="decoder/decoder_norm/scale"):
    hf.write_hf_checkpoint(out, module.config, bad, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["export"]
  assert_trees_equal(hf.load_hf_t5(out)[1], params)


def test_sharded_safetensors(fx, loaded, tmp_path):
  names = sorted(fx["weights"])
  halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  os.makedirs(tmp_path / "ckpt")
  for shard, keys in halves.items():
    safetensors.numpy.save_file({k: fx["weights"][k] for k in keys}, str(tmp_path / "ckpt" / shard))
  with open(tmp_path / "ckpt" / "model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": {k: s for s, ks in halves.items() for k in ks}}, f)
  with open(tmp_path / "ckpt" / "config.json", "w") as f:
    json.dump(fx["config"], f)
  assert_trees_equal(hf.load_hf_t5(tmp_path / "ckpt")[1], loaded[1])
  os.remove(tmp_path / "ckpt" / "model-00002-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    hf.read_hf_checkpoint(tmp_path / "ckpt")


def test_bfloat16_safetensors(tmp_path):
  import ml_dtypes

  x = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
  raw = x.astype(ml_dtypes.bfloat16).tobytes()
  header = json.dumps(
    {"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, len(raw)]}}
  ).encode()
  path = tmp_path / "bf16.safetensors"
  path.write_bytes(struct.pack("<Q", len(header)) + header + raw)
  np.testing.assert_array_equal(hf._read_safetensors(str(path))["w"].astype(np.float32), x)


def test_bad_feed_forward_proj(fx, tmp_path):
  with pytest.raises(ValueError, match=r"feed_forward_proj='relu'.*gated-gelu"):
    hf.config_from_hf({**fx["config"], "feed_forward_proj": "relu"})
  with pytest.raises(ValueError, match=r"feed_forward_proj='relu'"):
    hf.config_from_hf({k: v for k, v in fx["config"].items() if k != "feed_forward_proj"})  # HF default
  with pytest.raises(ValueError, match=r"feed_forward_proj='gated-silu'"):
    hf.load_hf_t5(write_hf_dir(tmp_path / "c", fx, config_update={"feed_forward_proj": "gated-silu"}))
  with pytest.raises(ValueError, match="mlp_activations"):
    hf.config_to_hf(network.T5Config(mlp_activations=("relu",)))


def test_missing_unexpected_and_misshaped_weights(fx, loaded, tmp_path):
  cfg = loaded[0].config
  key = "decoder.block.2.layer.1.EncDecAttention.k.weight"
  with pytest.raises(ValueError, match=rf"missing weights \(1\): {key} \(32, 32\)"):
    hf.load_hf_t5(write_hf_dir(tmp_path / "a", fx, drop=(key,)))
  with pytest.raises(ValueError, match=r"missing weights \(1\): lm_head.weight \(64, 32\)"):
    hf.hf_state_dict_to_params(
      {k: v for k, v in fx["weights"].items() if k != "lm_head.weight"}, cfg, hf_config={"tie_word_embeddings": False}
    )
  with pytest.raises(ValueError, match=r"unexpected weights \(1\): decoder.block.3.layer.0.layer_norm.weight"):
    hf.hf_state_dict_to_params(
      dict(fx["weights"], **{"decoder.block.3.layer.0.layer_norm.weight": np.ones(32, np.float32)}), cfg
    )
  wrong = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
  with pytest.raises(ValueError, match=rf"{wrong}: expected \(32, 48\), got \(48, 32\)"):
    hf.hf_state_dict_to_params(dict(fx["weights"], **{wrong: fx["weights"][wrong].T}), cfg)
  # A config that does not fit the weights: every mismatch is named.
  with pytest.raises(
    ValueError,
    match=r"(?s)missing weights \(\d+\): decoder.block.3.*shared.weight: "
    r"expected \(128, 32\), got \(64, 32\)",
  ):
    hf.hf_state_dict_to_params(fx["weights"], dataclasses.replace(cfg, num_decoder_layers=4, vocab_size=128))


def test_missing_files(fx, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.read_hf_checkpoint(tmp_path / "nope")
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.read_hf_checkpoint(tmp_path / "empty")
  (tmp_path / "empty" / "config.json").write_text(json.dumps(fx["config"]))
  with pytest.raises(FileNotFoundError, match="model.safetensors.*pytorch_model.bin"):
    hf.read_hf_checkpoint(tmp_path / "empty")


def test_pytorch_bin_without_torch(fx, tmp_path, monkeypatch):
  (tmp_path / "config.json").write_text(json.dumps(fx["config"]))
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
  with pytest.raises(ImportError, match=r"pip install remixer_t5\[hf\]"):
    hf.read_hf_checkpoint(tmp_path)


def test_export_loads_in_transformers(fx, loaded, tmp_path):
  """Needs the optional hf extra (torch + transformers): skipped in CI."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  module, params = loaded
  hf.write_hf_checkpoint(tmp_path / "export", module.config, params)
  model, info = transformers.T5ForConditionalGeneration.from_pretrained(
    str(tmp_path / "export"), output_loading_info=True
  )
  assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  model.eval()
  t = lambda k: torch.from_numpy(fx[k].astype(np.int64))
  with torch.no_grad():
    out = model(
      input_ids=t("encoder_input_tokens"),
      attention_mask=t("encoder_attention_mask"),
      decoder_input_ids=t("decoder_input_tokens"),
      decoder_attention_mask=t("decoder_attention_mask"),
    )
  ours, _ = forward(module, params, fx)
  dec_mask = fx["decoder_attention_mask"].astype(bool)
  np.testing.assert_allclose(out.logits.numpy()[dec_mask], ours[dec_mask], rtol=0, atol=LOGITS_ATOL)

  # The original-T5 tied convention as transformers reads it.
  tied_dir = write_hf_dir(
    tmp_path / "tied",
    fx,
    drop=("lm_head.weight",),
    config_update={"tie_word_embeddings": True, "scale_decoder_outputs": None},
  )
  model = transformers.T5ForConditionalGeneration.from_pretrained(tied_dir).eval()
  with torch.no_grad():
    out = model(
      input_ids=t("encoder_input_tokens"),
      attention_mask=t("encoder_attention_mask"),
      decoder_input_ids=t("decoder_input_tokens"),
      decoder_attention_mask=t("decoder_attention_mask"),
    )
  ours, _ = forward(*hf.load_hf_t5(tied_dir), fx)
  np.testing.assert_allclose(out.logits.numpy()[dec_mask], ours[dec_mask], rtol=0, atol=LOGITS_ATOL)

  # pytorch_model.bin (as older checkpoints ship, with the stacks' embed_tokens copies) reads the same.
  bin_dir = tmp_path / "bin"
  os.makedirs(bin_dir)
  with open(bin_dir / "config.json", "w") as f:
    json.dump(hf.config_to_hf(module.config), f)
  state = {k: torch.from_numpy(v) for k, v in fx["weights"].items()}
  state["encoder.embed_tokens.weight"] = state["decoder.embed_tokens.weight"] = state["shared.weight"]
  torch.save(state, bin_dir / "pytorch_model.bin")
  assert_trees_equal(hf.load_hf_t5(bin_dir)[1], params)


def test_cli_import_hf_checkpoint_and_gin_reproduce_hf_logits(fx, tmp_path, capsys):
  """`remixer-t5 import-hf` -> orbax checkpoint + model.gin -> the same logits as Hugging Face."""
  from remixer_t5.training import checkpoints
  from remixer_t5 import cli, gin_utils

  hf_dir = write_hf_dir(tmp_path / "hf", fx)
  out = tmp_path / "imported"
  assert cli.main(["import-hf", hf_dir, str(out)]) == 0
  gin_utils.parse_gin([str(out / "model.gin")], [])
  model = gin_utils.macro("MODEL")
  params = checkpoints.restore_any_params(out)
  logits, _ = forward(model.module, params, fx)
  real = fx["decoder_target_tokens"] > 0
  np.testing.assert_allclose(logits[real], fx["logits"][real], atol=LOGITS_ATOL)
  # A second import into the same, now non-empty, directory is refused and changes nothing.
  assert cli.main(["import-hf", hf_dir, str(out)]) == 2
  assert "not empty" in capsys.readouterr().err


def test_greedy_infer_on_an_import_gives_transformers_generate_tokens(fx, tmp_path):
  """`import-hf`, then `infer`'s greedy decode (inference.predict, the model from the import's model.gin, the
  parameters as infer restores them) gives the tokens transformers' `generate` gave on the original model, for
  both fixture rows (one padded), token for token."""
  from remixer_t5 import cli, gin_utils
  from remixer_t5.training import checkpoints, inference

  out = tmp_path / "imported"
  assert cli.main(["import-hf", write_hf_dir(tmp_path / "hf", fx), str(out)]) == 0
  gin_utils.parse_gin([str(out / "model.gin")], [])
  model = gin_utils.macro("MODEL")
  params = checkpoints.restore_any_params(out)
  want = fx["generate_tokens"]
  enc = fx["encoder_input_tokens"]
  ids = [row[: int(np.count_nonzero(row))] for row in enc]
  got = list(
    inference.predict(
      model, params, ids, inference.Request(), batch_size=2, lengths={"inputs": enc.shape[1], "targets": want.shape[1]}
    )
  )
  for (tokens, log_prob), row in zip(got, want):
    np.testing.assert_array_equal(np.asarray(tokens), row[: len(tokens)])
    assert len(tokens) == (list(row).index(1) + 1 if 1 in row else len(row)) and np.isfinite(log_prob)


def test_cli_export_hf_unstacks_a_scanned_checkpoint(tmp_path, capsys):
  """A `scan_layers=True` model saved as import-hf lays out a params-only checkpoint (checkpoint/ + model.gin)
  exports with `export-hf` alone: the same config and weights as exporting its unrolled equivalent, and the
  exported model, read back, gives the scanned model's logits."""
  from flax.core import meta
  from remixer_t5 import cli
  from remixer_t5.commands import import_hf
  from remixer_t5.training import checkpoints

  cfg = network.T5Config(
    vocab_size=64,
    emb_dim=32,
    num_heads=2,
    head_dim=8,
    num_encoder_layers=2,
    num_decoder_layers=3,
    mlp_dim=48,
    dtype="float32",
    scan_layers=True,
  )
  module = network.Transformer(cfg)
  rng = np.random.default_rng(0)
  enc = rng.integers(2, cfg.vocab_size, (2, 7)).astype(np.int32)
  tgt = rng.integers(2, cfg.vocab_size, (2, 5)).astype(np.int32)
  enc[1, 5:], tgt[1, 3:] = 0, 0  # a padded row
  dec_in = np.concatenate([np.zeros((2, 1), np.int32), tgt[:, :-1]], axis=1) * (tgt > 0)
  params = meta.unbox(module.init(jax.random.PRNGKey(0), enc, dec_in, tgt, enable_dropout=False)["params"])
  assert hf.is_scanned(params) and params["decoder"]["layers"]["mlp"]["wo"]["kernel"].shape[0] == 3
  unrolled = network.unstack_scanned_params(params)
  assert not hf.is_scanned(unrolled)

  def save(name, tree, config):
    run = tmp_path / name
    checkpoints.save_params(run / "checkpoint", tree)
    (run / "model.gin").write_text(import_hf.model_gin(config))
    return str(run)

  scanned_run = save("scanned", params, cfg)
  unrolled_run = save("unrolled", unrolled, dataclasses.replace(cfg, scan_layers=False))
  assert cli.main(["export-hf", scanned_run, str(tmp_path / "hf_scanned")]) == 0
  assert "scanned" in capsys.readouterr().out
  assert cli.main(["export-hf", unrolled_run, str(tmp_path / "hf_unrolled")]) == 0
  got = safetensors.numpy.load_file(str(tmp_path / "hf_scanned" / "model.safetensors"))
  want = safetensors.numpy.load_file(str(tmp_path / "hf_unrolled" / "model.safetensors"))
  assert sorted(got) == sorted(want) == sorted(hf.hf_weight_shapes(cfg))
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  assert json.loads((tmp_path / "hf_scanned" / "config.json").read_text()) == json.loads(
    (tmp_path / "hf_unrolled" / "config.json").read_text()
  )
  # Read back as Hugging Face's model: the scanned model's logits.
  hf_module, hf_params = hf.load_hf_t5(tmp_path / "hf_scanned")
  assert hf_module.config.num_encoder_layers == 2 and hf_module.config.num_decoder_layers == 3
  want_logits = module.apply({"params": params}, enc, dec_in, tgt, enable_dropout=False)
  got_logits = hf_module.apply({"params": hf_params}, enc, dec_in, tgt, enable_dropout=False)
  real = tgt > 0
  np.testing.assert_allclose(np.asarray(got_logits)[real], np.asarray(want_logits)[real], atol=1e-5)
