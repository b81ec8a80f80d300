"""`remixer-t5 bench decode`: the evaluator's decode timed on tiny T5.1.1, its tokens against the evaluator's
predict function and (with the optional .[hf] extra) against transformers' generate on the same weights."""

import json
import sys

import flax
import jax
import numpy as np
import pytest

from remixer_t5.bench import decode as bench_decode
from remixer_t5 import cli
from remixer_t5.training import evaluation
from remixer_t5.model import models, network

ARGS = [
  "bench",
  "decode",
  "--gin_file=models/t5_1_1/tiny.gin",
  "--batch_size=3",
  "--input_length=12",
  "--new_tokens=6",
  "--steps=1",
  "--rounds=1",
  "--warmup=1",
]
SHAPE = dict(batch_size=4, input_length=12, new_tokens=8)


@pytest.fixture(scope="module")
def tiny():
  """The tiny T5.1.1 (models/t5_1_1/tiny.gin's sizes) and its parameters, fresh (seed 0)."""
  cfg = network.T5Config(
    vocab_size=2176,
    emb_dim=128,
    num_heads=4,
    head_dim=32,
    mlp_dim=256,
    num_encoder_layers=2,
    num_decoder_layers=2,
    mlp_activations=("gelu", "linear"),
  )
  model = models.EncoderDecoderModel(network.Transformer(cfg))
  shapes = {"encoder_input_tokens": (1, 12), "decoder_input_tokens": (1, 8), "decoder_target_tokens": (1, 8)}
  return model, model.init_variables(jax.random.PRNGKey(0), shapes)["params"]


def _eos_heavy(params, token: int, scale: float = 2.0):
  """The same parameters with EOS's output column = `scale` x `token`'s: wherever `token` won, EOS wins."""
  params = flax.core.unfreeze(jax.tree.map(np.array, params))
  kernel = params["decoder"]["logits_dense"]["kernel"]
  kernel[:, 1] = scale * kernel[:, token]
  return params


def _decode(model, params, modes=("greedy",), reference=None):
  outputs = {}
  settings = bench_decode.Settings(**SHAPE, modes=modes, steps=1, warmup=0, rounds=1)
  row = bench_decode.bench_decode(model, params, settings, reference=reference, outputs=outputs)
  return row, outputs


def _evaluator(model, params, enc, new_tokens):
  """What seqio evaluation gets for these inputs: evaluation.make_predict_fn over (index, features) rows."""

  class Rows:
    def as_numpy_iterator(self):
      return iter(
        [
          (i, {"encoder_input_tokens": e, "decoder_target_tokens": np.zeros(new_tokens, np.int32)})
          for i, e in enumerate(enc)
        ]
      )

  predicted = dict(evaluation.make_predict_fn(model, params, evaluation.Decoding(len(enc)))(Rows()))
  return np.array([predicted[i] for i in range(len(enc))])


def _zero_after_eos(tokens):
  seen = np.cumsum(tokens == 1, axis=-1)
  return np.where(np.concatenate([np.zeros_like(seen[:, :1]), seen[:, :-1]], axis=-1) > 0, 0, tokens)


@pytest.mark.integration
def test_cli_json_row_has_sane_fields(capsys):
  assert cli.main([*ARGS, "--json"]) == 0
  r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert (r["batch_size"], r["input_length"], r["new_tokens"], r["beam_size"]) == (3, 12, 6, 4)
  assert r["modes"] == ["greedy", "beam"] and r["steps"] == 1 and r["rounds"] == 1 and r["backend"] == "cpu"
  for mode in ("greedy", "beam"):
    s = r[f"ours_{mode}_s_per_batch"]
    assert 0 < s < 60 and r[f"ours_{mode}_round_medians"] == [s]
    assert r[f"ours_{mode}_tokens_per_s"] == pytest.approx(3 * 6 / s)
  assert not any(k.startswith(("hf_", "ratio_")) for k in r)  # no reference asked for
  assert r["cpu_model"] and r["cpu_count"] >= 1 and 1 <= r["cpus_usable"] <= r["cpu_count"]
  assert len(r["load_average_start"]) == 3 and len(r["load_average_end"]) == 3
  assert isinstance(r["host_malloc_policy"], bool) and "xla_flags" in r
  assert "cpu_hypermixing" in r and "cpu_threefry" in r  # what the CPU kernels ran (None: not used)
  assert r["git_commit"] is None or len(r["git_commit"].split("+")[0]) == 40
  assert r["activation_dtype"] == "float32" and r["vocab_size"] == 2176


def test_cli_text_report_greedy_only(capsys):
  assert cli.main([*ARGS, "--modes=greedy", "--reference=none"]) == 0
  out = capsys.readouterr().out
  assert "batch 3 x 12 input tokens, 6 new tokens" in out and "greedy" in out and "tokens/s" in out
  assert "beam" not in out and "HF" not in out


def test_greedy_tokens_are_the_evaluators(tiny):
  """The bench's greedy tokens are the evaluator's predict_fn's, which stop at EOS (zeros after it): equal up
  to and with each row's first EOS, on weights that never emit EOS and on weights that often do."""
  model, params = tiny
  _, out = _decode(model, params)
  ours, enc = out["ours_greedy"], out["inputs"]
  assert ours.shape == (4, 8) and enc.shape == (4, 12) and (enc[:, -1] == 1).all()
  np.testing.assert_array_equal(_evaluator(model, params, enc, 8), _zero_after_eos(ours))

  common = int(np.bincount(ours.ravel()).argmax())
  heavy = _eos_heavy(params, common)
  _, out = _decode(model, heavy)
  ours = out["ours_greedy"]
  assert (ours == 1).any(), "the EOS-heavy weights should emit EOS"
  assert (_zero_after_eos(ours) != ours).any(), "the bench decodes past EOS (every position timed)"
  np.testing.assert_array_equal(_evaluator(model, heavy, enc, 8), _zero_after_eos(ours))


def test_hf_generate_on_the_same_weights_gives_the_same_tokens(tiny):
  torch = pytest.importorskip("torch", reason="the HF reference needs the optional .[hf] extra (PyTorch); CI has none")
  pytest.importorskip("transformers", reason="the HF reference needs the optional .[hf] extra (transformers)")
  tiny_float = torch.full((1,), 1e-39)
  before = bool((tiny_float + tiny_float)[0].item() == 0)  # this thread's subnormal mode before the reference's
  try:
    _hf_generate_matches(*tiny)
  finally:
    torch.set_flush_denormal(before)


def _hf_generate_matches(model, params):
  row, out = _decode(model, params, modes=("greedy", "beam"), reference="hf")
  for mode in ("greedy", "beam"):
    np.testing.assert_array_equal(out[f"hf_{mode}"], out[f"ours_{mode}"])
    assert row[f"{mode}_identical_rows"] == 4 and row[f"{mode}_tokens_identical"] is True
    assert row[f"ratio_ours_to_hf_{mode}"] == pytest.approx(
      row[f"ours_{mode}_s_per_batch"] / row[f"hf_{mode}_s_per_batch"]
    )
    assert row[f"hf_{mode}_tokens_per_s"] == pytest.approx(4 * 8 / row[f"hf_{mode}_s_per_batch"])
  assert row["torch_num_threads"] >= 1 and row["transformers_version"]
  assert row["xla_denormals_flushed"] is True  # torch's: in a fresh process, test_hf_reference_flushes_denormals
  # EOS mid-sequence: HF does not stop there either (eos_token_id=None), and still agrees token for token.
  heavy = _eos_heavy(params, int(np.bincount(out["ours_greedy"].ravel()).argmax()))
  row, out = _decode(model, heavy, reference="hf")
  assert (out["ours_greedy"] == 1).any()
  np.testing.assert_array_equal(out["hf_greedy"], out["ours_greedy"])


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--reference=torch", "argument --reference: invalid choice: 'torch' (choose from 'hf', 'none')"),
    ("--beam_size=1", "--beam_size=1: expected an integer >= 2"),
    ("--modes=greedy,sample", "--modes greedy,sample: expected one or both of greedy, beam"),
    ("--new_tokens=0", "--new_tokens=0: expected an integer >= 1"),
    ("--lengths=16,8", "unrecognized arguments: --lengths=16,8"),
    ("--hf_denormals=keep", "--hf_denormals=keep sets the HF reference; it needs --reference hf"),
  ],
)
def test_bad_flags_are_one_clear_error(capsys, flag, message):
  try:
    code = cli.main([*ARGS, flag])
  except SystemExit as e:  # a usage error: argparse's
    code = e.code
  assert code == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith(f"remixer-t5: error: {message}"), errors


@pytest.mark.integration
def test_hf_reference_flushes_denormals_on_every_thread():
  """In a fresh process (the mode is per thread, and a test process's PyTorch threads may predate the setting):
  the default reference flushes subnormals wherever PyTorch computes, as XLA:CPU does."""
  pytest.importorskip("torch", reason="the HF reference needs the optional .[hf] extra (PyTorch); CI has none")
  pytest.importorskip("transformers", reason="the HF reference needs the optional .[hf] extra (transformers)")
  import os
  import subprocess
  import sys

  done = subprocess.run(
    [sys.executable, "-m", "remixer_t5", *ARGS, "--modes=greedy", "--reference=hf", "--json"],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert done.returncode == 0, done.stderr[-2000:]
  r = json.loads(done.stdout.strip().splitlines()[-1])
  assert r["torch_denormals_flushed"] is True and r["xla_denormals_flushed"] is True


def test_hf_reference_needs_a_t5_model(capsys, monkeypatch):
  """Checked before PyTorch or transformers is imported, so also without the .[hf] extra: both are made
  unimportable here (a None entry in sys.modules), so the test means the same with or without them installed."""
  monkeypatch.setitem(sys.modules, "torch", None)
  monkeypatch.setitem(sys.modules, "transformers", None)
  assert (
    cli.main(
      [
        "bench",
        "decode",
        "--gin_file=models/remixer/tiny.gin",
        "--batch_size=2",
        "--input_length=8",
        "--new_tokens=4",
        "--reference=hf",
      ]
    )
    == 2
  )
  err = capsys.readouterr().err
  assert "--reference hf needs a T5.1.1 model" in err and "missing param" in err
