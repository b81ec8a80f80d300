"""Fixed-length mixers follow the run's TASK_FEATURE_LENGTHS, and INIT_CHECKPOINTs trained at other lengths
are fitted (remixer_t5/model/fixed_length.py): rules, refusals, exactness on short sequences, and every tiny
architecture finetuning a few steps at runs/cogs.gin's lengths from a checkpoint made at 512/114."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remixer_t5.training import checkpoints, partitioning
from remixer_t5 import cli, gin_utils
from remixer_t5.model import fixed_length, models
from tiers import tiered

ARCHS = sorted(p.parent.name for p in gin_utils.gin_dir().glob("models/*/tiny.gin"))
FIXED = ["amlp", "gmlp", "mixer_enc", "mixer_encdec", "remixer"]
# `make test` finetunes the Remixer (both stacks have an L x L weight) and fits it and MLP-Mixer's encoder; the
# other architectures run in the integration tier (`make test-integration`, tests/conftest.py).
QUICK = ("remixer",)
SHRINK = [
  "network.T5Config.emb_dim=16",
  "network.T5Config.num_heads=2",
  "network.T5Config.head_dim=8",
  "network.T5Config.mlp_dim=24",
  "network.T5Config.num_encoder_layers=1",
  "network.T5Config.num_decoder_layers=1",
]
REAL_COGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "cogs"


def _shapes(module, enc=8, dec=6):
  v = jax.eval_shape(
    lambda: module.init(
      jax.random.PRNGKey(0), jnp.ones((1, enc), jnp.int32), jnp.ones((1, dec), jnp.int32), jnp.ones((1, dec), jnp.int32)
    )
  )
  return {jax.tree_util.keystr(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(v["params"])}


def _mixer_lengths(shapes):
  """{'encoder'|'decoder': the L of its position-indexed weights}, read from the param shapes."""
  out = {}
  for k, s in shapes.items():
    stack = "encoder" if k.startswith("['encoder']") else "decoder"
    if k.endswith(("['remix']", "['spatial_bias']")):
      out[stack] = s[0]
    elif k.endswith("['b2']") and "token_mixer" in k:
      out[stack] = s[0]
  return out


@pytest.mark.parametrize("arch", ["remixer", "gmlp", "mixer_enc"])
def test_lengths_follow_task_feature_lengths(arch):
  """Model file alone: its default; a run file after it: the run's; a flag: the flag's."""
  base = models.from_gin(f"models/{arch}/base.gin")
  want = {"encoder": 512, "decoder": 114} if arch != "mixer_enc" else {"encoder": 512}
  assert _mixer_lengths(_shapes(base)) == want
  gin_utils.parse_gin([f"models/{arch}/tiny.gin", "runs/cogs.gin"], [*SHRINK, "MODEL_DIR='/tmp/unused'"])
  want = {"encoder": 128, "decoder": 512} if arch != "mixer_enc" else {"encoder": 128}
  assert _mixer_lengths(_shapes(gin_utils.macro("MODEL").module)) == want
  gin_utils.parse_gin(
    [f"models/{arch}/tiny.gin", "runs/cogs.gin"],
    [*SHRINK, "MODEL_DIR='/tmp/unused'", "TASK_FEATURE_LENGTHS={'inputs': 20, 'targets': 10}"],
  )
  want = {"encoder": 20, "decoder": 10} if arch != "mixer_enc" else {"encoder": 20}
  assert _mixer_lengths(_shapes(gin_utils.macro("MODEL").module)) == want


def test_feature_length_refuses_bad_lengths():
  assert fixed_length.feature_length({"inputs": 7, "targets": 3}, "targets") == 3
  with pytest.raises(ValueError, match="'targets'.*{'inputs': 7}"):
    fixed_length.feature_length({"inputs": 7}, "targets")
  with pytest.raises(ValueError, match=r"TASK_FEATURE_LENGTHS\['inputs'\] must be a positive int, got 0"):
    fixed_length.feature_length({"inputs": 0}, "inputs")
  with pytest.raises(ValueError, match="bind it to %TASK_FEATURE_LENGTHS"):
    fixed_length.feature_length()


def test_fit_leaf_rules_and_refusals():
  old = np.arange(9.0).reshape(3, 3)
  fresh = -np.ones((5, 5))
  grown = fixed_length.fit_leaf("h", old, fresh, ("mix_length", "mix_source"))
  np.testing.assert_array_equal(grown[:3, :3], old)  # the old rows are unchanged
  np.testing.assert_array_equal(grown[3:], -1.0)  # new entries: the model's own initialisation
  np.testing.assert_array_equal(grown[:3, 3:], -1.0)
  shrunk = fixed_length.fit_leaf("h", old, -np.ones((2, 2)), ("mix_length", "mix_source"))
  np.testing.assert_array_equal(shrunk, old[:2, :2])
  w1 = fixed_length.fit_leaf("w1", np.ones((3, 4)), np.zeros((6, 4)), ("mix_length", "mix_hidden"))
  np.testing.assert_array_equal(w1, np.r_[np.ones((3, 4)), np.zeros((3, 4))])
  with pytest.raises(ValueError, match=r"w1 has shape \(3, 4\), the model \(3, 8\): axis 1 \(mix_hidden\)"):
    fixed_length.fit_leaf("w1", np.ones((3, 4)), np.zeros((3, 8)), ("mix_length", "mix_hidden"))
  with pytest.raises(ValueError, match="axis 0 \\(embed\\) differs"):
    fixed_length.fit_leaf("kernel", np.ones((3, 4)), np.zeros((5, 4)), ("embed", "mlp"))
  with pytest.raises(ValueError, match="different ranks"):
    fixed_length.fit_leaf("b", np.ones((3,)), np.zeros((3, 1)), ("mix_length", None))


def _init(module, enc, dec):
  return jax.jit(
    lambda: module.init(
      jax.random.PRNGKey(0),
      jnp.ones((1, enc), jnp.int32),
      jnp.ones((1, dec), jnp.int32),
      jnp.ones((1, dec), jnp.int32),
      enable_dropout=False,
    )
  )()


@pytest.mark.parametrize("arch", tiered(FIXED, (*QUICK, "mixer_enc")))
def test_fitted_checkpoint_gives_the_old_outputs_on_sequences_that_fit(arch, embedded_cache):
  """Params made at 16/8, fitted to 24/12 (grown) and 12/6 (shrunk): sequences of at most 12/6 tokens give
  the old logits exactly; a longer decoder sequence runs on the grown model."""

  def build(enc, dec):
    return models.from_gin(
      f"models/{arch}/tiny.gin",
      *SHRINK,
      "network.T5Config.vocab_size=40",
      f"TASK_FEATURE_LENGTHS={{'inputs': {enc}, 'targets': {dec}}}",
    )

  old_module = build(16, 8)
  v = _init(old_module, 16, 8)
  leaves, tree = jax.tree_util.tree_flatten(v["params"])  # move every weight off its initial value
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  old = jax.tree_util.tree_unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  rng = np.random.RandomState(0)
  enc_tokens = rng.randint(2, 40, (2, 12)).astype(np.int32)
  enc_tokens[1, 9:] = 0
  dec_out = rng.randint(2, 40, (2, 6)).astype(np.int32)
  dec_in = np.concatenate([np.zeros_like(dec_out[:, :1]), dec_out[:, :-1]], 1)
  run = lambda m, p, d_in, d_out: jax.jit(
    lambda p: m.apply({"params": p}, enc_tokens, d_in, d_out, enable_dropout=False)
  )(p)
  want = run(old_module, old, dec_in, dec_out)
  for enc, dec in ((24, 12), (12, 6)):
    module = build(enc, dec)
    fv = _init(module, enc, dec)
    fitted, resized = fixed_length.fit_params(old, fv["params"], partitioning.logical_axes(fv["params_axes"]))
    assert resized, arch
    assert jax.tree_util.tree_structure(fitted) == jax.tree_util.tree_structure(fv["params"])
    got = run(module, fitted, dec_in, dec_out)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  long_dec = rng.randint(2, 40, (2, 12)).astype(np.int32)
  module_grown = build(24, 12)
  fv = _init(module_grown, 24, 12)
  fitted, _ = fixed_length.fit_params(old, fv["params"], partitioning.logical_axes(fv["params_axes"]))
  out = run(module_grown, fitted, long_dec, long_dec)
  assert np.all(np.isfinite(np.asarray(out)))


ROWS = [
  ("A cat smiled .", "cat ( x _ 1 ) AND smile . agent ( x _ 2 , x _ 1 )", "in_distribution"),
  ("Emma slept .", "sleep . agent ( x _ 1 , Emma )", "in_distribution"),
  ("The dog ran .", "* dog ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "in_distribution"),
]


def _pretrained_at_512_114(arch, path):
  """A checkpoint of the tiny model made at pretraining's 512/114 (what `train` saves; its values are random)."""
  gin_utils.parse_gin([f"models/{arch}/tiny.gin", "runs/pretrain.gin"], [*SHRINK, "MODEL_DIR='/tmp/unused'"])
  module = gin_utils.macro("MODEL").module
  params = jax.jit(lambda: _init(module, 8, 6)["params"])()
  checkpoints.save_params(path, params)
  return params


def _finetune(arch, root, data_dir, steps=2):
  init = root / f"{arch}-pre"
  _pretrained_at_512_114(arch, init)
  args = [
    "train",
    f"--gin_file=models/{arch}/tiny.gin",
    "--gin_file=runs/cogs.gin",
    *[f"--gin.{b}" for b in SHRINK],
    "--gin.VOCABULARY=@vocab.get_vocabulary()",
    "--gin.BATCH_SIZE=2",
    f"--gin.TRAIN_STEPS={steps}",
    "--gin.LOG_PERIOD=1",
    "--gin.EVAL_PERIOD=0",
    f"--gin.CHECKPOINT_PERIOD={steps}",
    f"--gin.MODEL_DIR='{root / arch}'",
    f"--gin.DATA_DIR='{data_dir}'",
    f"--gin.INIT_CHECKPOINT='{init}'",
  ]
  assert cli.main(args) == 0
  log = (root / arch / "train.log").read_text() if (root / arch / "train.log").exists() else ""
  params = checkpoints.restore_any_params(root / arch)
  return params, log


# Every architecture whose parameters or position tables depend on the length, and T5.1.1 as the control;
# HyperMixer and linear attention (sinusoidal positions) have neither.
LENGTH_BOUND = [a for a in ARCHS if a not in ("hypermixer", "linear_attention")]


@pytest.mark.parametrize("arch", tiered(LENGTH_BOUND, QUICK))
def test_every_architecture_finetunes_at_cogs_lengths_from_a_512_114_checkpoint(
  arch, tmp_path, embedded_cache, monkeypatch
):
  """runs/cogs.gin's 128/512 from INIT_CHECKPOINT made at 512/114 (fake COGS rows: needs no shared data), for
  every architecture a length change can break."""
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)
  data = tmp_path / "data" / "cogs"
  data.mkdir(parents=True)
  for name in ("train.tsv", "dev.tsv", "test.tsv", "gen.tsv"):
    (data / name).write_text("".join("\t".join(r) + "\n" for r in ROWS), encoding="utf-8")
  params, _ = _finetune(arch, tmp_path, tmp_path / "data")
  shapes = _mixer_lengths(
    {jax.tree_util.keystr(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(params)}
  )
  if arch in FIXED:
    assert shapes == ({"encoder": 128} if arch.startswith("mixer_") else {"encoder": 128, "decoder": 512})
  for leaf in jax.tree_util.tree_leaves(params):
    assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.integration
@pytest.mark.skipif(not REAL_COGS.is_dir(), reason=f"real COGS data not found at {REAL_COGS}")
def test_gmlp_finetunes_on_real_cogs_from_a_512_114_checkpoint(tmp_path, embedded_cache, monkeypatch):
  """The real COGS train split (2,357 of its targets are longer than 114 T5 tokens, the decoder's old L)."""
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)
  params, _ = _finetune("gmlp", tmp_path, REAL_COGS.parent)
  for leaf in jax.tree_util.tree_leaves(params):
    assert np.all(np.isfinite(np.asarray(leaf)))
