"""export-hf writes the run's tokenizer (spiece.model + T5's tokenizer config, 100 sentinels) beside the weights.

The transformers test runs only where transformers is importable (the optional hf extra), as in test_hf.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from remixer_t5 import checkpoints, cli, gin_utils, hf

SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Australian authorities are to be granted access to David Hicks, arrested in 1999!"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A train-like MODEL_DIR: config.gin of the demo run (embedded task, VOCABULARY None) + a params checkpoint."""
  d = tmp_path_factory.mktemp("run")
  gin_utils.parse_gin(["models/t5_1_1/tiny.gin", "runs/demo.gin"], [f"MODEL_DIR='{d}'"])
  model = gin_utils.macro("MODEL")
  (d / "config.gin").write_text(__import__("gin").config_str())
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 4), "decoder_target_tokens": (1, 4)}
  params = model.init_variables(jax.random.PRNGKey(0), shapes)["params"]
  checkpoints.save_params(d / "checkpoint", params)
  return d


def test_tokenizer_files_follow_t5(embedded_env):
  model = embedded_env.spm.read_bytes()
  files = hf.hf_tokenizer_files(model)
  assert sorted(files) == sorted(hf.TOKENIZER_FILES)
  assert files["spiece.model"] == model
  config = json.loads(files["tokenizer_config.json"])
  special = json.loads(files["special_tokens_map.json"])
  sentinels = [f"<extra_id_{i}>" for i in range(100)]
  assert config["extra_ids"] == 100 and config["tokenizer_class"] == "T5Tokenizer"
  for d in (config, special):
    assert (d["eos_token"], d["unk_token"], d["pad_token"]) == ("</s>", "<unk>", "<pad>")
    assert d["additional_special_tokens"] == sentinels
  assert json.loads(hf.hf_tokenizer_files(model, extra_ids=3)["tokenizer_config.json"])["extra_ids"] == 3


def test_tokenizer_files_refuse_what_t5_cannot_read(embedded_env):
  from remixer_t5.data import vocab
  with pytest.raises(ValueError, match="not a SentencePiece model"):
    hf.hf_tokenizer_files(b"not a model")
  # seqio's in-memory proto already holds the sentinels: writing it would double them.
  with pytest.raises(ValueError, match="already holds 100 sentinel pieces"):
    hf.hf_tokenizer_files(vocab.get_vocabulary(str(embedded_env.spm)).sp_model)
  with pytest.raises(ValueError, match="extra_ids must be >= 0"):
    hf.hf_tokenizer_files(embedded_env.spm.read_bytes(), extra_ids=-1)


def test_export_hf_writes_the_runs_tokenizer(model_dir, tmp_path, capsys, embedded_env):
  out = tmp_path / "hf"
  assert cli.main(["export-hf", str(model_dir), str(out)]) == 0
  assert "task embedded_span_corruption" in capsys.readouterr().out
  assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", *hf.TOKENIZER_FILES])
  assert (out / "spiece.model").read_bytes() == embedded_env.spm.read_bytes()
  assert json.loads((out / "tokenizer_config.json").read_text())["extra_ids"] == 100


def test_export_hf_without_a_known_vocabulary_says_so(model_dir, tmp_path, capsys, embedded_env):
  # An import-hf-like dir: model.gin has the model only, so there is no task to take the vocabulary from.
  gin_utils.parse_gin([str(model_dir / "config.gin")], ["MODEL_DIR=None"])
  src = tmp_path / "imported"
  src.mkdir()
  (src / "model.gin").write_text(cli.model_gin(gin_utils.macro("MODEL").module.config))
  checkpoints.save_params(src / "checkpoint", checkpoints.restore_any_params(model_dir))
  assert cli.main(["export-hf", str(src), str(tmp_path / "a")]) == 0
  err = capsys.readouterr().err
  assert "no tokenizer written" in err and "--vocabulary=" in err
  assert not (tmp_path / "a" / "spiece.model").exists()
  assert cli.main(["export-hf", str(src), str(tmp_path / "b"), f"--vocabulary={embedded_env.spm}"]) == 0
  assert (tmp_path / "b" / "spiece.model").read_bytes() == embedded_env.spm.read_bytes()


def test_autotokenizer_round_trips_our_encoding(model_dir, tmp_path, embedded_env):
  transformers = pytest.importorskip("transformers", reason="needs the optional hf extra (transformers)")
  from remixer_t5.data import vocab as vocab_lib
  out = tmp_path / "hf"
  assert cli.main(["export-hf", str(model_dir), str(out)]) == 0
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  ours = vocab_lib.get_vocabulary()
  assert len(tok) == ours.vocab_size == 2100
  for s in SENTENCES:
    ids = list(ours.encode(s))
    assert tok(s)["input_ids"] == ids + [1]  # T5's tokenizer appends EOS, as our inputs end
    assert tok.decode(ids) == ours.decode(ids) == s
  # Sentinels: <extra_id_0> is the last id on both sides, <extra_id_99> the first after the pieces.
  assert tok.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>"]) == [2099, 2000]
  assert list(ours.encode("<extra_id_0>")) == [2099]


T5_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"


@pytest.mark.skipif(not T5_VOCAB.exists(), reason=f"real T5 vocabulary not found at {T5_VOCAB}")
def test_real_t5_vocabulary_round_trips(tmp_path):
  """T5's own 32k model (its normalizer folds accents and spaces): HF's tokenizer from our files = seqio's ids."""
  transformers = pytest.importorskip("transformers", reason="needs the optional hf extra (transformers)")
  from remixer_t5.data import vocab as vocab_lib
  ours = vocab_lib.get_vocabulary(str(T5_VOCAB))
  for name, data in hf.vocabulary_tokenizer_files(ours).items():
    (tmp_path / name).write_bytes(data)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert len(tok) == ours.vocab_size == 32100
  for s in SENTENCES + ["Zürich's café — naïve résumé, 1,234.5 km!"]:
    assert tok(s, add_special_tokens=False)["input_ids"] == list(ours.encode(s))
  assert tok.convert_tokens_to_ids("<extra_id_0>") == 32099
