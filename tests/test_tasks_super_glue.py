"""SuperGLUE seqio tasks (tasks/super_glue.py) and their metrics (end of tasks/metrics.py).

Local rows are written in the official release jsonl formats; the expected text-to-text strings are written
by hand from T5's formats (t5/data/preprocessors.py glue / record / wsc_simple).
"""

import json
from pathlib import Path

import pytest
import seqio

SHARED = Path(__file__).resolve().parents[2] / "shared"
FEWGLUE = SHARED / "data" / "super_glue"
T5_VOCAB = SHARED / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"
BYTES = seqio.ByteVocabulary()  # tiny and offline: these tests check strings, not T5's pieces
PREFIX = "test_sg_bytes_"
DIRS = {
  "boolq": "BoolQ",
  "cb": "CB",
  "copa": "COPA",
  "multirc": "MultiRC",
  "record": "ReCoRD",
  "rte": "RTE",
  "wic": "WiC",
  "wsc": "WSC",
  "axb": "AX-b",
  "axg": "AX-g",
}

# --- release rows ------------------------------------------------------------------------------------------------
RECORD_TEXT = "Tom met Ann Lee in Paris.\n@highlight\nTom and Ann meet\n@highlight\nThey like Paris!"


def _span(text, word, last=False):
  start = text.rfind(word) if last else text.find(word)
  return {"start": start, "end": start + len(word) - 1}


def _record_row(idx, with_answers=True):
  entities = [
    _span(RECORD_TEXT, "Tom"),
    _span(RECORD_TEXT, "Ann Lee"),
    _span(RECORD_TEXT, "Paris"),
    _span(RECORD_TEXT, "Tom", last=True),
    _span(RECORD_TEXT, "Ann", last=True),
    _span(RECORD_TEXT, "Paris", last=True),
  ]
  qas = [
    {
      "query": "@placeholder met Ann Lee.",
      "idx": 10 * idx,
      "answers": [
        {**_span(RECORD_TEXT, "Tom"), "text": "Tom"},
        {**_span(RECORD_TEXT, "Tom", last=True), "text": "Tom"},
      ],
    },
    {
      "query": "Tom met @placeholder in Paris.",
      "idx": 10 * idx + 1,
      "answers": [
        {**_span(RECORD_TEXT, "Ann Lee"), "text": "Ann Lee"},
        {**_span(RECORD_TEXT, "Ann", last=True), "text": "Ann"},
      ],
    },
  ]
  if not with_answers:
    qas = [{k: v for k, v in qa.items() if k != "answers"} for qa in qas]
  return {"source": "CNN", "passage": {"text": RECORD_TEXT, "entities": entities}, "qas": qas, "idx": idx}


MULTIRC_ROW = {
  "idx": 4,
  "version": 1.1,
  "passage": {
    "text": "Sent 1: <b>Tom</b> met Ann.<br>Sent 2: They ate. ",
    "questions": [
      {
        "question": "Who met Ann?",
        "idx": 7,
        "answers": [{"text": "Tom", "idx": 20, "label": 1}, {"text": "Bob", "idx": 21, "label": 0}],
      },
      {"question": "What did they do?", "idx": 8, "answers": [{"text": "They ate", "idx": 22, "label": 1}]},
    ],
  },
}
WSC_BOY = (
  'The boy continued to whip the pony , and eventually the pony threw him over. John laughed out quite '
  'loud. "Good for him," he said. '
)  # one of T5's two special cases: the word is "him," not "him"
ROWS = {
  "boolq": {
    "train.jsonl": [
      {"question": "is the sky blue", "passage": "Sky -- The sky is blue.", "idx": 0, "label": True},
      {"question": "is snow hot", "passage": "Snow -- Snow is cold.", "idx": 1, "label": False},
    ],
    "val.jsonl": [{"question": "is ice cold", "passage": "Ice -- Ice is frozen water.", "idx": 0, "label": True}],
    "test.jsonl": [{"question": "is fire wet", "passage": "Fire -- Fire burns.", "idx": 0}],
  },
  "cb": {
    "train.jsonl": [
      {"premise": "It rained all night.", "hypothesis": "the ground is wet", "label": "neutral", "idx": 3},
      {"premise": "I know that Ann left.", "hypothesis": "Ann left", "label": "entailment", "idx": 4},
    ],
    "val.jsonl": [{"premise": "I doubt that Ann left.", "hypothesis": "Ann left", "label": "contradiction", "idx": 0}],
    "test.jsonl": [{"premise": "Maybe Ann left.", "hypothesis": "Ann left", "idx": 0}],
  },
  "copa": {
    "train.jsonl": [
      {
        "premise": "The man broke his toe.",
        "choice1": "He dropped a hammer on his foot.",
        "choice2": "He got a hole in his sock.",
        "question": "cause",
        "label": 0,
        "idx": 0,
      }
    ],
    "val.jsonl": [
      {
        "premise": "I tipped the bottle.",
        "choice1": "The bottle froze.",
        "choice2": "The water poured out.",
        "question": "effect",
        "label": 1,
        "idx": 1,
      }
    ],
    "test.jsonl": [
      {"premise": "It got dark.", "choice1": "I lit a lamp.", "choice2": "I ate.", "question": "effect", "idx": 2}
    ],
  },
  "multirc": {
    "train.jsonl": [MULTIRC_ROW],
    "val.jsonl": [MULTIRC_ROW],
    "test.jsonl": [json.loads(json.dumps(MULTIRC_ROW).replace(', "label": 1', "").replace(', "label": 0', ""))],
  },
  "record": {
    "train.jsonl": [_record_row(1)],
    "val.jsonl": [_record_row(2)],
    "test.jsonl": [_record_row(3, with_answers=False)],
  },
  "rte": {
    "train.jsonl": [{"premise": "A cat sat.", "hypothesis": "An animal sat.", "label": "entailment", "idx": 0}],
    "val.jsonl": [{"premise": "A cat sat.", "hypothesis": "A dog sat.", "label": "not_entailment", "idx": 0}],
    "test.jsonl": [{"premise": "A cat ran.", "hypothesis": "A cat moved.", "idx": 0}],
  },
  "wic": {
    "train.jsonl": [
      {
        "word": "bank",
        "sentence1": "He sat on the bank.",
        "sentence2": "The bank was closed.",
        "idx": 0,
        "label": False,
        "start1": 14,
        "end1": 18,
        "start2": 4,
        "end2": 8,
        "version": 1.1,
      }
    ],
    "val.jsonl": [
      {
        "word": "run",
        "sentence1": "I run daily.",
        "sentence2": "They run fast.",
        "idx": 0,
        "label": True,
        "start1": 2,
        "end1": 5,
        "start2": 5,
        "end2": 8,
        "version": 1.1,
      }
    ],
    "test.jsonl": [
      {
        "word": "set",
        "sentence1": "Set the table.",
        "sentence2": "A set of tools.",
        "idx": 0,
        "start1": 0,
        "end1": 3,
        "start2": 2,
        "end2": 5,
        "version": 1.1,
      }
    ],
  },
  "wsc": {
    "train.jsonl": [
      {
        "text": "Mark told Pete many lies about himself , which Pete included in his book .",
        "target": {"span1_index": 0, "span1_text": "Mark", "span2_index": 12, "span2_text": "his"},
        "idx": 0,
        "label": True,
      },
      {
        "text": "Mark told Pete many lies about himself , which Pete included in his book .",
        "target": {"span1_index": 2, "span1_text": "Pete", "span2_index": 12, "span2_text": "his"},
        "idx": 1,
        "label": False,
      },
      {
        "text": WSC_BOY,
        "target": {"span1_index": 6, "span1_text": "pony", "span2_index": 22, "span2_text": "him"},
        "idx": 2,
        "label": True,
      },
    ],
    "val.jsonl": [
      # "The dishwasher" is not in the text: TFDS's wsc.fixed lower-cases it to match the text.
      {
        "text": "Fred was to run the dishwasher , but he put it off .",
        "target": {"span1_index": 4, "span1_text": "The dishwasher", "span2_index": 10, "span2_text": "it"},
        "idx": 5,
        "label": False,
      }
    ],
    "test.jsonl": [
      {
        "text": "Sam hugged Tim because he was sad .",
        "target": {"span1_index": 2, "span1_text": "Tim", "span2_index": 4, "span2_text": "he"},
        "idx": 0,
      }
    ],
  },
  "axb": {
    "AX-b.jsonl": [
      {
        "sentence1": "The cat sat on the mat.",
        "sentence2": "A cat sat.",
        "label": "entailment",
        "idx": 0,
        "logic": "Upward monotone",
      }
    ]
  },
  "axg": {
    "AX-g.jsonl": [
      {
        "premise": "The nurse helped the patient because he was kind.",
        "hypothesis": "The nurse was kind.",
        "label": "entailment",
        "idx": 0,
        "pair_id": 11,
      },
      {
        "premise": "The nurse helped the patient because she was kind.",
        "hypothesis": "The nurse was kind.",
        "label": "entailment",
        "idx": 1,
        "pair_id": 11,
      },
    ]
  },
}

# split -> [(inputs, targets)], by hand from T5's formats.
EXPECTED = {
  "boolq": {
    "train": [
      ("boolq passage: Sky -- The sky is blue. question: is the sky blue", "True"),
      ("boolq passage: Snow -- Snow is cold. question: is snow hot", "False"),
    ],
    "validation": [("boolq passage: Ice -- Ice is frozen water. question: is ice cold", "True")],
    "test": [("boolq passage: Fire -- Fire burns. question: is fire wet", "<unk>")],
  },
  "cb": {
    "train": [
      ("cb hypothesis: the ground is wet premise: It rained all night.", "neutral"),
      ("cb hypothesis: Ann left premise: I know that Ann left.", "entailment"),
    ],
    "validation": [("cb hypothesis: Ann left premise: I doubt that Ann left.", "contradiction")],
    "test": [("cb hypothesis: Ann left premise: Maybe Ann left.", "<unk>")],
  },
  "copa": {
    "train": [
      (
        "copa choice1: He dropped a hammer on his foot. choice2: He got a hole in his sock. premise: "
        "The man broke his toe. question: cause",
        "choice1",
      )
    ],
    "validation": [
      (
        "copa choice1: The bottle froze. choice2: The water poured out. premise: I tipped the bottle. question: effect",
        "choice2",
      )
    ],
    "test": [("copa choice1: I lit a lamp. choice2: I ate. premise: It got dark. question: effect", "<unk>")],
  },
  "multirc": {
    split: [
      (
        "multirc question: Who met Ann? answer: Tom paragraph: Sent 1: Tom met Ann. Sent 2: They ate. ",
        "True" if split != "test" else "<unk>",
      ),
      (
        "multirc question: Who met Ann? answer: Bob paragraph: Sent 1: Tom met Ann. Sent 2: They ate. ",
        "False" if split != "test" else "<unk>",
      ),
      (
        "multirc question: What did they do? answer: They ate paragraph: Sent 1: Tom met Ann. Sent 2: They ate. ",
        "True" if split != "test" else "<unk>",
      ),
    ]
    for split in ("train", "validation", "test")
  },
  "record": {
    split: [
      (
        "record query: @placeholder met Ann Lee. entities: Ann, Ann Lee, Paris, Tom passage: Tom met "
        "Ann Lee in Paris. Tom and Ann meet. They like Paris!",
        target,
      )
      for target in (["Tom"] if split != "test" else ["<unk>"])
    ]
    + [
      (
        "record query: Tom met @placeholder in Paris. entities: Ann, Ann Lee, Paris, Tom passage: Tom "
        "met Ann Lee in Paris. Tom and Ann meet. They like Paris!",
        target,
      )
      for target in (["Ann", "Ann Lee"] if split != "test" else ["<unk>"])
    ]
    for split in ("train", "validation", "test")
  },
  "rte": {
    "train": [("rte hypothesis: An animal sat. premise: A cat sat.", "entailment")],
    "validation": [("rte hypothesis: A dog sat. premise: A cat sat.", "not_entailment")],
    "test": [("rte hypothesis: A cat moved. premise: A cat ran.", "<unk>")],
  },
  "wic": {
    "train": [("wic sentence1: He sat on the bank. sentence2: The bank was closed. word: bank", "False")],
    "validation": [("wic sentence1: I run daily. sentence2: They run fast. word: run", "True")],
    "test": [("wic sentence1: Set the table. sentence2: A set of tools. word: set", "<unk>")],
  },
  "wsc": {
    # Train: only rows whose candidate is the referent.
    "train": [
      ("wsc: Mark told Pete many lies about himself , which Pete included in *his* book .", "Mark"),
      (
        'wsc: The boy continued to whip the pony , and eventually the pony threw him over. John laughed '
        'out quite loud. "Good for *him* ," he said.',
        "pony",
      ),
    ],
    "validation": [("wsc: Fred was to run the dishwasher , but he put *it* off .", "the dishwasher")],
    "test": [("wsc: Sam hugged Tim because *he* was sad .", "Tim")],
  },
  "axb": {"test": [("rte hypothesis: A cat sat. premise: The cat sat on the mat.", "entailment")]},
  "axg": {
    "test": [
      ("rte hypothesis: The nurse was kind. premise: The nurse helped the patient because he was kind.", "entailment"),
      ("rte hypothesis: The nurse was kind. premise: The nurse helped the patient because she was kind.", "entailment"),
    ]
  },
}


# DPR release files (train.c.txt / test.c.txt): sentence, pronoun, "candidate,candidate", answer, blank line.
DPR_FILES = {
  "train.c.txt": "Bob asked Tom if he can lend some money.\nhe\nBob,Tom\nTom\n\n"
  # the pronoun twice: T5 marks the first occurrence only; "," after it also ends the match
  "Ann told Sue she was late, and she apologised.\nshe\nAnn , Sue\nSue\n\n",
  # CRLF line ends and a trailing space (TFDS strips lines); "it." ends the sentence; "He" opens one: T5's
  # pattern needs a space before the pronoun and is case-sensitive, so the opening "He" stays unmarked.
  "test.c.txt": "The cup fell off the table because Tim pushed it. \r\nit\r\nThe cup,the table\r\nThe cup\r\n\r\n"
  "He said that Jim would come.\nHe\nJim,a man\nJim\n",
}
# By hand from T5's definite_pronoun_resolution_simple: "wsc: " + sentence with " *pronoun*"; target the answer.
DPR_EXPECTED = {
  "train": [
    ("wsc: Bob asked Tom if *he* can lend some money.", "Tom"),
    ("wsc: Ann told Sue *she* was late, and she apologised.", "Sue"),
  ],
  "test": [
    ("wsc: The cup fell off the table because Tim pushed *it*.", "The cup"),
    ("wsc: He said that Jim would come.", "Jim"),
  ],
}


def _write_dpr(root: Path, files=DPR_FILES) -> Path:
  folder = root / "definite_pronoun_resolution"
  folder.mkdir(parents=True, exist_ok=True)
  for name, text in files.items():
    (folder / name).write_bytes(text.encode("utf-8"))
  return root


def _write(root: Path, rows=ROWS) -> Path:
  for task, files in rows.items():
    folder = root / "super_glue" / DIRS[task]
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
      (folder / name).write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines), encoding="utf-8"
      )
  return root


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(_write_dpr(_write(tmp_path))))
  return tmp_path


def _register(prefix=PREFIX, vocabulary=BYTES, **kw):
  from remixer_t5.tasks import super_glue

  return super_glue.register_super_glue_tasks(vocabulary, prefix=prefix, **kw)


def _examples(name, split, **kw):
  task = seqio.get_mixture_or_task(name)
  ds = task.get_dataset(sequence_length=None, split=split, shuffle=False, use_cached=False, **kw)
  return list(ds.as_numpy_iterator())


# --- local release rows --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", list(EXPECTED))
def test_local_rows_in_t5_format(data_dir, task):
  _register()
  for split, expected in EXPECTED[task].items():
    examples = _examples(PREFIX + task, split)
    got = [(ex["inputs_pretokenized"].decode(), ex["targets_pretokenized"].decode()) for ex in examples]
    assert got == expected, (task, split)
    for ex in examples:
      for key in ("inputs", "targets"):
        assert ex[key][-1] == 1  # EOS
        assert BYTES.decode(ex[key][:-1].tolist()) == ex[f"{key}_pretokenized"].decode()


def test_local_rows_keep_eval_fields(data_dir):
  _register()
  multirc = _examples(PREFIX + "multirc", "validation")
  assert [(ex["idx/paragraph"], ex["idx/question"], ex["idx/answer"]) for ex in multirc] == [
    (4, 7, 20),
    (4, 7, 21),
    (4, 8, 22),
  ]
  record = _examples(PREFIX + "record", "validation")
  assert [(ex["idx/passage"], ex["idx/query"], [a.decode() for a in ex["answers"]]) for ex in record] == [
    (2, 20, ["Tom"]),
    (2, 21, ["Ann", "Ann Lee"]),
    (2, 21, ["Ann", "Ann Lee"]),
  ]
  assert [ex["label"] for ex in _examples(PREFIX + "wsc", "test")] == [-1]
  assert [ex["hypothesis"].decode() for ex in _examples(PREFIX + "axg", "test")] == ["The nurse was kind."] * 2


def test_readers_give_tfds_features(data_dir):
  from remixer_t5.tasks import super_glue

  tasks = {name[len(PREFIX) :]: seqio.get_mixture_or_task(name) for name in _register()[:-1]}
  folder = data_dir / "super_glue"
  copa = list(tasks["copa"].source.reader(str(folder / "COPA" / "val.jsonl")))
  assert copa == [
    {
      "premise": "I tipped the bottle.",
      "choice1": "The bottle froze.",
      "choice2": "The water poured out.",
      "question": "effect",
      "idx": 1,
      "label": 1,
    }
  ]
  record = list(tasks["record"].source.reader(str(folder / "ReCoRD" / "test.jsonl")))
  assert [r["entities"] for r in record] == [["Ann", "Ann Lee", "Paris", "Tom"]] * 2
  assert [r["answers"] for r in record] == [[], []]
  assert [r["idx"] for r in record] == [{"passage": 3, "query": 30}, {"passage": 3, "query": 31}]
  wic = list(tasks["wic"].source.reader(str(folder / "WiC" / "train.jsonl")))
  assert wic[0]["start1"] == 14 and wic[0]["end2"] == 8 and wic[0]["label"] == 0
  wsc = list(tasks["wsc"].source.reader(str(folder / "WSC" / "val.jsonl")))
  assert wsc[0]["span1_text"] == "the dishwasher" and wsc[0]["label"] == 0
  assert tasks["wsc"].source.num_input_examples("train") == 2  # the referent rows of 3, as the split gives
  assert list(tasks["axb"].splits) == ["test"] and list(tasks["axg"].splits) == ["test"]
  assert set(tasks["boolq"].splits) == {"train", "validation", "test"}
  assert tasks["wsc"].source.tfds_name == f"super_glue/wsc.fixed:{super_glue.TFDS_VERSION}"


@pytest.mark.parametrize(
  "task,file,line,match",
  [
    ("boolq", "val.jsonl", "{not json", r"val\.jsonl:2: malformed JSON"),
    ("boolq", "train.jsonl", {"question": "q", "passage": "p", "idx": 9}, r"train\.jsonl:2: lacks field 'label'"),
    (
      "cb",
      "train.jsonl",
      {"premise": "p", "hypothesis": "h", "label": "maybe", "idx": 1},
      r"train\.jsonl:2: unknown label 'maybe'",
    ),
    (
      "copa",
      "train.jsonl",
      {"premise": "p", "choice1": "a", "choice2": "b", "question": "cause", "label": 2, "idx": 1},
      r"train\.jsonl:2: unknown label 2",
    ),
    (
      "multirc",
      "train.jsonl",
      {
        "idx": 5,
        "passage": {"text": "t", "questions": [{"question": "q", "idx": 1, "answers": [{"text": "a", "idx": 1}]}]},
      },
      r"train\.jsonl:2: lacks field 'label'",
    ),
    (
      "record",
      "train.jsonl",
      {"idx": 5, "passage": {"text": "short", "entities": [{"start": 2, "end": 40}]}, "qas": []},
      r"train\.jsonl:2: entity span \[2, 40\] lies outside",
    ),
    (
      "wic",
      "train.jsonl",
      {
        "word": "w",
        "sentence1": "a",
        "sentence2": "b",
        "idx": 1,
        "label": True,
        "start1": "0",
        "end1": 1,
        "start2": 0,
        "end2": 1,
      },
      r"train\.jsonl:2: field 'start1'",
    ),
    (
      "wsc",
      "train.jsonl",
      {
        "text": "Tom said he left .",
        "idx": 1,
        "label": True,
        "target": {"span1_index": 0, "span1_text": "Tom", "span2_index": 3, "span2_text": "he"},
      },
      r"train\.jsonl:2: span2_text 'he' is not word 3",
    ),
  ],
)
def test_malformed_row_names_file_and_line(tmp_path, monkeypatch, task, file, line, match):
  from remixer_t5.tasks import sources

  rows = {task: {file: [ROWS[task][file][0], line]}}
  _write(tmp_path, rows)
  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  _register()
  split = "validation" if file == "val.jsonl" else "train"
  with pytest.raises(ValueError, match=match) as err:
    _examples(PREFIX + task, split)
  assert str(tmp_path / "super_glue" / DIRS[task] / file) in str(err.value)


# --- DPR (T5's dpr_v001_simple) ---------------------------------------------------------------------------------
def test_dpr_local_release_files_in_t5_format(data_dir):
  from remixer_t5.tasks import super_glue

  _register()
  task = seqio.get_mixture_or_task(PREFIX + "dpr")
  assert sorted(task.splits) == ["test", "train"]
  assert task.source.tfds_name == "definite_pronoun_resolution:1.1.0"  # the version T5 pins
  for split, expected in DPR_EXPECTED.items():
    examples = _examples(PREFIX + "dpr", split)
    got = [(ex["inputs_pretokenized"].decode(), ex["targets_pretokenized"].decode()) for ex in examples]
    assert got == expected, split
    for ex in examples:
      assert BYTES.decode(ex["targets"][:-1].tolist()) == ex["targets_pretokenized"].decode()
  rows = list(super_glue.read_dpr(str(data_dir / "definite_pronoun_resolution" / "train.c.txt")))
  assert rows[1] == {
    "sentence": "Ann told Sue she was late, and she apologised.",
    "pronoun": "she",
    "candidates": ["Ann", "Sue"],
    "label": 1,
  }
  assert task.source.num_input_examples("train") == 2
  # T5 scores DPR by accuracy on the decoded strings, with no postprocessor.
  assert task.metric_fns[0](["Tom", "Sue"], ["Tom", "Ann"]) == {"accuracy": 50.0}
  assert task.postprocess_fn("Tom") == "Tom"


def test_dpr_format_matches_the_pronoun_as_literal_text():
  import tensorflow as tf

  from remixer_t5.tasks import super_glue

  # As a regular expression "h.s" would match " his " first; the pronoun is matched as text.
  ds = tf.data.Dataset.from_tensors(
    {
      "sentence": "Tom saw his dog and h.s cat.",
      "pronoun": "h.s",
      "candidates": ["Tom", "dog"],
      "label": tf.constant(0, tf.int64),
    }
  )
  (ex,) = list(super_glue.dpr_simple_format(ds).as_numpy_iterator())
  assert ex == {"inputs": b"wsc: Tom saw his dog and *h.s* cat.", "targets": b"Tom"}


@pytest.mark.parametrize(
  "text,line,match",
  [
    ("A saw B and he left.\nhe\nA,B\n\n", 1, r"a DPR example is 4 lines .* got 3"),
    ("A saw B and he left.\nhe\nA,B,C\nA\n", 1, r"candidates line 'A,B,C' must name 2 candidates"),
    (
      "Ok then he went.\nhe\nX,Y\nX\n\nA saw B and he left.\nhe\nA,B\nC\n",
      6,
      r"correct antecedent 'C' is not one of the candidates \['A', 'B'\]",
    ),
  ],
)
def test_dpr_malformed_example_names_file_and_line(tmp_path, monkeypatch, text, line, match):
  from remixer_t5.tasks import sources

  _write_dpr(tmp_path, {"train.c.txt": text, "test.c.txt": DPR_FILES["test.c.txt"]})
  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  _register()
  path = tmp_path / "definite_pronoun_resolution" / "train.c.txt"
  with pytest.raises(ValueError, match=match) as err:
    _examples(PREFIX + "dpr", "train")
  assert f"{path}:{line}:" in str(err.value)


# --- TFDS (mocked: random examples from the builder's own features) ----------------------------------------------
def _no_local_data(monkeypatch):
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)


@pytest.mark.parametrize(
  "task,split,benchmark",
  [
    ("boolq", "validation", "boolq"),
    ("cb", "train", "cb"),
    ("copa", "validation", "copa"),
    ("multirc", "validation", "multirc"),
    ("record", "train", "record"),
    ("rte", "validation", "rte"),
    ("wic", "train", "wic"),
    ("axb", "test", "rte"),
    ("axg", "test", "rte"),
  ],
)
def test_tfds_mock(monkeypatch, task, split, benchmark):
  import tensorflow_datasets as tfds

  _no_local_data(monkeypatch)
  _register()
  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    examples = _examples(PREFIX + task, split, try_in_mem_cache=False)
  assert len(examples) >= 3  # ReCoRD: one per answer
  postprocess = seqio.get_mixture_or_task(PREFIX + task).postprocess_fn
  for ex in examples:
    assert ex["inputs_pretokenized"].decode().startswith(f"{benchmark} ")
    target = postprocess(ex["targets_pretokenized"].decode(), example=ex, is_target=True)
    value = target["value"] if isinstance(target, dict) else target
    if task != "record":
      assert value in (0, 1, 2)  # a class of the task, never -1 for a labeled split


def test_tfds_mock_wsc_filters_train(monkeypatch):
  import tensorflow as tf
  import tensorflow_datasets as tfds

  def as_dataset(self, split, **unused):  # the builder's features, two rows: only the first is the referent
    del self, split
    return tf.data.Dataset.from_tensor_slices(
      {
        "text": ["Tom said he left .", "Tom told Bob he left ."],
        "span1_index": tf.constant([0, 2], tf.int32),
        "span2_index": tf.constant([2, 3], tf.int32),
        "span1_text": ["Tom", "Bob"],
        "span2_text": ["he", "he"],
        "idx": tf.constant([0, 1], tf.int32),
        "label": tf.constant([1, 0], tf.int64),
      }
    )

  _no_local_data(monkeypatch)
  _register()
  with tfds.testing.mock_data(as_dataset_fn=as_dataset, policy=tfds.testing.MockPolicy.USE_CODE):
    train = _examples(PREFIX + "wsc", "train", try_in_mem_cache=False)
    validation = _examples(PREFIX + "wsc", "validation", try_in_mem_cache=False)
  assert [(ex["inputs_pretokenized"].decode(), ex["targets_pretokenized"].decode()) for ex in train] == [
    ("wsc: Tom said *he* left .", "Tom")
  ]
  assert [ex["targets_pretokenized"].decode() for ex in validation] == ["Tom", "Bob"]
  assert [ex["label"] for ex in validation] == [1, 0]


def test_tfds_mock_dpr(monkeypatch):
  import tensorflow as tf
  import tensorflow_datasets as tfds

  def as_dataset(self, split, **unused):  # rows in the builder's features (candidates: Sequence of length 2)
    assert self.name == "definite_pronoun_resolution" and str(self.version) == "1.1.0"
    del split
    return tf.data.Dataset.from_tensor_slices(
      {
        "sentence": ["Bob asked Tom if he can lend some money.", "The cup fell because Tim pushed it."],
        "pronoun": ["he", "it"],
        "candidates": [["Bob", "Tom"], ["The cup", "Tim"]],
        "label": tf.constant([1, 0], tf.int64),
      }
    )

  _no_local_data(monkeypatch)
  _register()
  with tfds.testing.mock_data(as_dataset_fn=as_dataset, policy=tfds.testing.MockPolicy.USE_CODE):
    train = _examples(PREFIX + "dpr", "train", try_in_mem_cache=False)
  assert [(ex["inputs_pretokenized"].decode(), ex["targets_pretokenized"].decode()) for ex in train] == [
    ("wsc: Bob asked Tom if *he* can lend some money.", "Tom"),
    ("wsc: The cup fell because Tim pushed *it*.", "The cup"),
  ]
  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    test = _examples(PREFIX + "dpr", "test", try_in_mem_cache=False)  # random rows of the builder's features
  assert len(test) == 3 and all(ex["inputs_pretokenized"].startswith(b"wsc: ") for ex in test)


# --- postprocessors and metrics -------------------------------------------------------------------------------------
def test_postprocessors_map_strings_back():
  from remixer_t5.tasks import super_glue as sg

  _register()
  pp = {t: seqio.get_mixture_or_task(PREFIX + t).postprocess_fn for t in DIRS}
  assert [pp["boolq"](s) for s in ("True", "False", "true", "")] == [1, 0, -1, -1]
  assert [pp["cb"](s) for s in ("entailment", "contradiction", "neutral", "<unk>")] == [0, 1, 2, -1]
  assert [pp["copa"](s) for s in ("choice1", "choice2", "choice3")] == [0, 1, -1]
  assert [pp["rte"](s) for s in ("entailment", "not_entailment", "neutral")] == [0, 1, -1]
  assert pp["axb"]("not_entailment") == 1 and pp["wic"]("True") == 1
  ex = {
    "idx/paragraph": 4,
    "idx/question": 7,
    "hypothesis": b"h",
    "idx": 3,
    "label": 0,
    "answers": [b"Ann", b"Ann Lee"],
    "idx/passage": 2,
    "idx/query": 21,
    "targets_pretokenized": b"The dog",
  }
  assert pp["multirc"]("True", example=ex, is_target=True) == {"value": 1, "group": (4, 7)}
  assert pp["multirc"]("maybe", example=ex) == {"value": -1}
  assert pp["record"]("Ann", example=ex, is_target=True) == {"value": ["Ann", "Ann Lee"], "group": (2, 21)}
  assert pp["record"]("Bob", example=ex) == {"value": "Bob"}
  assert pp["axg"]("entailment", example=ex, is_target=True) == {"value": 0, "idx": 3, "hypothesis": "h"}
  assert pp["axg"]("yes", example=ex) == -1
  # WSC: target = the row's label; prediction = does it name the candidate "The dog"?
  assert pp["wsc"]("The dog", example=ex, is_target=True) == 0
  assert sg.wsc_postprocess("the dog", example=ex) == 1
  assert sg.wsc_postprocess("dog", example=ex) == 1  # determiners dropped
  assert sg.wsc_postprocess("a big dog", example=ex) == 1  # referent words a subset of the prediction's
  assert sg.wsc_postprocess("The cat", example=ex) == 0
  assert sg.wsc_postprocess("dog's bone", example=ex) == 0  # possessive on one side only
  assert sg.wsc_postprocess("  ", example=ex) == -1  # empty: wrong whatever the label


def test_metric_wiring():
  from remixer_t5.tasks import metrics

  _register()
  fns = {t: seqio.get_mixture_or_task(PREFIX + t).metric_fns for t in DIRS}
  assert fns["boolq"] == fns["copa"] == fns["rte"] == fns["wic"] == fns["wsc"] == [metrics.accuracy]
  assert fns["cb"] == [metrics.super_glue_cb] and fns["multirc"] == [metrics.super_glue_multirc]
  assert fns["record"] == [metrics.super_glue_record] and fns["axb"] == [metrics.matthews_corrcoef]
  assert fns["axg"] == [metrics.super_glue_axg]
  dpr = seqio.get_mixture_or_task(PREFIX + "dpr")
  assert dpr.metric_fns == [metrics.accuracy] and dpr.postprocess_fn("Tom") == "Tom"  # as T5: no postprocessor


def test_cb_metric():
  from remixer_t5.tasks.metrics import super_glue_cb

  gold = [0, 1, 2, 0]
  assert super_glue_cb(gold, gold) == {"f1_macro": 100.0, "accuracy": 100.0}
  # class 0: tp 1, fn 1 -> F1 2/3; class 1: tp 1, fp 1 -> 2/3; class 2: never right -> 0; the -1 is just wrong.
  got = super_glue_cb(gold, [0, 1, 1, -1])
  assert got == pytest.approx({"f1_macro": 100 * 4 / 9, "accuracy": 50.0})


def test_multirc_metric():
  from remixer_t5.tasks.metrics import super_glue_multirc

  q1, q2 = (4, 7), (4, 8)
  targets = [{"value": v, "group": g} for v, g in [(1, q1), (0, q1), (1, q1), (0, q2), (1, q2)]]
  gold = [{"value": t["value"]} for t in targets]
  assert super_glue_multirc(targets, gold) == {"f1a": 100.0, "exact_match": 100.0}
  # q1 misses its 3rd option, q2 all right: EM (0 + 100) / 2; F1a over all 5: tp 2, fn 1 -> 4/5.
  preds = [{"value": v} for v in (1, 0, 0, 0, 1)]
  assert super_glue_multirc(targets, preds) == pytest.approx({"f1a": 80.0, "exact_match": 50.0})
  # An invalid prediction (-1) on a False option counts as a false positive (T5's f1_score_with_invalid):
  # tp 2, fp 1, fn 1 -> 2*2 / (2*2 + 1 + 1); both questions now miss an option.
  preds = [{"value": v} for v in (1, 0, 0, -1, 1)]
  assert super_glue_multirc(targets, preds) == pytest.approx({"f1a": 400 / 6, "exact_match": 0.0})


def test_record_metric():
  from remixer_t5.tasks.metrics import super_glue_record

  q1 = {"value": ["Benazir Bhutto", "Bhutto"], "group": (1, 10)}
  q2 = {"value": ["World Cup"], "group": (1, 11)}
  targets = [q1, q1, q2]  # q1 has one copy per answer; it counts once
  assert super_glue_record(targets, [{"value": "Bhutto"}, {"value": "Bhutto"}, {"value": "World Cup"}]) == {
    "em": 100.0,
    "f1": 100.0,
  }
  # q1: "bhutto" equals the 2nd answer after normalisation (max over answers); q2: "the World Cup final" ->
  # "world cup final" vs "world cup": EM 0, F1 2*(2/3*1)/(2/3+1) = 0.8.
  got = super_glue_record(targets, [{"value": "bhutto."}, {"value": "ignored copy"}, {"value": "the World Cup final"}])
  assert got == pytest.approx({"em": 50.0, "f1": 90.0})


def test_axb_axg_metrics():
  from remixer_t5.tasks.metrics import matthews_corrcoef, super_glue_axg

  assert matthews_corrcoef([0, 0, 1, 1], [0, 0, 1, 1]) == {"mcc": 100.0}
  # tp 2, tn 1, fp 1, fn 0: (2*1 - 1*0) / sqrt(3 * 2 * 2 * 1)
  assert matthews_corrcoef([1, 0, 1, 0], [1, 1, 1, 0])["mcc"] == pytest.approx(100 * 2 / 12**0.5)
  targets = [
    {"value": v, "idx": i, "hypothesis": h}
    for i, (v, h) in enumerate([(0, "A"), (0, "A"), (1, "B"), (1, "B"), (0, "C")])
  ]
  gold = [t["value"] for t in targets]
  assert super_glue_axg(targets, gold) == {"accuracy": 100.0, "gender_parity": 100.0}
  # Pair (0, 1) agrees, pair (2, 3) does not; idx 4 has no partner here and is left out of parity.
  assert super_glue_axg(targets, [0, 0, 1, 0, 1]) == pytest.approx({"accuracy": 60.0, "gender_parity": 50.0})
  targets[1]["hypothesis"] = "not A"
  with pytest.raises(ValueError, match="not a minimal pair"):
    super_glue_axg(targets, gold)


# --- registration and the mixture ----------------------------------------------------------------------------------
def test_registered_at_import_and_idempotent(monkeypatch):
  import importlib

  from remixer_t5.data.vocab import t5_vocabulary
  from remixer_t5.tasks import super_glue

  _no_local_data(monkeypatch)
  importlib.reload(super_glue)  # registering again: a no-op without data
  names = super_glue.register_super_glue_tasks()
  assert names == [
    f"super_glue_{t}" for t in ("boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc", "axb", "axg")
  ] + ["dpr", "super_glue_proportional"]
  task = seqio.get_mixture_or_task("super_glue_boolq")
  assert task.output_features["targets"].vocabulary == t5_vocabulary()  # T5's, not loaded yet
  assert list(seqio.get_mixture_or_task("super_glue_axg").splits) == ["test"]
  assert sorted(t.name for t in seqio.get_mixture_or_task("super_glue_proportional").tasks) == sorted(
    [f"super_glue_{t}" for t in super_glue.TRAIN_TASKS] + ["dpr"]
  )
  assert _register() == _register()
  assert _register()[-2:] == [PREFIX + "dpr", PREFIX + "proportional"]
  with pytest.raises(ValueError, match="already registered"):
    _register(vocabulary=seqio.ByteVocabulary(extra_ids=3))
  with pytest.raises(ValueError, match="already registered with other tasks or rates"):
    _register(maximum=5)
  with pytest.raises(ValueError, match="maximum must be a positive number"):
    _register("test_sg_badcap_", maximum=0)


# The reference: T5's super_glue_v102_proportional rates, copied from t5/data/glue_utils.py
# SUPER_GLUE_WEIGHT_MAPPING (google-research/text-to-text-transfer-transformer; rate-0 eval-only entries left out).
T5_SUPER_GLUE_RATES = {
  "dpr_v001_simple": 1_322.0,
  "super_glue_wsc_v102_simple_train": 259.0,
  "super_glue_boolq_v102": 9_427.0,
  "super_glue_cb_v102": 250.0,
  "super_glue_copa_v102": 400.0,
  "super_glue_multirc_v102": 27_243.0,
  "super_glue_record_v102": 138_854.0,
  "super_glue_rte_v102": 2_490.0,
  "super_glue_wic_v102": 5_428.0,
}
T5_NAMES = {
  "dpr_v001_simple": "dpr",
  "super_glue_wsc_v102_simple_train": "super_glue_wsc",
  **{f"super_glue_{t}_v102": f"super_glue_{t}" for t in ("boolq", "cb", "copa", "multirc", "record", "rte", "wic")},
}


def test_mixture_rates_are_t5s_and_need_no_data(tmp_path, monkeypatch):
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path / "nothing_here"))  # no data, no TFDS: rates anyway
  mixture = seqio.get_mixture_or_task("super_glue_proportional")
  rates = {t.name: mixture.get_rate(t) for t in mixture.tasks}
  assert rates == {T5_NAMES[k]: v for k, v in T5_SUPER_GLUE_RATES.items()}
  # ReCoRD's share is T5's: 138,854 of 185,673 examples (raw rows would have given it 100,730).
  assert rates["super_glue_record"] / sum(rates.values()) == pytest.approx(138_854 / 185_673)
  capped = seqio.get_mixture_or_task(_register("test_sg_mixcap_", maximum=1_000)[-1])
  assert {t.name: capped.get_rate(t) for t in capped.tasks} == {
    "test_sg_mixcap_" + T5_NAMES[k][len("super_glue_") :] if k != "dpr_v001_simple" else "test_sg_mixcap_dpr": min(
      v, 1_000.0
    )
    for k, v in T5_SUPER_GLUE_RATES.items()
  }


def test_mixture_samples_tasks_from_local_rows(data_dir):
  name = _register("test_sg_mix_")[-1]
  ds = seqio.get_mixture_or_task(name).get_dataset(
    sequence_length={"inputs": 256, "targets": 16},
    split="train",
    shuffle=True,
    seed=0,
    use_cached=False,
    num_epochs=None,
  )
  starts = {BYTES.decode(ex["inputs"].tolist()).split(" ")[0] for ex in ds.take(200).as_numpy_iterator()}
  # ReCoRD 75%, MultiRC 15%, BoolQ 5% of the draws, ...; DPR's 0.7% is too rare to rely on, so read it.
  assert starts <= {"boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc:"} and len(starts) >= 3
  dpr = seqio.get_mixture_or_task("test_sg_mix_dpr")
  assert [
    ex["targets_pretokenized"]
    for ex in dpr.get_dataset(sequence_length=None, split="train", shuffle=False, use_cached=False).as_numpy_iterator()
  ] == [b"Tom", b"Sue"]


# --- FewGLUE release files with the real T5 vocabulary ---------------------------------------------------------
def _fewglue_counts(task, path):
  """Examples a split should give, counted from the raw rows independently of the readers."""
  rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
  if task == "multirc":
    return sum(len(q["answers"]) for r in rows for q in r["passage"]["questions"])
  if task == "record":
    return sum(max(1, len({a["text"] for a in qa["answers"]})) for r in rows for qa in r["qas"])
  if task == "wsc" and path.name == "train32.jsonl":
    return sum(bool(r["label"]) for r in rows)
  return len(rows)


def test_fewglue_release_files_with_t5_vocabulary(tmp_path, monkeypatch):
  missing = [
    p
    for p in [T5_VOCAB] + [FEWGLUE / d / f for d in list(DIRS.values())[:8] for f in ("train32.jsonl", "dev32.jsonl")]
    if not p.is_file()
  ]
  if missing:
    pytest.skip(f"FewGLUE / T5 vocabulary not found at {missing[0]}")
  from remixer_t5.tasks import sources

  for folder in list(DIRS.values())[:8]:
    (tmp_path / "super_glue" / folder).mkdir(parents=True)
    (tmp_path / "super_glue" / folder / "train.jsonl").symlink_to(FEWGLUE / folder / "train32.jsonl")
    (tmp_path / "super_glue" / folder / "val.jsonl").symlink_to(FEWGLUE / folder / "dev32.jsonl")
  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  vocab = seqio.SentencePieceVocabulary(str(T5_VOCAB), extra_ids=100)
  _register("test_sg_t5_", vocab)
  for task, folder in list(DIRS.items())[:8]:
    t = seqio.get_mixture_or_task("test_sg_t5_" + task)
    for split, file in (("train", "train32.jsonl"), ("validation", "dev32.jsonl")):
      examples = _examples("test_sg_t5_" + task, split)
      assert len(examples) == _fewglue_counts(task, FEWGLUE / folder / file), (task, split)
      targets, predictions = [], []
      for ex in examples:
        assert ex["inputs_pretokenized"].decode().startswith("wsc: " if task == "wsc" else f"{task} ")
        decoded = vocab.decode(ex["targets"][:-1].tolist())
        assert decoded == ex["targets_pretokenized"].decode()
        targets.append(t.postprocess_fn(ex["targets_pretokenized"].decode(), example=ex, is_target=True))
        predictions.append(t.postprocess_fn(decoded, example=ex, is_target=False))
      if task == "wsc":  # labels, and "does the decoded candidate name the candidate" (always 1 here)
        assert set(predictions) == {1}
        continue
      for metric in t.metric_fns:  # gold predictions score perfectly
        assert all(v == pytest.approx(100.0) for v in metric(targets, predictions).values()), (task, split)


# --- decoding SuperGLUE while training on another task (runs/mt_cotrain.gin's infer_eval_task) -------------------
def test_a_run_decodes_and_scores_super_glue_while_training_on_another_task(data_dir, tmp_path, embedded_env):
  from remixer_t5 import cli

  model_dir = tmp_path / "run"
  args = [
    "train",
    "--gin_file=models/t5_1_1/tiny.gin",
    "--gin.network.T5Config.emb_dim=32",
    "--gin.network.T5Config.mlp_dim=48",
    "--gin.network.T5Config.num_encoder_layers=1",
    "--gin.network.T5Config.num_decoder_layers=1",
    "--gin_file=runs/demo.gin",
    "--gin.BATCH_SIZE=2",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.EVAL_PERIOD=0",
    "--gin.CHECKPOINT_PERIOD=2",
    "--gin.TRAIN_STEPS=2",
    "--gin.run_config.Schedule.infer_eval_period=2",
    "--gin.run_config.Schedule.infer_eval_task='super_glue_proportional'",
    "--gin.run_config.Schedule.infer_examples=2",
    f"--gin.MODEL_DIR='{model_dir}'",
  ]
  assert cli.main(args) == 0
  rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
  infer = {r["split"].split("/", 1)[1].split("#")[0]: r for r in rows if r["split"].startswith("infer/")}
  # The 8 tasks with a validation split, scored with their own metrics (DPR has none: train and test only).
  average = infer.pop("super_glue_average")  # the benchmark's score, beside the tasks it averages
  assert sorted(infer) == sorted(
    f"super_glue_{t}" for t in ("boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc")
  )
  assert {r["step"] for r in infer.values()} == {2} == {average["step"]}
  from remixer_t5.tasks import super_glue

  assert average["score"] == pytest.approx(super_glue.super_glue_average(infer))
  assert "f1_macro" in infer["super_glue_cb"] and "f1a" in infer["super_glue_multirc"]
  assert 0 <= infer["super_glue_record"]["em"] <= 100 and 0 <= infer["super_glue_boolq"]["accuracy"] <= 100


# --- the benchmark's score (super_glue.super_glue_average) ------------------------------------------------------
def _scores(boolq, cb, copa, multirc, record, rte, wic, wsc, prefix="super_glue_"):
  """Per-task results in this project's metric names from a published row: CB (F1, acc), MultiRC (F1a, EM),
  ReCoRD (F1, EM)."""
  return {
    f"{prefix}boolq": {"accuracy": boolq},
    f"{prefix}cb": {"f1_macro": cb[0], "accuracy": cb[1]},
    f"{prefix}copa": {"accuracy": copa},
    f"{prefix}multirc": {"f1a": multirc[0], "exact_match": multirc[1]},
    f"{prefix}record": {"f1": record[0], "em": record[1]},
    f"{prefix}rte": {"accuracy": rte},
    f"{prefix}wic": {"accuracy": wic},
    f"{prefix}wsc": {"accuracy": wsc},
  }


# SuperGLUE test-set rows as the leaderboard (super.gluebenchmark.com) published them, with its Score: the T5-11B
# submission of Raffel et al. 2020 and the rows beside it, as tabulated from the leaderboard in He et al. 2021
# (DeBERTa, ICLR, Table 5); T5-11B's row also in Vu et al. 2022 (SPoT, Table 1). The score is given to one
# decimal, so the computed mean must round to it.
PUBLISHED = {
  "T5-11B": ((91.2, (93.9, 96.8), 94.8, (88.1, 63.3), (94.1, 93.4), 92.5, 76.9, 93.8), 89.3),
  "T5-11B + Meena": ((91.3, (95.8, 97.6), 97.4, (88.3, 63.0), (94.2, 93.5), 92.7, 77.9, 95.9), 90.2),
  "RoBERTa-large": ((87.1, (90.5, 95.2), 90.6, (84.4, 52.5), (90.6, 90.0), 88.2, 69.9, 89.0), 84.6),
  "Human baselines": ((89.0, (95.8, 98.9), 100.0, (81.8, 51.9), (91.7, 91.3), 93.6, 80.0, 100.0), 89.8),
  "DeBERTa-1.5B + SiFT": ((90.4, (94.9, 97.2), 96.8, (88.2, 63.7), (94.5, 94.1), 93.2, 76.4, 95.9), 89.9),
}


@pytest.mark.parametrize("row", sorted(PUBLISHED))
def test_super_glue_average_reproduces_published_scores(row):
  from remixer_t5.tasks import super_glue

  tasks, score = PUBLISHED[row]
  average = super_glue.super_glue_average(_scores(*tasks))
  assert abs(average - score) <= 0.05 + 1e-9, (row, average, score)


def test_super_glue_average_leaves_out_the_diagnostics_and_dpr():
  from remixer_t5.tasks import super_glue

  tasks, score = PUBLISHED["T5-11B"]
  scores = _scores(*tasks)
  with_extras = {
    **scores,
    "super_glue_axb": {"mcc": 0.0},
    "super_glue_axg": {"accuracy": 0.0, "gender_parity": 0.0},
    "dpr": {"accuracy": 0.0},
    "glue_rte": {"accuracy": 0.0},
  }
  assert super_glue.super_glue_average(with_extras) == super_glue.super_glue_average(scores)
  # Each task weighs 1/8, CB's two metrics 1/16 each.
  changed = {**scores, "super_glue_cb": {"f1_macro": 93.9 - 16.0, "accuracy": 96.8}}
  assert super_glue.super_glue_average(scores) - super_glue.super_glue_average(changed) == pytest.approx(1.0)


def test_super_glue_average_needs_every_task():
  from remixer_t5.tasks import super_glue

  scores = _scores(*PUBLISHED["T5-11B"][0])
  del scores["super_glue_wsc"]
  scores["super_glue_multirc"] = {"f1a": 88.1}  # one of its two metrics
  assert super_glue.missing_for_average(scores) == ["super_glue_multirc", "super_glue_wsc"]
  with pytest.raises(ValueError, match=r"missing or incomplete: \['super_glue_multirc', 'super_glue_wsc'\]"):
    super_glue.super_glue_average(scores)
  entries, notes = super_glue.average_entries(scores)
  assert entries == {}
  assert len(notes) == 1 and "super_glue_average" in notes[0] and "super_glue_multirc, super_glue_wsc" in notes[0]
  # Results without SuperGLUE (GLUE's RTE alone does not count) give neither a score nor a note.
  assert super_glue.average_entries({"glue_rte": {"accuracy": 50.0}, "cogs": {"exact_match": 1.0}}) == ({}, [])


def test_super_glue_average_entries_per_task_prefix():
  from remixer_t5.tasks import super_glue

  tasks, score = PUBLISHED["Human baselines"]
  results = {**_scores(*PUBLISHED["T5-11B"][0]), **_scores(*tasks, prefix=PREFIX), "glue_rte": {"accuracy": 0.0}}
  entries, notes = super_glue.average_entries(results)
  assert notes == [] and sorted(entries) == sorted([f"{PREFIX}average", "super_glue_average"])
  assert entries[f"{PREFIX}average"]["score"] == pytest.approx(89.7875)
  assert entries["super_glue_average"]["score"] == pytest.approx(89.25)


def test_super_glue_average_of_tasks_copied_into_another_vocabulary():
  """A run evaluates in its own vocabulary: the tasks are copies ``<task>#<tag>`` (tasks/lookup.py)."""
  from remixer_t5.tasks import super_glue

  tag = "#spm_unigram_2000_1a2642eb"
  results = {name + tag: scores for name, scores in _scores(*PUBLISHED["T5-11B"][0]).items()}
  results[f"super_glue_axb{tag}"] = {"mcc": 65.6}
  assert super_glue.average_entries(results) == ({f"super_glue_average{tag}": {"score": pytest.approx(89.25)}}, [])
  del results[f"super_glue_copa{tag}"]
  results["super_glue_copa"] = {"accuracy": 94.8}  # another vocabulary's COPA does not complete this one's
  entries, notes = super_glue.average_entries(results)
  assert entries == {} and len(notes) == 2
  assert f"super_glue_average{tag}" in notes[1] and notes[1].endswith(f"super_glue_copa{tag}")


def test_infer_eval_logs_and_returns_the_average(monkeypatch, tmp_path):
  from types import SimpleNamespace

  from remixer_t5 import storage
  from remixer_t5.training import evaluation, validation

  per_task = {**_scores(*PUBLISHED["T5-11B"][0]), "super_glue_axb": {"mcc": 65.6}}
  monkeypatch.setattr(evaluation, "infer_eval", lambda *a, **k: dict(per_task))
  run = SimpleNamespace(
    data=SimpleNamespace(batch_size=2, feature_lengths=None),
    model_dir=storage.run_path(tmp_path),
    schedule=SimpleNamespace(infer_examples=None),
    training=SimpleNamespace(random_seed=0),
  )
  written, said = [], []
  log = SimpleNamespace(write=lambda step, split, row: written.append((step, split, dict(row))), info=said.append)
  results = validation.infer_eval(
    SimpleNamespace(model=None, batch_sharding=None), {}, run, "super_glue_proportional", 7, log
  )
  assert results == {**per_task, "super_glue_average": {"score": pytest.approx(89.25)}}
  assert written[-1] == (7, "infer/super_glue_average", {"score": pytest.approx(89.25)}) and not said
  # Only some tasks scored: no score, a line naming the missing ones.
  del per_task["super_glue_record"]
  written.clear()
  assert "super_glue_average" not in validation.infer_eval(
    SimpleNamespace(model=None, batch_sharding=None), {}, run, "super_glue_proportional", 7, log
  )
  assert [split for _, split, _ in written] == [f"infer/{name}" for name in per_task]
  assert len(said) == 1 and "super_glue_record" in said[0]
