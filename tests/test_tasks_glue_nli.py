"""GLUE, NLI and SQuAD seqio tasks (tasks/glue.py, tasks/nli.py, tasks/squad.py).

Local paths run on rows written here in each release's format; TFDS paths under tfds.testing.mock_data.
Tasks are registered again under test names with seqio's ByteVocabulary (exact round trip, nothing to train).
"""

import json
from pathlib import Path

import pytest

SEQ_LEN = {"inputs": 1024, "targets": 64}
SHARED = Path(__file__).resolve().parents[2] / "shared"
T5_VOCAB = SHARED / "vocab" / "t5_cc_all_32000" / "sentencepiece.model"
CONJNLI = SHARED / "data" / "conjnli"


@pytest.fixture(scope="module")
def vocab():
  import seqio

  return seqio.ByteVocabulary()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  return tmp_path


@pytest.fixture
def no_data_dir(monkeypatch):
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.delenv("REMIXER_T5_DATA_DIR", raising=False)


def _tsv(header, rows):
  lines = ([header] if header else []) + list(rows)
  return "".join("\t".join(r) + "\n" for r in lines)


def _write(root: Path, files: dict):
  for rel, text in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _examples(task, split):
  ds = task.get_dataset(SEQ_LEN, split=split, shuffle=False, use_cached=False, try_in_mem_cache=False)
  return list(ds.as_numpy_iterator())


def _pairs(task, split):
  """[(inputs text, targets text)], checking that tokens decode back to the text and end in EOS."""
  vocab = task.output_features["targets"].vocabulary
  out = []
  for ex in _examples(task, split):
    inputs, targets = ex["inputs_pretokenized"].decode(), ex["targets_pretokenized"].decode()
    assert ex["inputs"].tolist()[-1] == 1 and ex["targets"].tolist()[-1] == 1
    assert vocab.decode(ex["targets"].tolist()[:-1]) == targets
    assert vocab.decode(ex["inputs"].tolist()[:-1]) == inputs
    out.append((inputs, targets))
  return out


def _glue(name, vocab):
  import seqio
  from remixer_t5.tasks import glue

  return seqio.get_mixture_or_task(glue.register_glue_task(name, f"test_glue_{name}", vocab))


def _nli(name, vocab):
  import seqio
  from remixer_t5.tasks import nli

  return seqio.get_mixture_or_task(nli.register_nli_task(name, f"test_nli_{name}", vocab))


# --- GLUE release files ---------------------------------------------------------------------------------------
MNLI_HEAD = [
  "index",
  "promptID",
  "pairID",
  "genre",
  "sentence1_binary_parse",
  "sentence2_binary_parse",
  "sentence1_parse",
  "sentence2_parse",
  "sentence1",
  "sentence2",
]


def _mnli(i, p, h, *labels):
  return [
    str(i),
    "31193",
    f"{i}n",
    "government",
    "( ( a b ) )",
    "( c d )",
    "(ROOT (S a b))",
    "(ROOT (S c d))",
    p,
    h,
    *labels,
  ]


GLUE_FILES = {
  "glue/CoLA/train.tsv": _tsv(
    None,
    [
      ["gj04", "1", "", "Our friends won't buy this analysis, let alone the next one we propose."],
      ["gj04", "0", "*", "The more we study verbs, the crazier they get get."],
    ],
  ),
  "glue/CoLA/dev.tsv": _tsv(None, [["bc01", "1", "", "The sailors rode the breeze clear of the rocks."]]),
  "glue/CoLA/test.tsv": _tsv(["index", "sentence"], [["0", "Bill whistled past the house."]]),
  "glue/SST-2/train.tsv": _tsv(
    ["sentence", "label"],
    [
      ["hide new secretions from the parental units ", "0"],
      ["that loves its characters and communicates something rather beautiful about human nature ", "1"],
    ],
  ),
  # MRPC's train file keeps the BOM of Microsoft's original, and its sentences hold bare double quotes.
  "glue/MRPC/train.tsv": "\ufeff"
  + _tsv(
    ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    [
      [
        "1",
        "702876",
        "702977",
        'Amrozi accused his brother , whom he called " the witness " , of deliberately distorting his evidence .',
        'Referring to him as only " the witness " , Amrozi accused his brother of '
        'deliberately distorting his evidence .',
      ],
      [
        "0",
        "2108705",
        "2108831",
        "Yucaipa owned Dominick 's before selling the chain to Safeway in 1998 .",
        "Yucaipa bought Dominick 's in 1995 and sold it to Safeway in 1998 .",
      ],
    ],
  ),
  "glue/MRPC/test.tsv": _tsv(
    ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    [["0", "1089874", "1089925", "PCCW 's chief operating officer will also leave .", "He will leave too ."]],
  ),
  "glue/QQP/train.tsv": _tsv(
    ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    [
      [
        "133273",
        "213221",
        "213222",
        "How is the life of a math student?",
        "Which level of preparation is enough?",
        "0",
      ],
      ["402555", "536040", "536041", "What is the best way to learn French?", "How can I learn French fast?", "1"],
    ],
  ),
  "glue/STS-B/train.tsv": _tsv(
    ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"],
    [
      [
        "0",
        "main-captions",
        "MSRvid",
        "2012test",
        "0001",
        "none",
        "none",
        "A plane is taking off.",
        "An air plane is taking off.",
        "5.000",
      ],
      [
        "1",
        "main-captions",
        "MSRvid",
        "2012test",
        "0004",
        "none",
        "none",
        "A man is playing a large flute.",
        "A man is playing a flute.",
        "3.800",
      ],
      [
        "2",
        "main-captions",
        "MSRvid",
        "2012test",
        "0005",
        "none",
        "none",
        "A man spreads cheese.",
        "A man spreads cheese on a pizza.",
        "2.750",
      ],
      [
        "3",
        "main-captions",
        "MSRvid",
        "2012test",
        "0006",
        "none",
        "none",
        "Three men play chess.",
        "Two men play chess.",
        "2.500",
      ],
    ],
  ),
  "glue/STS-B/test.tsv": _tsv(
    ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"],
    [
      [
        "0",
        "main-captions",
        "MSRvid",
        "2012test",
        "0024",
        "none",
        "none",
        "A girl is styling her hair.",
        "A girl is brushing her hair.",
      ]
    ],
  ),
  "glue/MNLI/train.tsv": _tsv(
    MNLI_HEAD + ["label1", "gold_label"],
    [
      _mnli(
        0,
        "Conceptually cream skimming has two basic dimensions - product and geography.",
        "Product and geography are what make cream skimming work. ",
        "neutral",
        "neutral",
      ),
      _mnli(
        1,
        "you know during the season and i guess at at your level uh you lose them",
        "You lose the things to the following level if the people recall.",
        "entailment",
        "entailment",
      ),
    ],
  ),
  "glue/MNLI/dev_matched.tsv": _tsv(
    MNLI_HEAD + ["label1", "label2", "label3", "label4", "label5", "gold_label"],
    [
      _mnli(
        0,
        "The new rights are nice enough",
        "Everyone really likes the newest benefits ",
        "neutral",
        "entailment",
        "neutral",
        "neutral",
        "neutral",
        "neutral",
      ),
      _mnli(
        1,
        "This site includes a list of all award winners.",
        "The Government Executive articles are on the site.",
        "contradiction",
        "contradiction",
        "contradiction",
        "contradiction",
        "contradiction",
        "contradiction",
      ),
      _mnli(
        2,
        "uh i don't know i i have mixed emotions about him",
        "I like him for the most part.",
        "entailment",
        "entailment",
        "entailment",
        "neutral",
        "entailment",
        "entailment",
      ),
    ],
  ),
  "glue/MNLI/dev_mismatched.tsv": _tsv(
    MNLI_HEAD + ["label1", "label2", "label3", "label4", "label5", "gold_label"],
    [
      _mnli(
        0,
        "Your contribution helped make it possible.",
        "Your contributions were of no help.",
        "contradiction",
        "contradiction",
        "contradiction",
        "contradiction",
        "contradiction",
        "contradiction",
      ),
      _mnli(
        1,
        "The answer is yes.",
        "The answer is not no.",
        "entailment",
        "entailment",
        "entailment",
        "entailment",
        "entailment",
        "entailment",
      ),
    ],
  ),
  "glue/MNLI/test_matched.tsv": _tsv(MNLI_HEAD, [_mnli(0, "Hierbas, ans seco, ans dulce.", "Hierbas is a name.")]),
  "glue/QNLI/train.tsv": _tsv(
    ["index", "question", "sentence", "label"],
    [
      [
        "0",
        "When did the third Digimon series begin?",
        "Digimon Tamers takes a darker approach to its story.",
        "not_entailment",
      ],
      [
        "1",
        "What came into force after the new constitution was herald?",
        "As of that day, the new constitution heralding the Second Republic came into force.",
        "entailment",
      ],
    ],
  ),
  "glue/RTE/train.tsv": _tsv(
    ["index", "sentence1", "sentence2", "label"],
    [
      [
        "0",
        "No Weapons of Mass Destruction Found in Iraq Yet.",
        "Weapons of Mass Destruction Found in Iraq.",
        "not_entailment",
      ],
      ["1", "Pope Benedict XVI was installed as the new Pope.", "Pope Benedict XVI is the new leader.", "entailment"],
    ],
  ),
  "glue/WNLI/train.tsv": _tsv(
    ["index", "sentence1", "sentence2", "label"],
    [
      ["0", "I stuck a pin through a carrot. When I pulled the pin out, it had a hole.", "The carrot had a hole.", "1"],
      [
        "1",
        "John couldn't see the stage with Billy in front of him because he is so short.",
        "Billy is so short.",
        "0",
      ],
    ],
  ),
}

GLUE_EXPECTED = {
  ("cola", "train"): [
    ("cola sentence: Our friends won't buy this analysis, let alone the next one we propose.", "acceptable"),
    ("cola sentence: The more we study verbs, the crazier they get get.", "unacceptable"),
  ],
  ("cola", "validation"): [("cola sentence: The sailors rode the breeze clear of the rocks.", "acceptable")],
  ("cola", "test"): [("cola sentence: Bill whistled past the house.", "<unk>")],
  ("sst2", "train"): [
    ("sst2 sentence: hide new secretions from the parental units ", "negative"),
    (
      "sst2 sentence: that loves its characters and communicates something rather beautiful about human nature ",
      "positive",
    ),
  ],
  ("mrpc", "train"): [
    (
      'mrpc sentence1: Amrozi accused his brother , whom he called " the witness " , of deliberately distorting '
      'his evidence . sentence2: Referring to him as only " the witness " , Amrozi accused his brother of '
      'deliberately distorting his evidence .',
      "equivalent",
    ),
    (
      "mrpc sentence1: Yucaipa owned Dominick 's before selling the chain to Safeway in 1998 . sentence2: "
      "Yucaipa bought Dominick 's in 1995 and sold it to Safeway in 1998 .",
      "not_equivalent",
    ),
  ],
  ("mrpc", "test"): [
    ("mrpc sentence1: PCCW 's chief operating officer will also leave . sentence2: He will leave too .", "<unk>")
  ],
  ("qqp", "train"): [
    (
      "qqp question1: How is the life of a math student? question2: Which level of preparation is enough?",
      "not_duplicate",
    ),
    ("qqp question1: What is the best way to learn French? question2: How can I learn French fast?", "duplicate"),
  ],
  # 5.0 and 3.8 stay; 2.75 * 5 = 13.75 rounds to 14 -> 2.8; 2.5 * 5 = 12.5 rounds half to even -> 12 -> 2.4.
  ("stsb", "train"): [
    ("stsb sentence1: A plane is taking off. sentence2: An air plane is taking off.", "5.0"),
    ("stsb sentence1: A man is playing a large flute. sentence2: A man is playing a flute.", "3.8"),
    ("stsb sentence1: A man spreads cheese. sentence2: A man spreads cheese on a pizza.", "2.8"),
    ("stsb sentence1: Three men play chess. sentence2: Two men play chess.", "2.4"),
  ],
  ("stsb", "test"): [("stsb sentence1: A girl is styling her hair. sentence2: A girl is brushing her hair.", "-1.0")],
  ("mnli", "train"): [
    (
      "mnli hypothesis: Product and geography are what make cream skimming work.  premise: Conceptually cream "
      "skimming has two basic dimensions - product and geography.",
      "neutral",
    ),
    (
      "mnli hypothesis: You lose the things to the following level if the people recall. premise: you know "
      "during the season and i guess at at your level uh you lose them",
      "entailment",
    ),
  ],
  ("mnli", "validation_mismatched"): [
    (
      "mnli hypothesis: Your contributions were of no help. premise: Your contribution helped make it possible.",
      "contradiction",
    ),
    ("mnli hypothesis: The answer is not no. premise: The answer is yes.", "entailment"),
  ],
  ("mnli", "test_matched"): [("mnli hypothesis: Hierbas is a name. premise: Hierbas, ans seco, ans dulce.", "<unk>")],
  ("mnli_matched", "validation"): [
    ("mnli hypothesis: Everyone really likes the newest benefits  premise: The new rights are nice enough", "neutral"),
    (
      "mnli hypothesis: The Government Executive articles are on the site. premise: This site includes a list "
      "of all award winners.",
      "contradiction",
    ),
    (
      "mnli hypothesis: I like him for the most part. premise: uh i don't know i i have mixed emotions about him",
      "entailment",
    ),
  ],
  ("qnli", "train"): [
    (
      "qnli question: When did the third Digimon series begin? sentence: Digimon Tamers takes a darker approach "
      "to its story.",
      "not_entailment",
    ),
    (
      "qnli question: What came into force after the new constitution was herald? sentence: As of that day, the "
      "new constitution heralding the Second Republic came into force.",
      "entailment",
    ),
  ],
  ("rte", "train"): [
    (
      "rte sentence1: No Weapons of Mass Destruction Found in Iraq Yet. sentence2: Weapons of Mass Destruction "
      "Found in Iraq.",
      "not_entailment",
    ),
    (
      "rte sentence1: Pope Benedict XVI was installed as the new Pope. sentence2: Pope Benedict XVI is the new leader.",
      "entailment",
    ),
  ],
  ("wnli", "train"): [
    (
      "wnli sentence1: I stuck a pin through a carrot. When I pulled the pin out, it had a hole. sentence2: The "
      "carrot had a hole.",
      "entailment",
    ),
    (
      "wnli sentence1: John couldn't see the stage with Billy in front of him because he is so short. sentence2: "
      "Billy is so short.",
      "not_entailment",
    ),
  ],
}


@pytest.mark.parametrize("name,split", sorted(GLUE_EXPECTED))
def test_glue_local_text_to_text(vocab, data_dir, name, split):
  _write(data_dir, GLUE_FILES)
  assert _pairs(_glue(name, vocab), split) == GLUE_EXPECTED[(name, split)]


def test_glue_local_features_and_splits(vocab, data_dir):
  _write(data_dir, GLUE_FILES)
  src = _glue("stsb", vocab).source
  rows = list(src.get_dataset("train", shuffle=False).as_numpy_iterator())
  assert [r["idx"] for r in rows] == [0, 1, 2, 3]
  assert rows[1]["label"] == pytest.approx(3.8) and rows[1]["sentence1"] == b"A man is playing a large flute."
  cola = list(_glue("cola", vocab).source.get_dataset("test", shuffle=False).as_numpy_iterator())
  assert cola[0]["label"] == -1 and cola[0]["idx"] == 0
  assert set(_glue("mnli", vocab).splits) == {
    "train",
    "validation_matched",
    "validation_mismatched",
    "test_matched",
    "test_mismatched",
  }
  assert set(_glue("mnli_mismatched", vocab).splits) == {"validation", "test"}
  assert _pairs(_glue("mnli_mismatched", vocab), "validation") == GLUE_EXPECTED[("mnli", "validation_mismatched")]


def test_glue_malformed_row_and_unknown_label(vocab, data_dir):
  files = dict(GLUE_FILES)
  files["glue/RTE/train.tsv"] = GLUE_FILES["glue/RTE/train.tsv"] + "2\tOnly one sentence here.\tentailment\n"
  files["glue/QNLI/train.tsv"] = GLUE_FILES["glue/QNLI/train.tsv"].replace("\tentailment\n", "\tentailed\n")
  files["glue/SST-2/train.tsv"] = GLUE_FILES["glue/SST-2/train.tsv"] + "a fine film\t2\n"
  files["glue/STS-B/train.tsv"] = GLUE_FILES["glue/STS-B/train.tsv"].replace("\t3.800\n", "\thigh\n")
  _write(data_dir, files)
  with pytest.raises(ValueError, match=r"RTE/train\.tsv:4: malformed row.*got 3"):
    _examples(_glue("rte", vocab), "train")
  with pytest.raises(ValueError, match=r"QNLI/train\.tsv:3: unknown qnli label 'entailed'"):
    _examples(_glue("qnli", vocab), "train")
  with pytest.raises(ValueError, match=r"SST-2/train\.tsv:4: unknown sst2 label '2'"):
    _examples(_glue("sst2", vocab), "train")
  with pytest.raises(ValueError, match=r"STS-B/train\.tsv:3: stsb score 'high' is not a number"):
    _examples(_glue("stsb", vocab), "train")


def test_glue_tfds_mock(vocab, no_data_dir):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    mnli = _glue("mnli_matched", vocab)
    raw = list(mnli.source.get_dataset("validation", shuffle=False).as_numpy_iterator())
    got = _pairs(mnli, "validation")
    stsb = _glue("stsb", vocab)
    raw_stsb = list(stsb.source.get_dataset("train", shuffle=False).as_numpy_iterator())
    got_stsb = _pairs(stsb, "train")
  assert len(got) == 3
  labels = ["entailment", "neutral", "contradiction"]
  for r, (inputs, targets) in zip(raw, got):
    assert inputs == f"mnli hypothesis: {r['hypothesis'].decode()} premise: {r['premise'].decode()}"
    assert targets == labels[r["label"]]
  for r, (inputs, targets) in zip(raw_stsb, got_stsb):
    assert inputs == f"stsb sentence1: {r['sentence1'].decode()} sentence2: {r['sentence2'].decode()}"
    assert abs(float(targets) - r["label"]) <= 0.1 + 1e-6 and round(float(targets) * 5, 6) % 1 == 0


# --- postprocessors and metrics -------------------------------------------------------------------------------
def test_postprocessors_unknown_string_is_wrong():
  from remixer_t5.tasks import glue, metrics, nli

  cola = glue.BENCHMARKS["cola"].postprocess_fn()
  assert [cola(s) for s in ("unacceptable", b"acceptable", " acceptable ", "Acceptable", "")] == [0, 1, 1, -1, -1]
  stsb = glue.BENCHMARKS["stsb"].postprocess_fn()
  assert [stsb(s) for s in ("3.4", b"0.0", "three", "nan", "")] == [3.4, 0.0, -1.0, -1.0, -1.0]
  assert [nli.abductive_postprocess(s) for s in ("1", b"2", "3", "one")] == [1, 2, -1, -1]
  mnli = glue.BENCHMARKS["mnli"].postprocess_fn()
  targets = [mnli(s, is_target=True) for s in ("entailment", "neutral", "contradiction")]
  assert targets == [0, 1, 2]
  preds = [mnli(s) for s in ("entailment", "maybe", "contradiction")]
  assert metrics.accuracy(targets, targets) == {"accuracy": 100.0}
  assert metrics.accuracy(targets, preds) == pytest.approx({"accuracy": 200 / 3})


def test_glue_metrics():
  from remixer_t5.tasks import glue, metrics

  assert glue.BENCHMARKS["cola"].metric_fns == (metrics.matthews_corrcoef,)
  assert glue.BENCHMARKS["mrpc"].metric_fns == (glue.f1_with_invalid, metrics.accuracy)
  assert glue.BENCHMARKS["qqp"].metric_fns == (glue.f1_with_invalid, metrics.accuracy)
  assert glue.BENCHMARKS["stsb"].metric_fns == (metrics.pearson_spearman,)
  assert all(glue.BENCHMARKS[b].metric_fns == (metrics.accuracy,) for b in ("sst2", "mnli", "qnli", "rte", "wnli"))
  gold = [1, 0, 1, 0]
  assert glue.f1_with_invalid(gold, gold) == {"f1": 100.0}
  # Invalid (-1) on a negative counts as a false positive, on a positive as a false negative:
  # TP=1, FP=1, FN=1 -> F1 = 2 / 4. The generic f1_binary would see FP=0 -> 2 / 3.
  assert glue.f1_with_invalid(gold, [1, -1, -1, 0]) == pytest.approx({"f1": 50.0})
  assert metrics.f1_binary(gold, [1, -1, -1, 0]) == pytest.approx({"f1": 200 / 3})
  with pytest.raises(ValueError):
    glue.f1_with_invalid(gold, [1])
  assert metrics.matthews_corrcoef(gold, gold) == {"mcc": 100.0}
  # tp=1, fn=1, tn=2, fp=0: (1*2 - 0) / sqrt(1 * 2 * 2 * 3) = 1 / sqrt(3).
  assert metrics.matthews_corrcoef([1, 1, 0, 0], [1, 0, 0, 0]) == pytest.approx({"mcc": 100 / 3**0.5})
  # An unparseable prediction (-1) is a third, wrong class (as sklearn's MCC, T5's metric, treats it):
  # correct 3 of 4, predicted counts (1, 2, 1), true counts (0, 2, 2): (3*4 - 6) / sqrt((16 - 6) * (16 - 8)).
  assert metrics.matthews_corrcoef([1, 1, 0, 0], [1, -1, 0, 0]) == pytest.approx({"mcc": 600 / 80**0.5})


# --- NLI ------------------------------------------------------------------------------------------------------
def _anli_row(uid, context, hypothesis, label):
  return json.dumps(
    {
      "uid": uid,
      "context": context,
      "hypothesis": hypothesis,
      "label": label,
      "model_label": "n",
      "emturk": False,
      "genre": "",
      "reason": "",
      "tag": "",
    }
  )


NLI_FILES = {
  **{
    f"anli/R{r}/{f}.jsonl": "\n".join(
      [
        _anli_row(
          f"r{r}-{f}-0",
          "Idris Sultan (born January 1990) is a Tanzanian actor.",
          "Idris Sultan was born in the first month of the year.",
          "e",
        ),
        _anli_row(f"r{r}-{f}-1", "The Oakland Athletics are a baseball team.", "They play soccer.", "c"),
        _anli_row(f"r{r}-{f}-2", "Kristen Stewart is an actress.", "She was born in 1990.", "n"),
      ]
    )
    + "\n"
    for r in (1, 2, 3)
    for f in ("train", "dev", "test")
  },
  "conjnli/adversarial_train_15k.tsv": "\ufeff"
  + _tsv(
    ["Premise", "Hypothesis", "Label"],
    [
      ["He was born in Illinois, but moved to Oklahoma in 1949.", "He was born in Illinois.", "entailment"],
      [
        'Season eight of "South Park" began airing on March 17, 2004.',
        'Season eight of "South Park" began airing in 2005.',
        "contradiction",
      ],
    ],
  ),
  "conjnli/conj_dev.tsv": "\ufeff"
  + _tsv(
    ["Premise", "Hypothesis", "Label"],
    [
      [
        "Historically, the Commission was run by three commissioners or fewer.",
        "Historically, the Commission was run by three commissioners.",
        "neutral",
      ]
    ],
  ),
  "alphanli/train.jsonl": "\n".join(
    json.dumps(r)
    for r in [
      {
        "story_id": "s1",
        "obs1": "Chad went to get the wheel alignment measured on his car.",
        "obs2": "The mechanic provided a working alignment with new body work.",
        "hyp1": "Chad was waiting for his car to be washed.",
        "hyp2": "Chad was waiting for his car to be fixed.",
      },
      {
        "story_id": "s2",
        "obs1": "Jenny was walking.",
        "obs2": "She got home dry.",
        "hyp1": "Jenny took an umbrella.",
        "hyp2": "Jenny forgot her umbrella in the rain.",
      },
    ]
  )
  + "\n",
  "alphanli/train-labels.lst": "2\n1\n",
  "alphanli/dev.jsonl": json.dumps({"story_id": "d1", "obs1": "A.", "obs2": "B.", "hyp1": "C.", "hyp2": "D."}) + "\n",
  "alphanli/dev-labels.lst": "1\n",
  "glue/QNLI/dev.tsv": _tsv(
    ["index", "question", "sentence", "label"],
    [["0", "What is the capital of France?", "Paris is the capital of France.", "entailment"]],
  ),
}
NLI_FILES.update({k: v for k, v in GLUE_FILES.items() if k.startswith("glue/MNLI/")})

ANLI_EXPECTED = [
  (
    "anli hypothesis: Idris Sultan was born in the first month of the year. premise: Idris Sultan (born January "
    "1990) is a Tanzanian actor.",
    "entailment",
  ),
  ("anli hypothesis: They play soccer. premise: The Oakland Athletics are a baseball team.", "contradiction"),
  ("anli hypothesis: She was born in 1990. premise: Kristen Stewart is an actress.", "neutral"),
]


@pytest.mark.parametrize("name", ["anli_r1", "anli_r2", "anli_r3"])
def test_anli_local(vocab, data_dir, name):
  _write(data_dir, NLI_FILES)
  task = _nli(name, vocab)
  assert set(task.splits) == {"train", "validation", "test"}
  for split in ("train", "validation", "test"):
    assert _pairs(task, split) == ANLI_EXPECTED
  uids = [r["uid"] for r in task.source.get_dataset("validation", shuffle=False).as_numpy_iterator()]
  assert uids == [f"r{name[-1]}-dev-{i}".encode() for i in range(3)]


def test_conjnli_abductive_qnli_local(vocab, data_dir):
  _write(data_dir, NLI_FILES)
  assert _pairs(_nli("conjnli", vocab), "train") == [
    (
      "conjnli hypothesis: He was born in Illinois. premise: He was born in Illinois, but moved to Oklahoma in 1949.",
      "entailment",
    ),
    (
      'conjnli hypothesis: Season eight of "South Park" began airing in 2005. premise: Season eight of "South '
      'Park" began airing on March 17, 2004.',
      "contradiction",
    ),
  ]
  assert _pairs(_nli("conjnli", vocab), "validation") == [
    (
      "conjnli hypothesis: Historically, the Commission was run by three commissioners. premise: Historically, "
      "the Commission was run by three commissioners or fewer.",
      "neutral",
    )
  ]
  assert _pairs(_nli("abductive_nli", vocab), "train") == [
    (
      "abductive_nli observation1: Chad went to get the wheel alignment measured on his car. observation2: The "
      "mechanic provided a working alignment with new body work. hypothesis1: Chad was waiting for his car to be "
      "washed. hypothesis2: Chad was waiting for his car to be fixed.",
      "2",
    ),
    (
      "abductive_nli observation1: Jenny was walking. observation2: She got home dry. hypothesis1: Jenny took an "
      "umbrella. hypothesis2: Jenny forgot her umbrella in the rain.",
      "1",
    ),
  ]
  assert _pairs(_nli("abductive_nli", vocab), "validation") == [
    ("abductive_nli observation1: A. observation2: B. hypothesis1: C. hypothesis2: D.", "1")
  ]
  assert _pairs(_nli("qnli", vocab), "validation") == [
    ("qnli question: What is the capital of France? sentence: Paris is the capital of France.", "entailment")
  ]


def test_nli_bad_rows_name_file_and_line(vocab, data_dir):
  files = dict(NLI_FILES)
  files["anli/R1/dev.jsonl"] = NLI_FILES["anli/R1/dev.jsonl"] + '{"uid": "x", "context": "c"\n'
  files["anli/R2/dev.jsonl"] = NLI_FILES["anli/R2/dev.jsonl"] + _anli_row("y", "c", "h", "entailment") + "\n"
  files["conjnli/conj_dev.tsv"] = NLI_FILES["conjnli/conj_dev.tsv"] + "A premise.\tA hypothesis.\tEntails\n"
  files["conjnli/adversarial_train_15k.tsv"] = NLI_FILES["conjnli/adversarial_train_15k.tsv"] + "Only\ttwo\n"
  files["alphanli/train-labels.lst"] = "2\n3\n"
  files["alphanli/dev-labels.lst"] = "1\n2\n"
  _write(data_dir, files)
  with pytest.raises(ValueError, match=r"R1/dev\.jsonl:4: malformed JSON"):
    _examples(_nli("anli_r1", vocab), "validation")
  with pytest.raises(ValueError, match=r"R2/dev\.jsonl:4: unknown ANLI label 'entailment'"):
    _examples(_nli("anli_r2", vocab), "validation")
  with pytest.raises(ValueError, match=r"conj_dev\.tsv:3: unknown ConjNLI label 'Entails'"):
    _examples(_nli("conjnli", vocab), "validation")
  with pytest.raises(ValueError, match=r"adversarial_train_15k\.tsv:4: malformed row.*got 2"):
    _examples(_nli("conjnli", vocab), "train")
  with pytest.raises(ValueError, match=r"train-labels\.lst:2: unknown αNLI label '3'"):
    _examples(_nli("abductive_nli", vocab), "train")
  with pytest.raises(ValueError, match=r"dev-labels\.lst: 2 labels for the 1 rows of .*dev\.jsonl"):
    _examples(_nli("abductive_nli", vocab), "validation")


def test_local_only_tasks_say_where_they_looked(vocab, no_data_dir, tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match=r"'conjnli'.*REMIXER_T5_DATA_DIR is not set"):
    _examples(_nli("conjnli", vocab), "validation")
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path))
  _write(tmp_path, {"alphanli/dev.jsonl": NLI_FILES["alphanli/dev.jsonl"]})
  with pytest.raises(FileNotFoundError, match=r"dev-labels\.lst is missing"):
    _examples(_nli("abductive_nli", vocab), "validation")


def test_anli_tfds_mock(vocab, no_data_dir):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    task = _nli("anli_r3", vocab)
    raw = list(task.source.get_dataset("test", shuffle=False).as_numpy_iterator())
    got = _pairs(task, "test")
  assert len(got) == 3
  for r, (inputs, targets) in zip(raw, got):
    assert inputs == f"anli hypothesis: {r['hypothesis'].decode()} premise: {r['context'].decode()}"
    assert targets == ["entailment", "neutral", "contradiction"][r["label"]]


def test_mnli_mixture_trains_once_and_evaluates_both_halves(vocab, data_dir):
  """Training data of the mixture is MNLI train alone; a seqio Evaluator scores matched and mismatched."""
  import numpy as np
  import seqio
  from remixer_t5.tasks import nli

  _write(data_dir, NLI_FILES)
  matched, mismatched = _nli("mnli_matched", vocab), _nli("mnli_mismatched", vocab)
  mix = seqio.get_mixture_or_task(nli.register_mnli_mixture("test_mnli", matched.name, mismatched.name))
  assert {t.name for t in mix.tasks} == {matched.name, mismatched.name}
  assert "train" not in mismatched.splits

  train = mix.get_dataset(
    SEQ_LEN, split="train", shuffle=False, num_epochs=1, copy_pretokenized=True, try_in_mem_cache=False
  )
  got = sorted(ex["inputs_pretokenized"].decode() for ex in train.as_numpy_iterator())
  assert got == sorted(i for i, _ in GLUE_EXPECTED[("mnli", "train")])

  evaluator = seqio.Evaluator(
    mixture_or_task_name="test_mnli",
    feature_converter=seqio.EncDecFeatureConverter(pack=False),
    eval_split="validation",
    async_compute_metrics=False,
  )
  assert sorted(t.name for t in evaluator.eval_tasks) == sorted([matched.name, mismatched.name])
  always = vocab.encode("entailment") + [1]

  def predict_fn(ds):  # every prediction: "entailment"
    return [(int(i), always) for i, _ in ds.as_numpy_iterator()]

  metrics, _ = evaluator.evaluate(compute_metrics=True, predict_fn=predict_fn)
  result = {
    task: {k: float(np.asarray(getattr(v, "value", v))) for k, v in values.items()}
    for task, values in metrics.result().items()
  }
  # matched dev: neutral, contradiction, entailment -> 1/3; mismatched dev: contradiction, entailment -> 1/2.
  assert set(result) == {matched.name, mismatched.name}
  assert result[matched.name] == pytest.approx({"accuracy": 100 / 3})
  assert result[mismatched.name] == pytest.approx({"accuracy": 50.0})


def test_registered_mnli_mixture_layout():
  import seqio
  from remixer_t5.tasks import nli  # noqa: F401

  mix = seqio.get_mixture_or_task("mnli")
  assert [t.name for t in mix.tasks] == ["mnli_matched", "mnli_mismatched"]
  assert set(seqio.get_mixture_or_task("mnli_matched").splits) == {"train", "validation", "test"}
  assert set(seqio.get_mixture_or_task("mnli_mismatched").splits) == {"validation", "test"}
  src = seqio.get_mixture_or_task("mnli_mismatched").source
  assert src.tfds_name == "glue/mnli:2.0.0"
  assert src.tfds_splits == {"validation": "validation_mismatched", "test": "test_mismatched"}


# --- SQuAD ----------------------------------------------------------------------------------------------------
SQUAD_DEV = {
  "version": "1.1",
  "data": [
    {
      "title": "Super_Bowl_50",
      "paragraphs": [
        {
          "context": "Super Bowl 50 was an American football game to determine the champion of the National Football "
          "League (NFL) for the 2015 season.",
          "qas": [
            {
              "id": "q1",
              "question": "Which league's champion did the game decide?",
              "answers": [
                {"answer_start": 77, "text": "National Football League (NFL)"},
                {"answer_start": 77, "text": "National Football League"},
                {"answer_start": 103, "text": "NFL"},
              ],
            }
          ],
        }
      ],
    },
    {
      "title": "Normans",
      "paragraphs": [
        {
          "context": "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy.",
          "qas": [
            {
              "id": "q2",
              "question": "In what country is Normandy located?",
              "answers": [{"answer_start": 83, "text": "Normandy"}],
            }
          ],
        }
      ],
    },
  ],
}


def _squad(vocab):
  import seqio
  from remixer_t5.tasks import squad

  return seqio.get_mixture_or_task(squad.register_squad_task("test_squad", vocab))


def test_squad_local(vocab, data_dir):
  _write(
    data_dir,
    {
      "squad/dev-v1.1.json": json.dumps(SQUAD_DEV),
      "squad/train-v1.1.json": json.dumps({"version": "1.1", "data": SQUAD_DEV["data"][1:]}),
    },
  )
  task = _squad(vocab)
  assert _pairs(task, "validation") == [
    (
      "question: Which league ' s champion did the game decide ? context: Super Bowl 50 was an American football "
      "game to determine the champion of the National Football League ( NFL ) for the 2015 season .",
      "National Football League ( NFL )",
    ),
    (
      "question: In what country is Normandy located ? context: The Normans were the people who in the 10th and "
      "11th centuries gave their name to Normandy .",
      "Normandy",
    ),
  ]
  assert len(_pairs(task, "train")) == 1
  examples = _examples(task, "validation")
  targets = [task.postprocess_fn(ex["targets_pretokenized"], example=ex, is_target=True) for ex in examples]
  assert targets == [["National Football League ( NFL )", "National Football League", "NFL"], ["Normandy"]]
  assert task.postprocess_fn(b"NFL") == "NFL"
  raw = list(task.source.get_dataset("validation", shuffle=False).as_numpy_iterator())
  assert raw[0]["answers"]["answer_start"].tolist() == [77, 77, 103] and raw[0]["title"] == b"Super_Bowl_50"
  # metrics.squad: the best answer counts. "the NFL league" vs "NFL": EM 0, F1 = 2 * (1/2 * 1) / (1/2 + 1) = 2/3.
  (fn,) = task.metric_fns
  assert fn(targets, ["NFL", "Normandy"]) == {"em": 100.0, "f1": 100.0}
  assert fn(targets, ["the NFL league", "Normandy"]) == pytest.approx({"em": 50.0, "f1": 100 * (2 / 3 + 1) / 2})


def test_squad_bad_files(vocab, data_dir):
  bad = json.loads(json.dumps(SQUAD_DEV))
  del bad["data"][1]["paragraphs"][0]["qas"][0]["question"]
  _write(data_dir, {"squad/dev-v1.1.json": json.dumps(bad), "squad/train-v1.1.json": '{"data": [\n  {"title": }'})
  task = _squad(vocab)
  with pytest.raises(
    ValueError,
    match=r"dev-v1\.1\.json: data\[1\]\.paragraphs\[0\]\.qas\[0\]: missing field "
    r"'question'",
  ):
    _examples(task, "validation")
  # line 2 is '  {"title": }': the value expected at column 13 is missing.
  with pytest.raises(ValueError, match=r"train-v1\.1\.json:2:13: malformed JSON"):
    _examples(task, "train")


def test_squad_tfds_mock(vocab, no_data_dir):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=2, policy=tfds.testing.MockPolicy.USE_CODE):
    task = _squad(vocab)
    raw = list(task.source.get_dataset("validation", shuffle=False).as_numpy_iterator())
    examples = _examples(task, "validation")
  assert len(examples) == 2
  for r, ex in zip(raw, examples):  # mock text has no punctuation: only whitespace runs collapse
    question, context = (" ".join(r[k].decode().split()) for k in ("question", "context"))
    assert ex["inputs_pretokenized"].decode() == f"question: {question} context: {context}"
    assert ex["targets_pretokenized"].decode() == " ".join(r["answers"]["text"][0].decode().split())
    assert len(ex["answers"]) == len(r["answers"]["text"])


# --- real data, registration ----------------------------------------------------------------------------------
def test_conjnli_real_files_with_t5_vocabulary(data_dir, monkeypatch):
  if not all((CONJNLI / f).is_file() for f in ("adversarial_train_15k.tsv", "conj_dev.tsv")):
    pytest.skip(f"ConjNLI release files not found in {CONJNLI}")
  if not T5_VOCAB.is_file():
    pytest.skip(f"T5 vocabulary not found at {T5_VOCAB}")
  import seqio
  from remixer_t5.tasks import nli

  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(CONJNLI.parent))
  task = seqio.get_mixture_or_task(
    nli.register_nli_task("conjnli", "test_conjnli_t5", seqio.SentencePieceVocabulary(str(T5_VOCAB), extra_ids=100))
  )
  assert task.source.num_input_examples("train") == 15000
  vocab = task.output_features["targets"].vocabulary
  examples = _examples(task, "validation")
  assert len(examples) == 623
  first = examples[0]
  assert first["inputs_pretokenized"].decode() == (
    "conjnli hypothesis: Historically, the Commission was run by three commissioners. premise: Historically, "
    "the Commission was run by three commissioners or fewer."
  )
  assert first["targets_pretokenized"] == b"neutral"
  assert {vocab.decode(ex["targets"].tolist()[:-1]) for ex in examples} == {"entailment", "neutral", "contradiction"}


def test_registration_idempotent_lazy_and_default_vocabulary(monkeypatch):
  import importlib
  import seqio
  from remixer_t5.data.vocab import t5_vocabulary
  from remixer_t5.tasks import glue, nli, squad

  monkeypatch.setenv("REMIXER_T5_DATA_DIR", "/nonexistent/remixer_t5_data")
  before = set(seqio.TaskRegistry.names()), set(seqio.MixtureRegistry.names())
  for module in (glue, nli, squad):
    importlib.reload(module)  # registering again: a no-op, and no I/O although the data dir is missing
  assert (set(seqio.TaskRegistry.names()), set(seqio.MixtureRegistry.names())) == before
  glue_names = glue.register_glue_tasks()
  assert set(glue_names) == {
    f"glue_{b}"
    for b in ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli")
  }
  assert set(nli.register_nli_tasks()) >= {"mnli", "anli_r1", "anli_r2", "anli_r3", "conjnli", "abductive_nli", "qnli"}
  assert squad.register_squad_task() == "squad"
  for name in glue_names + ["mnli_matched", "anli_r1", "conjnli", "abductive_nli", "qnli", "squad"]:
    assert seqio.get_mixture_or_task(name).output_features["targets"].vocabulary == t5_vocabulary()
  with pytest.raises(ValueError, match="already registered"):
    glue.register_glue_task("cola", vocabulary=seqio.ByteVocabulary())
  with pytest.raises(ValueError, match="already registered"):
    nli.register_nli_task("conjnli", vocabulary=seqio.ByteVocabulary())
  assert seqio.get_mixture_or_task("squad").source.tfds_name == "squad/v1.1:3.0.0"
  assert seqio.get_mixture_or_task("anli_r2").source.tfds_name == "anli/r2:0.1.0"
  assert seqio.get_mixture_or_task("glue_cola").source.tfds_name == "glue/cola:2.0.0"


def test_glue_proportional_mixture():
  import seqio
  from remixer_t5.tasks import glue  # noqa: F401

  mix = seqio.get_mixture_or_task("glue_proportional")
  rates = dict(mix.rate_per_task_name)
  assert "glue_wnli" not in rates  # T5 trains WNLI through WSC, not in the GLUE mixture
  assert rates["glue_mnli_matched"] == rates["glue_mnli_mismatched"] == 0.0
  assert rates["glue_mnli"] == 392_702.0 and rates["glue_rte"] == 2_490.0
  from seqio.evaluation import get_valid_eval_tasks

  evaluated = {t.name for t in get_valid_eval_tasks(mix.tasks, "validation")}
  assert evaluated == {
    "glue_cola",
    "glue_sst2",
    "glue_mrpc",
    "glue_qqp",
    "glue_stsb",
    "glue_qnli",
    "glue_rte",
    "glue_mnli_matched",
    "glue_mnli_mismatched",
  }
