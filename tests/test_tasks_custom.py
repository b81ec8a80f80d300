"""Tasks from your own files (tasks/custom.py): rows as written in TSV and JSONL, span corruption, globs, errors
naming file and line, idempotent registration; the CLI's --train_file/--validation_file and the gin-only route,
through docs/data.md's worked example ("Your own data"), which runs here as written."""

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [("hello world", "bonjour le monde"), ("the cat sat", "le chat"), ("two", "deux")]


@pytest.fixture(autouse=True)
def _unregister():
  """Each test registers its own tasks; none outlives it (nor its vocabulary copies, `<name>#<vocab>`)."""
  yield
  import seqio

  from remixer_t5.tasks import custom

  for name in list(custom._registered):  # noqa: SLF001
    for registered in list(seqio.TaskRegistry.names()):
      if registered == name or registered.startswith(f"{name}#"):
        seqio.TaskRegistry.remove(registered)
    del custom._registered[name]  # noqa: SLF001


def _write(path: Path, lines) -> str:
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


def _examples(name, split="train", lengths=None):
  import seqio

  task = seqio.get_mixture_or_task(name)
  ds = task.get_dataset(lengths or {"inputs": 32, "targets": 32}, split=split, shuffle=False, use_cached=False)
  return task, list(ds.as_numpy_iterator())


def _encode(vocab, text):
  import tensorflow as tf

  return vocab.encode_tf(tf.constant([text])).to_list()[0]


def _check_pairs(name, pairs, split="train"):
  """The examples are `pairs` in order: the text kept, the ids the vocabulary gives them, EOS appended."""
  task, examples = _examples(name, split)
  vocab = task.output_features["targets"].vocabulary
  assert [(ex["inputs_pretokenized"].decode(), ex["targets_pretokenized"].decode()) for ex in examples] == pairs
  for ex, (inputs, targets) in zip(examples, pairs):
    assert ex["inputs"].tolist() == _encode(vocab, inputs) + [1]
    assert ex["targets"].tolist() == _encode(vocab, targets) + [1]


# --- rows as written -----------------------------------------------------------------------------------------
def test_tsv_with_header_headerless_and_jsonl_give_the_rows(embedded_env, tmp_path):
  from remixer_t5.data.vocab import get_vocabulary
  from remixer_t5.tasks import custom

  header = _write(tmp_path / "a.tsv", ["extra\ttargets\tinputs", *[f"x\t{t}\t{i}" for i, t in PAIRS[:2]]])
  plain = _write(tmp_path / "b.txt", ["", *[f"{i}\t{t}" for i, t in PAIRS[2:]], ""])
  jsonl = _write(tmp_path / "c.jsonl", [json.dumps({"inputs": i, "targets": t, "id": 7}) for i, t in PAIRS])
  name = custom.register("custom_rows", train=[header, plain], validation=jsonl)
  task, _ = _examples(name)
  assert task.output_features["targets"].vocabulary == get_vocabulary()  # the project's embedded vocabulary
  assert task.output_features["inputs"].add_eos and task.output_features["targets"].add_eos
  assert list(task.splits) == ["train", "validation"]
  _check_pairs(name, PAIRS)
  _check_pairs(name, PAIRS, "validation")
  # Equal arguments: a no-op; other files: refused, naming the argument.
  assert custom.register("custom_rows", train=[header, plain], validation=jsonl) == name
  with pytest.raises(ValueError, match=r"'custom_rows' is already registered with validation=.*c\.jsonl"):
    custom.register("custom_rows", train=[header, plain], validation=header)
  with pytest.raises(ValueError, match="already registered with objective="):
    custom.register("custom_rows", train=[header, plain], validation=jsonl, objective="span_corruption")
  with pytest.raises(ValueError, match="not by custom.register"):
    custom.register("embedded_span_corruption", train=header)


def test_field_names_glob_gz_and_numbers(embedded_env, tmp_path):
  import gzip

  from remixer_t5.tasks import custom

  (tmp_path / "data").mkdir()
  _write(tmp_path / "data" / "part-0.tsv", ["question\tanswer", "two\t2", "the cat sat\tle chat"])
  (tmp_path / "data" / "part-1.jsonl.gz").write_bytes(
    gzip.compress(json.dumps({"question": "hello world", "answer": 3}).encode() + b"\n")
  )
  name = custom.register(
    "custom_glob",
    train=str(tmp_path / "data" / "part-*"),
    inputs_field="question",
    targets_field="answer",
    metrics=["exact_match", "accuracy"],
  )
  _check_pairs(name, [("two", "2"), ("the cat sat", "le chat"), ("hello world", "3")])
  import seqio

  task = seqio.get_mixture_or_task(name)
  targets = [task.postprocess_fn(b"le chat", example={}, is_target=True)]
  assert [fn(targets, ["le chat"]) for fn in task.metric_fns] == [{"exact_match": 100.0}, {"accuracy": 100.0}]


def test_span_corruption_reassembles_the_text(embedded_env, tmp_path):
  import seqio

  from remixer_t5.data.span_corruption import random_spans_helper
  from remixer_t5.tasks import custom

  docs = [
    f"Story {i}. The cat sat on a mat while rain fell over the quiet town and people walked home." * 2 for i in range(4)
  ]
  train = _write(tmp_path / "corpus.jsonl", [json.dumps({"body": d, "url": "x"}) for d in docs])
  plain = _write(tmp_path / "corpus.txt", docs)  # headerless: one document a line
  name = custom.register("custom_spans", train=train, validation=plain, objective="span_corruption", text_field="body")
  task = seqio.get_mixture_or_task(name)
  vocab = task.output_features["targets"].vocabulary
  assert not task.output_features["inputs"].required and task.metric_fns == []
  lengths = {"inputs": 64, "targets": random_spans_helper(64)[1]}
  for split in ("train", "validation"):
    _, examples = _examples(name, split, lengths)
    raw = []
    for ex in examples:
      inputs, targets = ex["inputs"].tolist(), ex["targets"].tolist()
      assert inputs[-1] == targets[-1] == vocab.eos_id
      sentinels = [t for t in inputs if t >= vocab.vocab_size - vocab.extra_ids]
      # <extra_id_0> is the last id, counting down; the same sentinels in the same order on both sides.
      assert sentinels and sentinels == [t for t in targets if t >= vocab.vocab_size - vocab.extra_ids] == list(
        range(vocab.vocab_size - 1, vocab.vocab_size - 1 - len(sentinels), -1)
      )
      spans, current = {}, None
      for t in targets[:-1]:
        if t in sentinels:
          current = spans.setdefault(t, [])
        else:
          current.append(t)
      raw += [x for t in inputs[:-1] for x in (spans[t] if t in sentinels else [t])]
    assert raw == [t for d in docs for t in _encode(vocab, d)]


# --- errors name the file, the line and what was expected --------------------------------------------------------
@pytest.mark.parametrize(
  "name,lines,kwargs,message",
  [
    (
      "bad.jsonl",
      ['{"inputs": "a", "targets": "b"}', '{"inputs": "a"}'],
      {},
      r"bad\.jsonl:2: row lacks field\(s\) \['targets'\]",
    ),
    ("bad.jsonl", ['{"inputs": "a", "targets": ["b"]}'], {}, r"bad\.jsonl:1: field 'targets' must be a string"),
    ("bad.jsonl", ['{"inputs": "a", "targets": "b"', ""], {}, r"bad\.jsonl:1: malformed JSON line"),
    ("bad.tsv", ["a\tb", "c\td\te"], {}, r"bad\.tsv:2: expected 2 tab-separated field\(s\) \(inputs, targets\), got 3"),
    ("bad.tsv", ["a\tb\tc"], {}, r"bad\.tsv:1: expected a header row naming 'inputs', 'targets', or no header"),
    ("bad.tsv", ["inputs\tlabel", "a\tb"], {}, r"bad\.tsv:1: header lacks column\(s\) \['targets'\]"),
    ("bad.tsv", [], {}, r"bad\.tsv: empty file \(no rows\)"),
    ("bad.tsv", ["inputs\ttargets", ""], {}, r"bad\.tsv: empty file \(only a header row\)"),
    ("bad.tsv", ["text", "a\tb"], {"objective": "span_corruption"}, r"bad\.tsv:2: expected 1 tab-separated field"),
  ],
)
def test_bad_rows_name_file_and_line(embedded_env, tmp_path, name, lines, kwargs, message):
  import tensorflow as tf

  from remixer_t5.tasks import custom

  path = _write(tmp_path / name, lines)
  task_name = custom.register("custom_bad", train=path, **kwargs)
  with pytest.raises((ValueError, tf.errors.OpError), match=message):
    _examples(task_name, lengths={"inputs": 32, "targets": 16})


def test_a_bad_line_of_a_large_file_stops_the_stream_naming_it(embedded_env, tmp_path, monkeypatch):
  """Files above CHECK_ALL_BYTES are checked by their first row only; tf.data's parse names a later bad line."""
  import tensorflow as tf

  from remixer_t5.tasks import custom

  monkeypatch.setattr(custom, "CHECK_ALL_BYTES", 0)
  path = _write(tmp_path / "big.tsv", ["inputs\ttargets", "a\tb", "", "c"])
  name = custom.register("custom_big", train=path)
  with pytest.raises(
    tf.errors.OpError,
    match=r"big\.tsv:4: expected 2 tab-separated field\(s\) \(inputs, "
    r"targets\), got 1",
  ):
    _examples(name)


def test_bad_arguments(tmp_path):
  from remixer_t5.tasks import custom

  good = _write(tmp_path / "good.tsv", ["a\tb"])
  odd = _write(tmp_path / "data.csv", ["a,b"])
  for kwargs, message in [
    ({"train": good, "objective": "lm"}, r"unknown objective 'lm'; expected one of \['inputs_targets'"),
    ({"train": good, "format": "csv"}, r"unknown format 'csv'; expected one of \['auto', 'tsv', 'jsonl'\]"),
    ({"train": odd}, r"data\.csv: cannot tell the format from the file name"),
    ({}, r"no files; pass train=, validation= and/or test="),
    ({"train": []}, r"train=\[\]: expected a path, a glob"),
    ({"train": good, "metrics": ["bleu"]}, r"unknown metric\(s\) \['bleu'\]"),
    ({"train": good, "objective": "span_corruption", "metrics": ["accuracy"]}, "loss only"),
  ]:
    with pytest.raises(ValueError, match=message):
      custom.register("custom_args", **kwargs)
  with pytest.raises(FileNotFoundError, match=r"validation: no file matches .*missing-\*\.tsv"):
    custom.register("custom_args", train=good, validation=str(tmp_path / "missing-*.tsv"))
  assert custom.register("custom_args", train=odd, format="tsv") == "custom_args"  # named format: any file name


# --- the CLI and gin, through docs/data.md's worked example ------------------------------------------------------
def _worked_example():
  """docs/data.md "Your own data": {file name: text} of the files it shows, and its commands (argv lists)."""
  text = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
  section = text.split("## Your own data", 1)[1].split("\n## ", 1)[0]
  files = dict(re.findall(r"`([\w.]+\.(?:jsonl|tsv))`[^`\n]*:\n\n```\w*\n(.*?)^```", section, re.S | re.M))
  commands = []
  for m in re.finditer(r"^```bash\n(.*?)^```", section, re.S | re.M):
    for line in m.group(1).replace("\\\n", " ").splitlines():
      tokens = shlex.split(line)
      if tokens and tokens[0] == "remixer-t5":
        commands.append(tokens[1:])
  return files, commands


def test_docs_worked_example_trains_and_infers(embedded_env, tmp_path, monkeypatch, capsys):
  import gin
  import seqio

  from remixer_t5 import cli, gin_utils
  from remixer_t5.training import run_config

  files, commands = _worked_example()
  assert set(files) == {"train.jsonl", "dev.tsv"} and len(commands) == 3
  assert "\t" in files["dev.tsv"]
  monkeypatch.chdir(tmp_path)
  for name, body in files.items():
    (tmp_path / name).write_text(body, encoding="utf-8")
  model_dir = tmp_path / "run"
  train, infer, gin_only = [
    [f"--gin.MODEL_DIR='{model_dir}'" if a.startswith("--gin.MODEL_DIR=") else a for a in argv] for argv in commands
  ]
  assert train[0] == "train" and infer[0] == "infer" and gin_only[0] == "train"
  quick = [
    "--gin.TRAIN_STEPS=6",
    "--gin.EVAL_PERIOD=6",
    "--gin.CHECKPOINT_PERIOD=6",
    "--gin.LOG_PERIOD=3",
    "--gin.EVAL_STEPS=1",
    "--gin.run_config.Schedule.num_decoded_examples=1",
  ]
  assert cli.main(train + quick) == 0
  rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
  assert {(r["split"], r["step"]) for r in rows} >= {("train", 6), ("validation", 0), ("validation", 6)}
  assert "custom.register.validation" in (model_dir / "config.gin").read_text()
  capsys.readouterr()
  assert cli.main(infer) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  predictions = [json.loads(line) for line in Path(out["output"]).read_text().splitlines()]
  assert Path(out["output"]) == model_dir / "infer" / "custom-validation.jsonl"
  assert [(p["inputs"], p["targets"]) for p in predictions] == [("translate: one", "un"), ("translate: two", "deux")]
  assert all(isinstance(p["prediction"], str) for p in predictions)

  # The gin-only route binds the same task: the run's Data.task is the registered name, its rows the files'.
  gin_files, bindings, paths, rest = gin_utils.split_flags(gin_only[1:])
  assert not rest
  gin_utils.parse_gin(gin_files, bindings, paths)
  assert run_config.from_gin().data.task == "custom"
  task = seqio.get_mixture_or_task("custom")
  assert task.source.split_files["validation"] == [str(tmp_path / "dev.tsv")]
  _check_pairs(
    "custom", [(json.loads(r)["inputs"], json.loads(r)["targets"]) for r in files["train.jsonl"].splitlines()]
  )
  gin.clear_config()


def test_cli_flag_errors(tmp_path, capsys):
  from remixer_t5 import cli
  from remixer_t5.commands import common

  base = ["--gin_file=models/t5_1_1/tiny.gin", "--gin_file=runs/demo.gin", f"--gin.MODEL_DIR='{tmp_path}'"]
  data = _write(tmp_path / "t.tsv", ["a\tb"])
  for argv, message in [
    (["train", *base, "--objective=span_corruption"], "--objective applies to --train_file"),
    (["train", *base, f"--train_file={data}"], "pass --validation_file too"),
    (
      ["eval", *base, f"--validation_file={data}", "--gin.MIXTURE_OR_TASK_NAME='cogs'"],
      "drop --gin.MIXTURE_OR_TASK_NAME",
    ),
  ]:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
  args, _ = cli.parse(
    [
      "infer",
      "--train_file",
      "a.tsv",
      "--train_file",
      "gs://b/c-*.jsonl",
      "--gin_file=x.gin",
      "--validation_file=d.tsv",
      "--objective",
      "span_corruption",
      "--gin.BATCH_SIZE=2",
    ]
  )
  files, bindings, _ = common.custom_data(args)
  assert files[0] == "x.gin" and files[1].endswith("gin/runs/custom.gin") and bindings[-1] == "BATCH_SIZE=2"
  assert bindings[:3] == [
    f"custom.register.train={[str(Path('a.tsv').absolute()), 'gs://b/c-*.jsonl']!r}",
    f"custom.register.validation={[str(Path('d.tsv').absolute())]!r}",
    "custom.register.objective='span_corruption'",
  ]
