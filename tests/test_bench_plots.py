"""`bench mixing` (cost of one token-mixing layer against length) and `plot` (softmax(H), attention and
HyperMixing pseudo-attention maps from a checkpoint), on tiny sizes."""

import argparse
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.bench import mixing as bench
from remixer_t5.training import checkpoints, plots
from remixer_t5 import cli, runtime
from remixer_t5.commands import plot as plot_command
from remixer_t5.model import models
from remixer_t5.model.mixers import base

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = dict(d_model=16, hidden=32, num_heads=1, head_dim=16)
LENGTHS = (64, 256)


def _is_png(path) -> bool:
  with open(path, "rb") as f:
    return f.read(8) == PNG_SIGNATURE


@pytest.fixture(scope="module")
def tiny_rows():
  """Every mixer at two lengths, timed once each (tiny sizes: compile time dominates)."""
  return bench.bench_mixing(LENGTHS, bench.MIXERS, config=bench.default_config(**TINY), repeats=1)


def test_bench_rows_have_the_fields_for_every_mixer_and_length(tiny_rows):
  assert [(r["mixer"], r["length"]) for r in tiny_rows] == [(m, n) for m in bench.MIXERS for n in LENGTHS]
  for r in tiny_rows:
    assert r["ms"] > 0 and r["ms_min"] <= r["ms"]
    assert r["flops"] > 0 and math.isfinite(r["flops"])
    assert r["d_model"] == TINY["d_model"] and r["batch"] == 1
  # FNet has no parameters; every other mixer has some.
  assert all((r["params"] == 0) == (r["mixer"] == "fnet") for r in tiny_rows)


def test_bench_flops_grow_with_length(tiny_rows):
  for mixer in bench.MIXERS:
    ((short, long, ratio),) = bench.growth(tiny_rows, mixer, "flops")
    assert (short, long) == LENGTHS
    assert ratio > 3.0, f"{mixer}: FLOPs only x{ratio:.2f} for x4 length"


def test_attention_flops_grow_quadratically_and_hypermixer_linearly(tiny_rows):
  exponent = lambda m: math.log(bench.growth(tiny_rows, m, "flops")[0][2]) / math.log(LENGTHS[1] / LENGTHS[0])
  assert exponent("attention") > 1.6
  assert exponent("attention_norelpos") > 1.6
  assert exponent("hypermixer") < 1.05
  assert exponent("linear_attention") < 1.05
  assert exponent("mlp_mixer") < 1.05  # L x hidden token MLP: linear in L at a fixed hidden width


def test_fixed_length_mixers_are_built_at_the_measured_length(tiny_rows):
  params = {(r["mixer"], r["length"]): r["params"] for r in tiny_rows}
  n0, n1 = LENGTHS
  assert params[("remixer", n1)] - params[("remixer", n0)] == n1**2 - n0**2  # H is L x L
  assert params[("gmlp", n1)] - params[("gmlp", n0)] == (n1**2 + n1) - (n0**2 + n0)  # W and b
  assert params[("hypermixer", n1)] == params[("hypermixer", n0)]


@pytest.mark.parametrize(
  "spec,lengths",
  [
    ("128,256,...,4096", [128, 256, 512, 1024, 2048, 4096]),
    ("100,200,...,500", [100, 200, 300, 400, 500]),
    ("256,1024", [256, 1024]),
  ],
)
def test_parse_lengths(spec, lengths):
  assert bench.parse_lengths(spec) == lengths


@pytest.mark.parametrize("spec", ["128,256,...,1000", "...,256", "0,8", "256,128,...,64"])
def test_parse_lengths_refuses_bad_specs(spec):
  with pytest.raises(ValueError):
    bench.parse_lengths(spec)


def test_cli_bench_json_lines_and_plot(tmp_path, capsys):
  args = [
    "bench",
    "mixing",
    "--lengths",
    "32,64",
    "--mixers",
    "hypermixer,attention",
    "--json",
    "--repeats",
    "1",
    "--d_model",
    "16",
    "--hidden",
    "32",
    "--num_heads",
    "1",
    "--head_dim",
    "16",
    "--out",
    str(tmp_path),
  ]
  assert cli.main(args) == 0
  out, err = capsys.readouterr()
  rows = [json.loads(line) for line in out.strip().splitlines()]
  assert [(r["mixer"], r["length"]) for r in rows] == [
    ("hypermixer", 32),
    ("hypermixer", 64),
    ("attention", 32),
    ("attention", 64),
  ]
  assert all(r["ms"] > 0 and r["flops"] > 0 for r in rows)
  assert err.count("bench ") == 4  # one progress line per measurement
  # The CLI applies the host allocator policy on glibc CPU hosts (runtime.py), and the rows say so.
  mode = os.environ.get(runtime.ENV, "auto")
  wanted = mode == "on" or (mode == "auto" and runtime.jax_runs_on_cpu_only())
  expected = wanted and runtime._glibc() is not None
  assert all(r["host_malloc"] is expected for r in rows) and ("host allocator" in err) is expected
  assert _is_png(tmp_path / "mixing_bench.png") and str(tmp_path / "mixing_bench.png") in err


def test_cli_bench_default_mixers_match_the_module():
  sub, _ = cli.parse(["bench", "mixing"])
  assert sub.mixers.split(",") == list(bench.DEFAULT_MIXERS)
  assert bench.parse_lengths(sub.lengths) == list(bench.DEFAULT_LENGTHS)


def test_cli_bench_unknown_mixer_is_an_error(capsys):
  assert cli.main(["bench", "mixing", "--mixers", "attention,nosuchmixer"]) == 2
  assert "nosuchmixer" in capsys.readouterr().err


# --- plots ---------------------------------------------------------------------------------------------------
def _tiny(arch: str, *bindings: str):
  module = models.from_gin(f"models/{arch}/tiny.gin", *bindings)
  t = jnp.ones((1, 8), jnp.int32)
  init = jax.jit(lambda rng: module.init(rng, t, t, t, enable_dropout=False))
  params = jax.tree_util.tree_map(np.array, init(jax.random.PRNGKey(0))["params"])
  return module, params


@pytest.fixture(scope="module")
def remixer_ckpt(tmp_path_factory):
  module, params = _tiny("remixer")
  # Spread H so that softmax(H) is far from uniform (a test against a uniform answer could not fail).
  for stack in ("encoder", "decoder"):
    for i, layer in enumerate(sorted(k for k in params[stack] if k.startswith("layers_"))):
      h = params[stack][layer]["feature_mixer"]["remix"]
      params[stack][layer]["feature_mixer"]["remix"] = 3.0 * jax.random.normal(jax.random.PRNGKey(i), h.shape)
  path = tmp_path_factory.mktemp("ckpt") / "remixer"
  checkpoints.save_params(path, params)
  return module, params, path


@pytest.fixture(scope="module")
def hypermixer_ckpt(tmp_path_factory):
  module, params = _tiny("hypermixer")
  path = tmp_path_factory.mktemp("ckpt") / "hypermixer"
  checkpoints.save_params(path, params)
  return module, params, path


def test_remix_matrices_are_softmax_of_h_with_rows_summing_to_one(remixer_ckpt):
  module, params, _ = remixer_ckpt
  mats = dict(plots.remix_matrices(params))
  cfg = module.config
  assert sorted(mats) == sorted(
    [f"encoder_layers_{i}" for i in range(cfg.num_encoder_layers)]
    + [f"decoder_layers_{i}" for i in range(cfg.num_decoder_layers)]
  )
  for name, m in mats.items():
    stack, layer = name.split("_", 1)
    h = np.asarray(params[stack][layer]["feature_mixer"]["remix"], np.float64)
    assert m.shape == h.shape == ((128, 128) if stack == "encoder" else (64, 64))
    np.testing.assert_allclose(m.sum(-1), 1.0, atol=1e-5)
    if stack == "decoder":  # causal: row i mixes positions j <= i only
      h = np.where(np.tril(np.ones(h.shape, bool)), h, -np.inf)
      assert np.all(m[np.triu_indices(h.shape[0], 1)] == 0)
    want = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(m, want / want.sum(-1, keepdims=True), atol=1e-6)
    assert m.max() > 0.2  # not a near-uniform matrix


def test_attention_maps_reproduce_the_attention_output():
  """With one head the map IS the layer's attention: weights @ value @ out equals the recorded output."""
  module, params = _tiny("remixer", "network.T5Config.num_heads=1", "network.T5Config.head_dim=128")
  tokens = jnp.array([[5, 9, 17, 33, 2, 1, 0]], jnp.int32)  # ends in padding: masked keys get weight 0
  maps = plots.attention_maps(module, params, tokens)
  assert [name for name, _ in maps] == ["encoder_layers_0", "encoder_layers_1"]
  calls = plots._record(module, params, tokens, lambda p: p[-1] in ("attention", "value"))
  for name, w in maps:
    layer = name.split("_", 1)[1]
    path = ("encoder", layer, "attention")
    np.testing.assert_allclose(w[:6].sum(-1), 1.0, atol=1e-5)
    assert np.all(w[:6, 6] < 1e-6)
    value = np.asarray(calls[path + ("value",)][0][2])[0]
    got = (w @ value) @ np.asarray(params["encoder"][layer]["attention"]["out"]["kernel"])
    np.testing.assert_allclose(got[:6], np.asarray(calls[path][0][2])[0, :6], rtol=1e-4, atol=1e-5)


def test_pseudo_attention_is_the_jacobian_block_norm(hypermixer_ckpt):
  module, params, _ = hypermixer_ckpt
  tokens = jnp.array([[5, 6, 7, 8, 9, 1]], jnp.int32)
  path = ("encoder", "layers_1", "token_mixer")
  got = plots.pseudo_attention(module, params, tokens, path)
  # Independently: the HyperMixing module alone on its recorded input, full Jacobian by jax.jacrev.
  x = plots._record(module, params, tokens, lambda p: p == path)[path][0][0][0]
  n = x.shape[1]
  mask = jnp.ones((1, n), jnp.float32)
  pos = jnp.arange(n, dtype=jnp.int32)[None]
  ctx = base.MixerContext(q_mask=mask, kv_mask=mask, q_positions=pos, kv_positions=pos)
  mixer = module.encoder_token_mixer(config=module.config.for_target())  # a mixer alone takes a named dtype
  f = lambda x_: mixer.apply({"params": params["encoder"]["layers_1"]["token_mixer"]}, x_, x_, ctx)[0]
  jac = jax.jacrev(f)(x)[:, :, 0]  # [i, d_out, j, d_in]
  want = np.sqrt(np.sum(np.square(np.asarray(jac)), axis=(1, 3)))
  assert got.shape == (n, n)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  assert not np.allclose(want, want[0, 0])  # the map has structure
  estimate = plots.pseudo_attention(module, params, tokens, path, samples=512)
  assert np.abs(estimate - want).max() < 0.1 * want.max()


def _plot(tmp_path, capsys, arch, ckpt, *extra):
  out = tmp_path / arch
  assert cli.main(["plot", f"--gin_file=models/{arch}/tiny.gin", str(ckpt), "--out", str(out), *extra]) == 0
  stdout, err = capsys.readouterr()
  files = sorted(p.name for p in out.iterdir())
  assert sorted(p.split("/")[-1] for p in stdout.split()) == files
  assert files and all(_is_png(out / f) for f in files)
  return files, err


def test_cli_plot_remixer_draws_h_per_layer_and_attention_per_encoder_layer(tmp_path, capsys, remixer_ckpt):
  module, _, ckpt = remixer_ckpt
  files, err = _plot(tmp_path, capsys, "remixer", ckpt, "--input_ids", "5,6,7,8,1")
  enc, dec = module.config.num_encoder_layers, module.config.num_decoder_layers
  assert files == sorted(
    [f"remix_encoder_layers_{i}.png" for i in range(enc)]
    + [f"remix_decoder_layers_{i}.png" for i in range(dec)]
    + [f"attention_encoder_layers_{i}.png" for i in range(enc)]
  )
  assert "skipping pseudo-attention" in err and "[5, 6, 7, 8, 1]" in err


def test_cli_plot_hypermixer_draws_pseudo_attention_and_skips_the_rest(tmp_path, capsys, hypermixer_ckpt):
  module, _, ckpt = hypermixer_ckpt
  files, err = _plot(tmp_path, capsys, "hypermixer", ckpt, "--length", "6")
  assert files == [f"pseudo_attention_encoder_layers_{i}.png" for i in range(module.config.num_encoder_layers)]
  assert "skipping softmax(H)" in err and "skipping attention" in err


def test_cli_plot_tokenises_text_with_a_vocabulary(tmp_path, capsys, remixer_ckpt):
  from remixer_t5.data import vocab

  spm = tmp_path / "tiny.model"
  spm.write_bytes(vocab.train_sentencepiece(["the cat sat on the mat", "a dog ran in the park"] * 20, 100))
  ids = list(vocab.get_vocabulary(str(spm)).encode("the cat sat")) + [1]
  _, _, ckpt = remixer_ckpt
  _, err = _plot(tmp_path, capsys, "remixer", ckpt, "--text", "the cat sat", "--vocabulary", str(spm))
  assert f"{len(ids)} input tokens: {ids}" in err


def test_plot_tokens_fall_back_to_seeded_random_ids():
  args = argparse.Namespace(text="words", vocabulary="/no/such.model", input_ids=None, length=12, seed=3)
  ids, labels = plot_command.tokens(args, vocab_size=50)
  assert ids == plot_command.tokens(args, vocab_size=50)[0]
  assert len(ids) == 12 and all(3 <= i < 50 for i in ids) and labels == [str(i) for i in ids]
  assert ids != plot_command.tokens(argparse.Namespace(**{**vars(args), "seed": 4}), vocab_size=50)[0]
  args.input_ids = "7,8,9"
  assert plot_command.tokens(args, vocab_size=50)[0] == [7, 8, 9]
