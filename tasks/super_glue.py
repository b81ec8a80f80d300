"""SuperGLUE (Wang et al. 2019) as seqio tasks in T5's text-to-text formats, with the official metrics.

Tasks (``register_super_glue_tasks``, names ``<prefix><task>``, prefix ``super_glue_``):

  boolq cb copa multirc record rte wic wsc   splits train / validation / test
  axb axg                                    split test only (the diagnostics: eval only)
  dpr                                        splits train / test: T5's dpr_v001_simple, WSC-format data
  mixture ``<prefix>proportional``           the 8 training tasks and DPR at T5's fixed rates

Formats (T5: t5/data/glue_utils.py get_glue_text_preprocessor -> t5/data/preprocessors.py glue / record /
wsc_simple; postprocessors from t5/data/postprocessors.py):

* GLUE style: ``"<benchmark> <key>: <text> <key>: <text> ..."`` with the feature names sorted (what T5's
  ``glue`` does when given none; idx and label left out), MultiRC ``question answer paragraph`` and WiC
  ``sentence1 sentence2 word`` in T5's explicit orders (WiC's character offsets unused). MultiRC loses its
  ``<br>`` / ``<b>`` markup. The target is the label name (``"<unk>"`` for an unlabeled test row). AX-b and
  AX-g are cast as RTE (``rte hypothesis: ... premise: ...``; AX-b's sentence1 is the premise).
* ReCoRD: ``record query: <query> entities: <e1>, <e2> passage: <passage>``, ``@highlight`` lines joined
  into sentences; one example per distinct answer (a copy per answer, in every split, as T5), the target
  that answer; eval deduplicates the copies and scores EM/F1 max over all answers.
* WSC (T5's "wsc simple"): ``wsc: <text with the pronoun as *he*>`` -> the candidate noun phrase. Train on
  rows whose candidate is the referent only (the source filters the train split); eval on all rows: the
  prediction counts as True when it names the candidate (T5's postprocessors.wsc_simple rule).
* DPR (T5's ``definite_pronoun_resolution_simple``): ``wsc: <sentence with the pronoun as *he*>`` -> the
  correct candidate, scored by accuracy on the decoded string (T5 has no postprocessor for it).

The mixture ``<prefix>proportional`` is T5's ``super_glue_v102_proportional``: rates are T5's fixed training
example counts (t5/data/glue_utils.py SUPER_GLUE_WEIGHT_MAPPING; ``MIXTURE_RATES``), so they need no data.

Metrics (percent; tasks/metrics.py): accuracy (BoolQ, COPA, RTE, WiC, WSC); CB f1_macro over the 3 classes +
accuracy; MultiRC f1a over all answer options + exact_match per question; ReCoRD em / f1; AX-b mcc; AX-g
accuracy + gender_parity. A decoded string naming no class becomes -1, which always counts as wrong. The
benchmark's score (``super_glue_average``) is the leaderboard's and T5's: the mean over the 8 tasks of each task's
mean metric, without AX-b, AX-g and DPR; evaluations log it as ``<prefix>average`` once all 8 tasks are scored.

Data: TFDS ``super_glue/<config>:1.0.2`` (WSC from ``wsc.fixed`` as T5) and ``definite_pronoun_resolution:1.1.0``,
or the release files under ``<data dir>/`` (layout: docs/data.md; AX-b/AX-g's are TFDS's test split; DPR's
``{train,test}.c.txt`` hold 4 lines per example: sentence, pronoun, ``candidate,candidate``, answer; blank line).
The readers turn release rows into TFDS's features (MultiRC: one row per answer option; ReCoRD: one per
query with the sorted distinct entity / answer strings; WSC with TFDS's ``wsc.fixed`` span repairs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import seqio
import tensorflow as tf
from remixer_t5.tasks import metrics
from remixer_t5.tasks.common import add_task, as_vocabulary
from remixer_t5.tasks.glue import text_to_text
from remixer_t5.tasks.sources import LocalOrTfdsSource, read_jsonl, read_line_blocks

TFDS_VERSION = "1.0.2"  # tensorflow_datasets 4.9.10's super_glue (1.0.2: deterministic ReCoRD)
PREFIX = "super_glue_"
TRAIN_TASKS = ("boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc")
DIAGNOSTIC_TASKS = ("axb", "axg")
SPLIT_FILES = {"train": "train.jsonl", "validation": "val.jsonl", "test": "test.jsonl"}

# DPR (T5's dpr_v001_simple): TFDS definite_pronoun_resolution, or its release files (the ones TFDS downloads).
DPR = "dpr"  # the task's name (``<prefix>dpr`` when registered under another prefix)
DPR_TFDS_NAME = "definite_pronoun_resolution:1.1.0"  # the version T5 pins, tensorflow_datasets 4.9.10's
DPR_LOCAL_DIR = "definite_pronoun_resolution"
DPR_SPLIT_FILES = {"train": "train.c.txt", "test": "test.c.txt"}  # DPR has no validation split

# T5's fixed mixing rates, t5/data/glue_utils.py SUPER_GLUE_WEIGHT_MAPPING (get_super_glue_weight_mapping):
# training examples after T5's preprocessing (ReCoRD one per answer, MultiRC one per answer option, WSC the
# referent rows), so super_glue_proportional's rates need no data and equal super_glue_v102_proportional's.
# T5's rate-0 entries (wsc eval, axb, axg: evaluation only) are not in the mixture here.
MIXTURE_RATES = {
  "boolq": 9_427.0,
  "cb": 250.0,
  "copa": 400.0,
  "multirc": 27_243.0,
  "record": 138_854.0,
  "rte": 2_490.0,
  "wic": 5_428.0,
  "wsc": 259.0,
  DPR: 1_322.0,
}

# Label names (class id = position), as TFDS's super_glue configs define them.
BOOL_LABELS = ("False", "True")
CB_LABELS = ("entailment", "contradiction", "neutral")
COPA_LABELS = ("choice1", "choice2")
RTE_LABELS = ("entailment", "not_entailment")
UNKNOWN_TARGET = "<unk>"  # T5's target for an unlabeled (test) row
INVALID = -1  # T5's class id for a prediction that names no class: it counts as wrong


# --- release jsonl -> TFDS features ------------------------------------------------------------------------
class _RowError(ValueError):
  """A release row that cannot become a TFDS example (the reader adds file and line)."""


def _field(row: Mapping, key: str, kind: type, what: str):
  if key not in row:
    raise _RowError(f"lacks field {key!r}")
  if isinstance(row[key], bool) or not isinstance(row[key], kind):
    raise _RowError(f"field {key!r} must be {what}, got {row[key]!r}")
  return row[key]


def _text(row: Mapping, key: str) -> str:
  return _field(row, key, str, "a string")


def _int(row: Mapping, key: str) -> int:
  return _field(row, key, int, "an integer")


def _label(row: Mapping, names: Sequence[str], unlabeled_ok: bool) -> int:
  """TFDS's class id of ``row["label"]``: a label name; for True/False labels also a bool or 0/1 (TFDS casts
  those to "False"/"True" / "0"/"1"); COPA's 0/1 (TFDS maps a true value to "choice2"); -1 when an unlabeled
  row is allowed."""
  if "label" not in row or row["label"] is None:
    if unlabeled_ok:
      return -1
    raise _RowError("lacks field 'label' (only test files may be unlabeled)")
  value = row["label"]
  if names == COPA_LABELS:
    if isinstance(value, str) or value not in (0, 1):
      raise _RowError(f"unknown label {value!r}; expected 0 (choice1) or 1 (choice2)")
    return int(value)
  if names == BOOL_LABELS and (isinstance(value, bool) or value in (0, 1)) and not isinstance(value, str):
    return int(value)
  if isinstance(value, str) and value in names:
    return names.index(value)
  raise _RowError(
    f"unknown label {value!r}; expected one of {list(names)}" + (" or a bool / 0 / 1" if names == BOOL_LABELS else "")
  )


def _flat(names: Sequence[str], labels: Sequence[str], ints: Sequence[str] = ()) -> Callable:
  """Row converter for a one-row-one-example config: text ``names``, int ``ints``, idx and label."""

  def convert(row, unlabeled_ok):
    ex = {k: _text(row, k) for k in names}
    ex.update({k: _int(row, k) for k in ints})
    ex["idx"] = _int(row, "idx")
    ex["label"] = _label(row, labels, unlabeled_ok)
    return [ex]

  return convert


def _multirc(row, unlabeled_ok):
  # One TFDS example per (question, answer option), idx {paragraph, question, answer}.
  passage = row.get("passage")
  if not isinstance(passage, Mapping) or not isinstance(passage.get("questions"), list):
    raise _RowError("field 'passage' must be an object with 'text' and a list 'questions'")
  paragraph, out = _text(passage, "text"), []
  for question in passage["questions"]:
    if not isinstance(question, Mapping) or not isinstance(question.get("answers"), list):
      raise _RowError("each question must be an object with 'question', 'idx' and a list 'answers'")
    for answer in question["answers"]:
      if not isinstance(answer, Mapping):
        raise _RowError(f"answer must be an object, got {answer!r}")
      out.append(
        {
          "paragraph": paragraph,
          "question": _text(question, "question"),
          "answer": _text(answer, "text"),
          "label": _label(answer, BOOL_LABELS, unlabeled_ok),
          "idx": {"paragraph": _int(row, "idx"), "question": _int(question, "idx"), "answer": _int(answer, "idx")},
        }
      )
  return out


def _record(row, unlabeled_ok):
  # One TFDS example per query; entities are the passage's character spans (end inclusive), answers the
  # answer texts, each as a sorted set of distinct strings (TFDS's _get_record_entities / _answers).
  del unlabeled_ok  # a query without answers is a test query (answers [])
  passage = row.get("passage")
  if not isinstance(passage, Mapping) or not isinstance(passage.get("entities"), list):
    raise _RowError("field 'passage' must be an object with 'text' and a list 'entities'")
  if not isinstance(row.get("qas"), list):
    raise _RowError("field 'qas' must be a list of queries")
  text = _text(passage, "text")
  entities = set()
  for span in passage["entities"]:
    if not isinstance(span, Mapping):
      raise _RowError(f"entity must be an object with start and end, got {span!r}")
    start, end = _int(span, "start"), _int(span, "end")
    if not 0 <= start <= end < len(text):
      raise _RowError(f"entity span [{start}, {end}] lies outside the passage ({len(text)} characters)")
    entities.add(text[start : end + 1])
  out = []
  for qa in row["qas"]:
    if not isinstance(qa, Mapping) or not isinstance(qa.get("answers", []), list):
      raise _RowError("each query must be an object with 'query', 'idx' and a list 'answers'")
    answers = set()
    for answer in qa.get("answers", []):
      if not isinstance(answer, Mapping):
        raise _RowError(f"answer must be an object with 'text', got {answer!r}")
      answers.add(_text(answer, "text"))
    out.append(
      {
        "passage": text,
        "query": _text(qa, "query"),
        "entities": sorted(entities),
        "answers": sorted(answers),
        "idx": {"passage": _int(row, "idx"), "query": _int(qa, "idx")},
      }
    )
  return out


# T5's _wsc_inputs special-cases two texts whose pronoun is not the word at span2_index (the released index
# or word is off); these are the pronoun-blanked texts T5 uses for them.
_WSC_SPECIAL = {
  (
    'The boy continued to whip the pony , and eventually the pony threw him over. John laughed out quite '
    'loud. "Good for him," he said. '
  ): (
    'The boy continued to whip the pony , and eventually the pony threw him over. John laughed out '
    'quite loud. "Good for X ," he said.'
  ),
  (
    'When they had eventually calmed down a bit , and had gotten home, Mr. Farley put the magic pebble in '
    'an iron safe . Some day they might want to use it , but really for now, what more could they wish '
    'for?'
  ): (
    'When they had eventually calmed down a bit , and had gotten home, Mr. Farley put the magic pebble '
    'in an iron safe . Some day they might want to use X , but really for now, what more could they '
    'wish for?'
  ),
}


def _wsc_fix_span(ex: dict, key: str) -> None:
  """TFDS's ``wsc.fixed`` repair of a span text that is not a substring of the text (its ``_fix_wst``):
  match the case of the word at the span index, drop trailing periods and newlines."""
  span, index = ex[key + "_text"], ex[key + "_index"]
  if span in ex["text"] or span in ("Kamenev and Zinoviev", "Kamenev, Zinoviev, and Stalin"):
    return  # fine, or (the Kamenev spans) beyond repair: TFDS keeps them as they are
  if "theyscold" in span:
    ex["span2_index"] = 10  # TFDS moves the index only (its text fix is a no-op)
  words = ex["text"].split()
  if not 0 <= index < len(words):
    raise _RowError(f"{key}_index {index} is outside the text's {len(words)} words")
  span = (span[0].lower() if words[index][0].islower() else span[0].upper()) + span[1:]
  span = span.rstrip(".").replace("\n", " ")
  if span not in ex["text"]:
    raise _RowError(
      f"{key}_text {ex[key + '_text']!r} is not in the text, even repaired as TFDS's wsc.fixed does ({span!r})"
    )
  ex[key + "_text"] = span


def _wsc(row, unlabeled_ok):
  target = row.get("target")
  if not isinstance(target, Mapping):
    raise _RowError("field 'target' must be an object with span1_index, span2_index, span1_text, span2_text")
  ex = {
    "text": _text(row, "text"),
    "span1_index": _int(target, "span1_index"),
    "span2_index": _int(target, "span2_index"),
    "span1_text": _text(target, "span1_text"),
    "span2_text": _text(target, "span2_text"),
  }
  _wsc_fix_span(ex, "span1")
  _wsc_fix_span(ex, "span2")
  ex["idx"] = _int(row, "idx")
  ex["label"] = _label(row, BOOL_LABELS, unlabeled_ok)
  # T5's wsc_simple replaces the word at span2_index (words split on single spaces) and asserts that it is
  # the pronoun; say so here, with file and line, rather than as a TensorFlow assertion later.
  words = ex["text"].split(" ")
  if ex["text"] not in _WSC_SPECIAL and not (
    0 < ex["span2_index"] < len(words) and words[ex["span2_index"]] == ex["span2_text"]
  ):
    found = words[ex["span2_index"]] if 0 <= ex["span2_index"] < len(words) else None
    raise _RowError(
      f"span2_text {ex['span2_text']!r} is not word {ex['span2_index']} of the text "
      f"(split on spaces: {found!r}), as T5's WSC format needs"
    )
  return [ex]


def _reader(convert: Callable, required: Sequence[str] = ()) -> Callable[[str], Iterable[dict]]:
  """path -> TFDS examples of each release row; a bad row raises ValueError naming file and line."""

  def read(path: str):
    # Only test files are unlabeled in the release; TFDS gives such rows label -1. AX-b/AX-g are TFDS's
    # test split (labeled in the v2 release).
    unlabeled_ok = Path(path).name.startswith(("test", "AX-"))
    for lineno, row in read_jsonl(path, required):
      try:
        examples = convert(row, unlabeled_ok)
      except _RowError as e:
        raise ValueError(f"{path}:{lineno}: {e}") from None
      except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{path}:{lineno}: malformed row ({type(e).__name__}: {e})") from None
      yield from examples

  return read


def read_dpr(path: str) -> Iterable[dict]:
  """A DPR release file (Rahman & Ng 2012; ``train.c.txt`` / ``test.c.txt``) as TFDS's ``definite_pronoun_resolution``
  examples. Each example is four lines (the sentence, the pronoun, the two candidate antecedents separated by a comma,
  the correct one) and a blank line; TFDS strips each line and each candidate, and the label is the correct candidate's
  position. A bad example raises ValueError naming file and line."""
  for lineno, lines in read_line_blocks(path):
    where = f"{path}:{lineno}"
    if len(lines) != 4:
      raise ValueError(
        f"{where}: a DPR example is 4 lines (sentence, pronoun, 'candidate 1,candidate 2', "
        f"correct candidate) then a blank line; got {len(lines)} line(s): {lines[:6]!r}"
      )
    sentence, pronoun, candidates_line, correct = lines
    candidates = [c.strip() for c in candidates_line.split(",")]
    if len(candidates) != 2 or not all(candidates):
      raise ValueError(
        f"{where}: DPR candidates line {candidates_line!r} must name 2 candidates separated by "
        f"one comma, got {candidates}"
      )
    if correct not in candidates:
      raise ValueError(f"{where}: DPR correct antecedent {correct!r} is not one of the candidates {candidates}")
    yield {"sentence": sentence, "pronoun": pronoun, "candidates": candidates, "label": candidates.index(correct)}


# --- text-to-text preprocessors (TensorFlow, as T5's) ---------------------------------------------------------
def record_format(dataset):
  """T5's ``record`` preprocessor: one example per answer (one ``<unk>`` example for an unanswered query),
  ``@highlight`` lines turned into sentences, all answers passed through for eval."""

  def expand(x):
    passage = tf.strings.regex_replace(x["passage"], r"(\.|\?|\!|\"|\')\n@highlight\n", r"\1 ")
    passage = tf.strings.regex_replace(passage, r"\n@highlight\n", ". ")
    inputs = tf.strings.join(
      [
        "record query:",
        x["query"],
        "entities:",
        tf.strings.reduce_join(x["entities"], separator=", "),
        "passage:",
        passage,
      ],
      separator=" ",
    )
    answers = x["answers"]
    targets = tf.cond(tf.size(answers) > 0, lambda: answers, lambda: tf.constant([UNKNOWN_TARGET]))
    n = tf.size(targets)
    return tf.data.Dataset.from_tensor_slices(
      {
        "idx/passage": tf.fill([n], x["idx"]["passage"]),
        "idx/query": tf.fill([n], x["idx"]["query"]),
        "inputs": tf.fill([n], inputs),
        "targets": targets,
        "answers": tf.broadcast_to(answers[tf.newaxis], tf.stack([n, tf.size(answers)])),
      }
    )

  return dataset.flat_map(expand)


@seqio.map_over_dataset
def wsc_simple_format(x):
  """T5's ``wsc_simple``: ``"wsc: " + text`` with the pronoun (word span2_index) marked ``*pronoun*``;
  target the candidate (span1_text); label kept for eval."""
  text, index = x["text"], x["span2_index"]
  special_texts = tf.constant(list(_WSC_SPECIAL))
  hit = tf.equal(special_texts, text)

  def blank_pronoun():
    words = tf.strings.split(text, sep=" ")
    checks = [
      tf.debugging.assert_greater(index, 0, message="WSC pronoun index must be > 0"),
      tf.debugging.assert_less(index, tf.size(words), message="WSC pronoun index past the text"),
    ]
    with tf.control_dependencies(checks):
      checks.append(
        tf.debugging.assert_equal(
          words[index], x["span2_text"], message="WSC span2_text is not the word at span2_index"
        )
      )
    with tf.control_dependencies(checks):
      return tf.strings.join(
        [
          tf.strings.reduce_join(words[:index], separator=" "),
          "X",
          tf.strings.reduce_join(words[index + 1 :], separator=" "),
        ],
        separator=" ",
      )

  blanked = tf.cond(
    tf.reduce_any(hit), lambda: tf.boolean_mask(tf.constant(list(_WSC_SPECIAL.values())), hit)[0], blank_pronoun
  )
  marked = tf.strings.regex_replace(blanked, " X ", tf.strings.join([" *", x["span2_text"], "* "]))
  return {
    "inputs": tf.strings.join(["wsc:", marked], separator=" "),
    "targets": tf.reshape(x["span1_text"], []),
    "label": x["label"],
    "idx": x["idx"],
  }


@seqio.map_over_dataset
def dpr_simple_format(x):
  """T5's ``definite_pronoun_resolution_simple`` (dpr_v001_simple): ``"wsc: " + sentence`` with the first
  occurrence of the pronoun that follows a space and precedes a space, "." or "," marked ``*pronoun*``
  (case-sensitive; a pronoun that opens the sentence stays unmarked, as in T5; the pronoun is matched as
  literal text, where T5 puts it into the pattern unescaped); target the correct candidate.
  WSC's format, so DPR's examples teach the WSC task (T5 trains both in super_glue_v102_proportional)."""
  pronoun = tf.strings.regex_replace(x["pronoun"], r"([\\.^$|?*+()\[\]{}])", r"\\\1")  # as a literal
  pattern = tf.strings.join([" (", pronoun, r")( |\.|,)"])
  marked = tf.strings.regex_replace(x["sentence"], pattern, r" *\1*\2", replace_global=False)
  return {"inputs": tf.strings.join(["wsc:", marked], separator=" "), "targets": tf.gather(x["candidates"], x["label"])}


class WscSource(LocalOrTfdsSource):
  """WSC whose train split holds only rows whose candidate is the pronoun's referent (label True), as T5's
  ``super_glue_wsc_v102_simple_train``; validation and test keep every row (T5's ``..._simple_eval``)."""

  def get_dataset(
    self,
    split: str = "train",
    shuffle: bool = True,
    seed: int | None = None,
    shard_info: seqio.ShardInfo | None = None,
    **kwargs,
  ):
    ds = super().get_dataset(split, shuffle, seed, shard_info, **kwargs)
    if split == "train":
      ds = ds.filter(lambda x: tf.equal(x["label"], 1))
    return ds

  def num_input_examples(self, split: str) -> int | None:
    if split != "train":
      return super().num_input_examples(split)
    key = (str(self.local_root()), "train:referent")
    if key not in self._counts:
      if self.local_root() is not None:
        self._counts[key] = sum(ex["label"] == 1 for path in self.files(split) for ex in self.reader(path))
      else:  # TFDS: 554 rows, counted once
        self._counts[key] = sum(1 for _ in self.get_dataset("train", shuffle=False).as_numpy_iterator())
    return self._counts[key]


# --- postprocessors (T5's t5/data/postprocessors.py) ------------------------------------------------------------
def _str(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def label_to_class_id(
  output: Any, example=None, is_target: bool = False, *, label_classes: Sequence[str], **unused_kwargs
) -> int:
  """T5's ``string_label_to_class_id``: the label's class id, -1 (counts as wrong) for any other string."""
  del example, is_target
  output = _str(output)
  return label_classes.index(output) if output in label_classes else INVALID


def multirc_postprocess(output: Any, example=None, is_target: bool = False, **unused_kwargs) -> dict:
  """``{"value": class id}``, for a target with ``"group"``: its (paragraph, question) ids."""
  result = {"value": label_to_class_id(output, label_classes=BOOL_LABELS)}
  if is_target:
    # T5 groups by the question id; the release numbers questions across paragraphs, so the pair is the same
    # grouping and stays right for data that numbers questions per paragraph.
    result["group"] = (int(example["idx/paragraph"]), int(example["idx/question"]))
  return result


def record_postprocess(output: Any, example=None, is_target: bool = False, **unused_kwargs) -> dict:
  """Prediction ``{"value": answer}``; target ``{"value": all answers, "group": (passage, query) ids}``."""
  if is_target:
    return {
      "value": [_str(a) for a in example["answers"]],
      "group": (int(example["idx/passage"]), int(example["idx/query"])),
    }
  return {"value": _str(output)}


_WSC_DETERMINERS = frozenset(
  {
    "a",
    "an",
    "few",
    "her",
    "his",
    "each",
    "every",
    "many",
    "much",
    "my",
    "our",
    "some",
    "that",
    "the",
    "their",
    "these",
    "this",
    "those",
    "which",
    "whose",
    "your",
  }
)


def _wsc_clean(text: Any) -> str:
  return " ".join(w for w in _str(text).strip().lower().split(" ") if w not in _WSC_DETERMINERS)


def wsc_postprocess(output: Any, example=None, is_target: bool = False, **unused_kwargs) -> int:
  """T5's ``wsc_simple`` postprocessor: a target is the row's label; a prediction is 1 when it names the
  candidate (lower case, determiners dropped, one side's words a subset of the other's, and a possessive
  "'" on both sides or neither), 0 when not, -1 when empty."""
  if is_target:
    return int(example["label"])
  prediction = _wsc_clean(output)
  if not prediction:
    return INVALID  # an empty prediction must not match a 0 label by accident
  referent = _wsc_clean(example["targets_pretokenized"])
  if ("'" in prediction) != ("'" in referent):
    return 0  # "Bob" does not name "Bob's hat"
  predicted, candidate = set(prediction.split(" ")), set(referent.split(" "))
  return int(predicted <= candidate or candidate <= predicted)


def axg_postprocess(output: Any, example=None, is_target: bool = False, **unused_kwargs):
  """Class id; a target also carries idx and hypothesis, which the gender parity score pairs on."""
  value = label_to_class_id(output, label_classes=RTE_LABELS)
  if is_target:
    return {"value": value, "idx": int(example["idx"]), "hypothesis": _str(example["hypothesis"])}
  return value


# --- the benchmark's score ---------------------------------------------------------------------------------------
# What each task contributes to the SuperGLUE score: the mean of these metrics (tasks/metrics.py's keys).
AVERAGE_METRICS = {
  "boolq": ("accuracy",),
  "cb": ("f1_macro", "accuracy"),
  "copa": ("accuracy",),
  "multirc": ("f1a", "exact_match"),
  "record": ("f1", "em"),
  "rte": ("accuracy",),
  "wic": ("accuracy",),
  "wsc": ("accuracy",),
}
AVERAGE_NAME = "average"  # the score's entry: ``<prefix>average`` (T5's TensorBoard tag super_glue_average)
AVERAGE_METRIC = "score"  # its one metric (the leaderboard's column "Score")


def missing_for_average(scores_by_task: Mapping[str, Mapping[str, float]], prefix: str = PREFIX) -> list[str]:
  """The task names ``<prefix><task>`` the SuperGLUE score needs that ``scores_by_task`` lacks, or has without
  all of the task's ``AVERAGE_METRICS``; [] when the score can be computed."""
  return [
    f"{prefix}{task}"
    for task, keys in AVERAGE_METRICS.items()
    if not all(k in scores_by_task.get(f"{prefix}{task}", {}) for k in keys)
  ]


def super_glue_average(scores_by_task: Mapping[str, Mapping[str, float]], prefix: str = PREFIX) -> float:
  """The SuperGLUE score of ``{task name: {metric: value}}`` (percent, as the metrics): the unweighted mean over
  the 8 tasks BoolQ, CB, COPA, MultiRC, ReCoRD, RTE, WiC and WSC of each task's score, a task with two metrics
  scoring their mean (CB: macro-F1 and accuracy; MultiRC: F1a and exact match; ReCoRD: F1 and EM).

  This is the leaderboard's "Score" (Wang et al. 2019's scoring: every task weighted equally, a task with several
  metrics first averaged into one task score; the leaderboard's published rows reproduce from their task scores,
  tests/test_tasks_super_glue.py) and T5's "Average SuperGLUE Score" (t5/evaluation/eval_utils.py
  compute_avg_glue: the SGLUE Average column of Raffel et al. 2020's Table 14). The diagnostics AX-b (Matthews
  corr.) and AX-g are reported beside it, not averaged in; DPR, a training task of T5's mixture, is not part of
  it (T5's WSC score is its WSC task's accuracy alone). Like T5's, the score needs every task: a missing task (or
  metric) raises ValueError naming them rather than averaging the rest (``missing_for_average`` says which)."""
  missing = missing_for_average(scores_by_task, prefix)
  if missing:
    raise ValueError(
      f"the SuperGLUE average needs all of {[prefix + t for t in AVERAGE_METRICS]} with their "
      f"metrics ({AVERAGE_METRICS}); missing or incomplete: {missing}"
    )
  task_scores = [
    sum(float(scores_by_task[f"{prefix}{task}"][k]) for k in keys) / len(keys) for task, keys in AVERAGE_METRICS.items()
  ]
  return sum(task_scores) / len(task_scores)


def average_entries(scores_by_task: Mapping[str, Mapping[str, float]]) -> tuple[dict[str, dict[str, float]], list[str]]:
  """The SuperGLUE scores of an evaluation's results: ``({"<prefix>average": {"score": value}}, notes)`` for
  each task prefix whose SuperGLUE tasks were scored, a note (and no score) for a prefix that lacks some of the
  tasks the score needs. A prefix counts when a task only SuperGLUE has (all but RTE, which GLUE also names
  ``<prefix>rte``) is among the results; results without one give ``({}, [])``. Tasks evaluated in another
  vocabulary are copies named ``<task>#<vocabulary tag>`` (remixer_t5.tasks.lookup): each tag's copies are
  averaged together, as ``<prefix>average#<tag>``."""
  distinctive = [t for t in AVERAGE_METRICS if t != "rte"]
  groups: dict[tuple[str, str], dict[str, Mapping[str, float]]] = {}
  for name in scores_by_task:
    base, hash_, tag = name.partition("#")
    for task in distinctive:
      if base.endswith(task):
        groups[(base[: -len(task)], hash_ + tag)] = {}
  for (prefix, suffix), view in groups.items():  # the results of one vocabulary, by their tasks' own names
    view.update(
      {
        name[: len(name) - len(suffix)]: scores
        for name, scores in scores_by_task.items()
        if "".join(name.partition("#")[1:]) == suffix
      }
    )
  entries, notes = {}, []
  for (prefix, suffix), view in sorted(groups.items()):
    missing = missing_for_average(view, prefix)
    if missing:
      notes.append(
        f"SuperGLUE average ({prefix}{AVERAGE_NAME}{suffix}) not reported: it needs all 8 tasks, and "
        f"these were not scored (or lack a metric): {', '.join(m + suffix for m in missing)}"
      )
    else:
      entries[f"{prefix}{AVERAGE_NAME}{suffix}"] = {AVERAGE_METRIC: super_glue_average(view, prefix)}
  return entries, notes


# --- the tasks --------------------------------------------------------------------------------------------------
def _specs() -> dict[str, dict]:
  """Per task: where its data is, how rows become TFDS features, its T5 format, postprocessor and metrics."""
  label, idx = tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int32)  # TFDS ClassLabel, idx dtypes

  strings = tf.TensorSpec([None], tf.string)

  def text(*names):
    return {n: tf.TensorSpec([], tf.string) for n in names}

  def glue(
    config,
    folder,
    names,
    labels,
    keys,
    *,
    ints=(),
    metric_fns,
    benchmark=None,
    local_files=SPLIT_FILES,
    postprocess_fn=None,
    **kw,
  ):
    return dict(
      tfds_config=config,
      local_dir=f"super_glue/{folder}",
      local_files=local_files,
      reader=_reader(_flat(names, labels, ints)),
      features={**text(*names), **{k: idx for k in ints}, "idx": idx, "label": label},
      preprocessor=functools.partial(text_to_text, prefix=benchmark or config, fields=keys, label_names=labels, **kw),
      postprocess_fn=postprocess_fn or functools.partial(label_to_class_id, label_classes=labels),
      metric_fns=metric_fns,
    )

  def sorted_keys(*names):  # T5's glue sorts the feature names when given none
    return [(n, n) for n in sorted(names)]

  return {
    "boolq": glue(
      "boolq",
      "BoolQ",
      ("question", "passage"),
      BOOL_LABELS,
      sorted_keys("question", "passage"),
      metric_fns=[metrics.accuracy],
    ),
    "cb": glue(
      "cb",
      "CB",
      ("premise", "hypothesis"),
      CB_LABELS,
      sorted_keys("premise", "hypothesis"),
      metric_fns=[metrics.super_glue_cb],
    ),
    "copa": glue(
      "copa",
      "COPA",
      ("premise", "choice1", "choice2", "question"),
      COPA_LABELS,
      sorted_keys("premise", "choice1", "choice2", "question"),
      metric_fns=[metrics.accuracy],
    ),
    "rte": glue(
      "rte",
      "RTE",
      ("premise", "hypothesis"),
      RTE_LABELS,
      sorted_keys("premise", "hypothesis"),
      metric_fns=[metrics.accuracy],
    ),
    "wic": glue(
      "wic",
      "WiC",
      ("word", "sentence1", "sentence2"),
      BOOL_LABELS,
      [(n, n) for n in ("sentence1", "sentence2", "word")],
      ints=("start1", "start2", "end1", "end2"),
      metric_fns=[metrics.accuracy],
    ),
    # The diagnostics, cast as RTE (T5 rekeys AX-b's sentence1/sentence2 to premise/hypothesis).
    "axb": glue(
      "axb",
      "AX-b",
      ("sentence1", "sentence2"),
      RTE_LABELS,
      [("hypothesis", "sentence2"), ("premise", "sentence1")],
      benchmark="rte",
      local_files={"test": "AX-b.jsonl"},
      metric_fns=[metrics.matthews_corrcoef],
    ),
    "axg": glue(
      "axg",
      "AX-g",
      ("premise", "hypothesis"),
      RTE_LABELS,
      sorted_keys("premise", "hypothesis"),
      benchmark="rte",
      passthrough=("hypothesis",),
      local_files={"test": "AX-g.jsonl"},
      metric_fns=[metrics.super_glue_axg],
      postprocess_fn=axg_postprocess,
    ),  # targets carry what gender parity pairs on
    "multirc": dict(
      tfds_config="multirc",
      local_dir="super_glue/MultiRC",
      local_files=SPLIT_FILES,
      reader=_reader(_multirc, required=("idx", "passage")),
      features={
        **text("paragraph", "question", "answer"),
        "label": label,
        "idx": {"paragraph": idx, "question": idx, "answer": idx},
      },
      preprocessor=functools.partial(
        text_to_text,
        prefix="multirc",
        fields=[(n, n) for n in ("question", "answer", "paragraph")],
        label_names=BOOL_LABELS,
        strip_html=True,
      ),
      postprocess_fn=multirc_postprocess,
      metric_fns=[metrics.super_glue_multirc],
    ),
    "record": dict(
      tfds_config="record",
      local_dir="super_glue/ReCoRD",
      local_files=SPLIT_FILES,
      reader=_reader(_record, required=("idx", "passage", "qas")),
      features={
        **text("passage", "query"),
        "entities": strings,
        "answers": strings,
        "idx": {"passage": idx, "query": idx},
      },
      preprocessor=record_format,
      postprocess_fn=record_postprocess,
      metric_fns=[metrics.super_glue_record],
    ),
    "wsc": dict(
      tfds_config="wsc.fixed",
      local_dir="super_glue/WSC",
      local_files=SPLIT_FILES,
      reader=_reader(_wsc, required=("text", "target", "idx")),
      features={
        **text("text", "span1_text", "span2_text"),
        "span1_index": idx,
        "span2_index": idx,
        "idx": idx,
        "label": label,
      },
      preprocessor=wsc_simple_format,
      postprocess_fn=wsc_postprocess,
      metric_fns=[metrics.accuracy],
      source_cls=WscSource,
    ),
    # T5's dpr_v001_simple: no postprocessor, accuracy of the decoded string against the candidate.
    # candidates: TFDS's Sequence(length=2) is [2]; the reader gives exactly 2 ([None]: rows_dataset's form).
    DPR: dict(
      tfds_name=DPR_TFDS_NAME,
      local_dir=DPR_LOCAL_DIR,
      local_files=DPR_SPLIT_FILES,
      reader=read_dpr,
      features={**text("sentence", "pronoun"), "candidates": strings, "label": label},
      preprocessor=dpr_simple_format,
      postprocess_fn=None,
      metric_fns=[metrics.accuracy],
    ),
  }


def dpr_task_name(prefix: str = PREFIX) -> str:
  """DPR's task name: ``dpr`` beside the ``super_glue_`` tasks, ``<prefix>dpr`` beside another prefix's."""
  return DPR if prefix == PREFIX else f"{prefix}{DPR}"


def mixture_rates(prefix: str = PREFIX, maximum: float | None = None) -> dict[str, float]:
  """Task name -> rate of ``<prefix>proportional``: T5's fixed counts (``MIXTURE_RATES``), each capped at
  ``maximum`` when given. No data is read."""
  if maximum is not None and not maximum > 0:
    raise ValueError(f"maximum must be a positive number of examples or None, got {maximum!r}")
  cap = float("inf") if maximum is None else float(maximum)
  return {
    (dpr_task_name(prefix) if task == DPR else f"{prefix}{task}"): min(rate, cap)
    for task, rate in MIXTURE_RATES.items()
  }


def register_super_glue_tasks(vocabulary=None, prefix: str = PREFIX, *, maximum: float | None = None) -> list[str]:
  """Registers the 10 SuperGLUE tasks ``<prefix><task>``, DPR (``dpr_task_name(prefix)``) and the mixture
  ``<prefix>proportional``; returns their names (SuperGLUE tasks, DPR, the mixture). Idempotent with an equal
  vocabulary (ValueError with another).

  ``vocabulary``: a seqio.Vocabulary, a SentencePiece model path, or None (T5's, lazy). ``maximum``: cap each of the
  mixture's rates (``MIXTURE_RATES``; T5's mixture has none, hence None)."""
  vocabulary = as_vocabulary(vocabulary)
  specs, names = _specs(), []
  for task in TRAIN_TASKS + DIAGNOSTIC_TASKS + (DPR,):
    s = specs[task]
    source = s.get("source_cls", LocalOrTfdsSource)(
      local_dir=s["local_dir"],
      local_files=s["local_files"],
      reader=s["reader"],
      features=s["features"],
      tfds_name=s.get("tfds_name") or f"super_glue/{s['tfds_config']}:{TFDS_VERSION}",
    )
    names.append(
      add_task(
        dpr_task_name(prefix) if task == DPR else f"{prefix}{task}",
        source,
        [s["preprocessor"]],
        s["postprocess_fn"],
        s["metric_fns"],
        vocabulary,
      )
    )
  mixture = f"{prefix}proportional"
  rates = mixture_rates(prefix, maximum)
  if mixture in seqio.MixtureRegistry.names():
    existing = dict(seqio.MixtureRegistry.get(mixture).rate_per_task_name)
    if existing != rates:
      raise ValueError(
        f"Mixture {mixture!r} is already registered with other tasks or rates "
        f"({existing}), not {rates} (T5's counts, maximum={maximum!r})."
      )
  else:
    seqio.MixtureRegistry.add(mixture, list(rates.items()))
  return names + [mixture]


register_super_glue_tasks()
