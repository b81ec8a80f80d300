"""export-hf writes the run's tokenizer (spiece.model, tokenizer.json + T5's tokenizer config, 100 sentinels)
beside the weights.

tokenizer.json is read with the `tokenizers` library (the test extra) and must encode as seqio does. The
transformers tests run only where transformers is importable (the optional hf extra), as in test_hf.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from remixer_t5.training import checkpoints
from remixer_t5 import cli, gin_utils
from remixer_t5.commands import import_hf
from remixer_t5.interop import hf

SENTENCES = [
  "The quick brown fox jumps over the lazy dog.",
  "Australian authorities are to be granted access to David Hicks, arrested in 1999!",
]
# Accents, digits, punctuation, runs of spaces, tabs and newlines, characters NFKC changes (ligatures, full-width
# letters, a combining accent), characters no vocabulary here holds, and sentinels written as T5 users write them.
TEXTS = SENTENCES + [
  "Zürich's café — naïve résumé, 1,234.5 km!",
  "Prices: $99.99 (50% off) on 2024-05-06 at 12:30; see §3 & «quotes».",
  "several   spaces\tand a tab\nand a newline\n\ntwice",
  "ﬁne ﬂour from Ｔｏｋｙｏ, ＷＯＲＬＤ １２３, e\u0301te\u0301",
  "emoji 😀😀 and 漢字 한국어",
  "<extra_id_0>",
  "The <extra_id_0> walks in <extra_id_1> park.",
  "<extra_id_0>. <extra_id_1>b <extra_id_2>",
]
# Whitespace that SentencePiece's remove_extra_whitespaces drops (T5's and the embedded vocabulary's normalizer;
# the COGS word vocabularies keep every space, see `hf.fast_tokenizer_json` for what differs there).
TEXTS_EXTRA_WHITESPACE = ["  leading and trailing  ", "\n a  <extra_id_0>  b \n", "\u3000wide\u00a0spaces ", "", "   "]
UNK_ID, EOS_ID = 2, 1
T5_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"


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
  # The fast class runs tokenizer.json as written, in transformers 4.x and 5.x (where it is TokenizersBackend).
  assert config["extra_ids"] == 100 and config["tokenizer_class"] == "PreTrainedTokenizerFast"
  for d in (config, special):
    assert (d["eos_token"], d["unk_token"], d["pad_token"]) == ("</s>", "<unk>", "<pad>")
    assert d["additional_special_tokens"] == sentinels
  assert json.loads(hf.hf_tokenizer_files(model, extra_ids=3)["tokenizer_config.json"])["extra_ids"] == 3


def test_tokenizer_json_is_t5s_unigram_tokenizer(embedded_env):
  """The structure transformers' T5Converter gives: Unigram pieces + sentinels counted down, </s> appended."""
  import base64

  from sentencepiece import sentencepiece_model_pb2 as pb

  model = embedded_env.spm.read_bytes()
  proto = pb.ModelProto.FromString(model)
  n = len(proto.pieces)
  fast = json.loads(hf.hf_tokenizer_files(model)["tokenizer.json"])
  assert fast == hf.fast_tokenizer_json(model)
  unigram = fast["model"]
  assert (unigram["type"], unigram["unk_id"], unigram["byte_fallback"]) == ("Unigram", 2, False)
  assert unigram["vocab"][:n] == [[p.piece, p.score] for p in proto.pieces]
  assert unigram["vocab"][n:] == [[f"<extra_id_{i}>", 0.0] for i in range(99, -1, -1)]
  added = {t["content"]: t["id"] for t in fast["added_tokens"]}
  assert added == {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"<extra_id_{i}>": n + 99 - i for i in range(100)}}
  assert all(t["special"] and not t["normalized"] for t in fast["added_tokens"])
  precompiled = fast["normalizer"]["normalizers"][0]
  assert precompiled["type"] == "Precompiled"
  assert base64.b64decode(precompiled["precompiled_charsmap"]) == proto.normalizer_spec.precompiled_charsmap
  assert fast["pre_tokenizer"] == {
    "type": "Metaspace",
    "replacement": "\u2581",
    "prepend_scheme": "first",
    "split": False,
  }
  assert fast["post_processor"]["type"] == "TemplateProcessing"
  assert fast["post_processor"]["special_tokens"] == {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}
  three = hf.fast_tokenizer_json(model, extra_ids=3)
  assert [v[0] for v in three["model"]["vocab"][n:]] == ["<extra_id_2>", "<extra_id_1>", "<extra_id_0>"]
  assert hf.fast_tokenizer_json(model, extra_ids=0)["model"]["vocab"] == unigram["vocab"][:n]


def test_tokenizer_json_reads_back_unchanged(embedded_env):
  """`tokenizers` keeps every component as written (nothing misspelled and silently dropped)."""
  tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (the test extra)")
  fast = hf.fast_tokenizer_json(embedded_env.spm.read_bytes())
  back = json.loads(tokenizers.Tokenizer.from_str(json.dumps(fast)).to_str())
  for key in fast:
    if key != "model":
      assert back[key] == fast[key], key
  assert back["model"]["type"] == "Unigram" and back["model"]["unk_id"] == 2
  assert [v[0] for v in back["model"]["vocab"]] == [v[0] for v in fast["model"]["vocab"]]
  assert [v[1] for v in back["model"]["vocab"]] == pytest.approx([v[1] for v in fast["model"]["vocab"]], rel=1e-12)


@pytest.fixture(params=["embedded", "cogs_words", "t5"])
def spm_case(request, tmp_path):
  """(SentencePiece model path, texts that must encode as seqio does) for three kinds of vocabulary:

  embedded: the project's 2000-piece unigram model (NFKC, extra whitespace removed);
  cogs_words: a word vocabulary as the COGS tasks build (one-rule character map, every space kept, byte fallback);
  t5: T5's own 32k model, when the shared data holds it.
  """
  if request.param == "embedded":
    return request.getfixturevalue("embedded_env").spm, TEXTS + TEXTS_EXTRA_WHITESPACE
  if request.param == "cogs_words":
    from remixer_t5.data import word_vocab

    path = tmp_path / "words.model"
    path.write_bytes(word_vocab.build_word_model(SENTENCES + ["a cat ate the cake .", "the girl saw a dog"]))
    return path, TEXTS
  if not T5_VOCAB.exists():
    pytest.skip(f"real T5 vocabulary not found at {T5_VOCAB}")
  return T5_VOCAB, TEXTS + TEXTS_EXTRA_WHITESPACE


def test_tokenizer_json_encodes_like_seqio(spm_case, tmp_path):
  tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (the test extra)")
  from remixer_t5.data import vocab as vocab_lib

  path, texts = spm_case
  (tmp_path / "tokenizer.json").write_bytes(hf.hf_tokenizer_files(path.read_bytes())["tokenizer.json"])
  tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  ours = vocab_lib.get_vocabulary(str(path))
  assert tok.get_vocab_size() == ours.vocab_size
  for text in texts:
    ids = list(ours.encode(text))
    assert tok.encode(text).ids == ids + [EOS_ID], text
    if UNK_ID not in ids:  # SentencePiece decodes <unk> as " ⁇ ", tokenizers as "<unk>"
      assert tok.decode(ids, skip_special_tokens=False) == ours.decode(ids), text
  # Not vacuous: the sentinels were found (<extra_id_0> the last id), and pairs end each sequence with </s>.
  last = ours.vocab_size - 1
  assert tok.encode("The <extra_id_0> walks in <extra_id_1> park.").ids.count(last) == 1
  assert list(ours.encode("<extra_id_0>")) == [last] and tok.encode("<extra_id_0>").ids == [last, EOS_ID]
  a, b = SENTENCES
  assert tok.encode(a, b).ids == list(ours.encode(a)) + [EOS_ID] + list(ours.encode(b)) + [EOS_ID]


def test_tokenizer_files_refuse_what_t5_cannot_read(embedded_env):
  from remixer_t5.data import vocab

  with pytest.raises(ValueError, match="not a SentencePiece model"):
    hf.hf_tokenizer_files(b"not a model")
  # seqio's in-memory proto already holds the sentinels: writing it would double them.
  with pytest.raises(ValueError, match="already holds 100 sentinel pieces"):
    hf.hf_tokenizer_files(vocab.get_vocabulary(str(embedded_env.spm)).sp_model)
  with pytest.raises(ValueError, match="extra_ids must be >= 0"):
    hf.hf_tokenizer_files(embedded_env.spm.read_bytes(), extra_ids=-1)
  # tokenizer.json is T5's unigram tokenizer with a "▁" word-start mark; other SentencePiece models are refused.
  from sentencepiece import sentencepiece_model_pb2 as pb

  for field, value, message in [
    ("model_type", pb.TrainerSpec.BPE, "BPE model"),
    ("add_dummy_prefix", False, "add_dummy_prefix off"),
    ("escape_whitespaces", False, "escape_whitespaces"),
  ]:
    proto = pb.ModelProto.FromString(embedded_env.spm.read_bytes())
    setattr(proto.trainer_spec if field == "model_type" else proto.normalizer_spec, field, value)
    with pytest.raises(ValueError, match=message):
      hf.fast_tokenizer_json(proto.SerializeToString())


def test_export_hf_writes_the_runs_tokenizer(model_dir, tmp_path, capsys, embedded_env):
  out = tmp_path / "hf"
  assert cli.main(["export-hf", str(model_dir), str(out)]) == 0
  assert "task embedded_span_corruption" in capsys.readouterr().out
  assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", *hf.TOKENIZER_FILES])
  assert (out / "spiece.model").read_bytes() == embedded_env.spm.read_bytes()
  assert json.loads((out / "tokenizer_config.json").read_text())["extra_ids"] == 100
  assert json.loads((out / "tokenizer.json").read_text()) == hf.fast_tokenizer_json(embedded_env.spm.read_bytes())


def test_export_hf_without_a_known_vocabulary_says_so(model_dir, tmp_path, capsys, embedded_env):
  # An import-hf-like dir: model.gin has the model only, so there is no task to take the vocabulary from.
  gin_utils.parse_gin([str(model_dir / "config.gin")], ["MODEL_DIR=None"])
  src = tmp_path / "imported"
  src.mkdir()
  (src / "model.gin").write_text(import_hf.model_gin(gin_utils.macro("MODEL").module.config))
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


# Run in a fresh interpreter where sentencepiece cannot be imported, as if it were not installed: transformers 5
# then reads spiece.model with a tiktoken reader, which fails, unless tokenizer.json is there.
_LOAD_WITHOUT_SENTENCEPIECE = """
import json, sys
sys.modules["sentencepiece"] = None  # `import sentencepiece` raises ImportError; find_spec says it is absent
import transformers
from transformers.utils import is_sentencepiece_available
try:
  import sentencepiece
  importable = True
except ImportError:
  importable = False
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.loads(sys.argv[2])
print(json.dumps({"sentencepiece": importable or is_sentencepiece_available(), "class": type(tok).__name__,
                  "len": len(tok), "ids": [tok(t)["input_ids"] for t in texts],
                  "decoded": [tok.decode(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]}))
"""


def test_autotokenizer_without_sentencepiece_encodes_like_seqio(model_dir, tmp_path, embedded_env):
  pytest.importorskip("transformers", reason="needs the optional hf extra (transformers)")
  from remixer_t5.data import vocab as vocab_lib

  out = tmp_path / "hf"
  assert cli.main(["export-hf", str(model_dir), str(out)]) == 0
  texts = TEXTS + TEXTS_EXTRA_WHITESPACE
  run = subprocess.run(
    [sys.executable, "-c", _LOAD_WITHOUT_SENTENCEPIECE, str(out), json.dumps(texts)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  got = json.loads(run.stdout.strip().splitlines()[-1])
  assert not got["sentencepiece"]
  assert got["class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")  # the latter in transformers 5
  ours = vocab_lib.get_vocabulary()
  assert got["len"] == ours.vocab_size == 2100
  for text, ids, decoded in zip(texts, got["ids"], got["decoded"]):
    want = list(ours.encode(text))
    assert ids == want + [EOS_ID], text
    if UNK_ID not in want:
      assert decoded == ours.decode(want), text
