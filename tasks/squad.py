"""SQuAD v1.1 as T5's ``squad_v010_allanswers`` seqio task, named ``squad``.

Format (T5's ``preprocessors.squad``): spaces around every ASCII punctuation mark in question, context and answers (runs
of whitespace collapsed), inputs ``question: <question> context: <context>``, target the first answer. The padded
answers travel with each example as ``answers``; the postprocessor hands them to ``metrics.squad`` as the targets, which
scores a prediction by EM/F1 against each and keeps the best (the official v1.1 evaluation; its normalisation drops the
punctuation again). Leading/trailing spaces the padding leaves are stripped (T5 left them; tokenization ignores them).

Data: TFDS ``squad/v1.1:3.0.0``, or the official nested JSON ``<data dir>/squad/{train,dev}-v1.1.json``
(``data[].paragraphs[].qas[]``) converted to TFDS's features: id, title, context, question,
answers {text, answer_start}; a question id seen twice gets the answers of both, as TFDS does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import seqio
import tensorflow as tf
from remixer_t5.tasks import metrics
from remixer_t5.tasks.common import add_task
from remixer_t5.tasks.sources import LocalOrTfdsSource

TASK_NAME = "squad"
TFDS_NAME = "squad/v1.1:3.0.0"  # tensorflow_datasets 4.9.10


def _get(obj: Any, key: str, kind: type, where: str):
  if not isinstance(obj, dict) or key not in obj:
    raise ValueError(f"{where}: missing field {key!r}")
  value = obj[key]
  if not isinstance(value, kind) or isinstance(value, bool):
    raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}: {str(value)[:80]!r}")
  return value


def read_squad_json(path: str) -> Iterator[dict]:
  """Questions of an official SQuAD v1.1 JSON file in TFDS's layout. Errors name the file and the line/column
  (malformed JSON) or the JSON path of the bad entry (the official files are one line long)."""
  with tf.io.gfile.GFile(path, "rb") as f:
    text = f.read().decode("utf-8-sig")
  try:
    root = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}:{e.colno}: malformed JSON ({e.msg})") from None
  questions: dict[str, dict] = {}
  for i, article in enumerate(_get(root, "data", list, path)):
    where = f"{path}: data[{i}]"
    title = article.get("title", "") if isinstance(article, dict) else ""
    for j, paragraph in enumerate(_get(article, "paragraphs", list, where)):
      context = _get(paragraph, "context", str, f"{where}.paragraphs[{j}]")
      for k, qa in enumerate(_get(paragraph, "qas", list, f"{where}.paragraphs[{j}]")):
        at = f"{where}.paragraphs[{j}].qas[{k}]"
        qid, question = _get(qa, "id", str, at), _get(qa, "question", str, at)
        answers = _get(qa, "answers", list, at)
        if not answers:
          raise ValueError(f"{at} (id {qid}): no answers (every SQuAD v1.1 question has one)")
        texts = [_get(a, "text", str, f"{at}.answers[{n}]") for n, a in enumerate(answers)]
        starts = [_get(a, "answer_start", int, f"{at}.answers[{n}]") for n, a in enumerate(answers)]
        if qid in questions:
          questions[qid]["answers"]["text"] += texts
          questions[qid]["answers"]["answer_start"] += starts
        else:
          questions[qid] = {
            "id": qid,
            "title": title,
            "context": context,
            "question": question,
            "answers": {"text": texts, "answer_start": starts},
          }
  yield from questions.values()


def squad_source() -> LocalOrTfdsSource:
  s = tf.TensorSpec([], tf.string)
  return LocalOrTfdsSource(
    local_dir="squad",
    local_files={"train": "train-v1.1.json", "validation": "dev-v1.1.json"},
    reader=read_squad_json,
    tfds_name=TFDS_NAME,
    features={
      "id": s,
      "title": s,
      "context": s,
      "question": s,
      "answers": {"text": tf.TensorSpec([None], tf.string), "answer_start": tf.TensorSpec([None], tf.int32)},
    },
  )


def pad_punctuation(text):
  """T5's ``_pad_punctuation``: a space on each side of every ASCII punctuation mark, whitespace runs -> one space
  (and, here, stripped)."""
  text = tf.strings.regex_replace(text, r"([[:punct:]])", r" \1 ")
  return tf.strings.strip(tf.strings.regex_replace(text, r"\s+", " "))


@seqio.map_over_dataset
def squad_text(x):
  """``question: <q> context: <c>`` -> the first answer; ``answers`` (all, padded) kept for the metric."""
  answers = pad_punctuation(x["answers"]["text"])
  question, context = pad_punctuation(x["question"]), pad_punctuation(x["context"])
  return {
    "inputs": tf.strings.join(["question:", question, "context:", context], separator=" "),
    "targets": answers[0],
    "id": x["id"],
    "question": question,
    "context": context,
    "answers": answers,
  }


def squad_postprocess(output, example=None, is_target=False, **unused):
  """T5's ``qa`` postprocessor: a target becomes the example's list of answers; a prediction stays a string."""
  del unused
  if is_target and example is not None and "answers" in example:
    return [a.decode("utf-8") if isinstance(a, bytes) else str(a) for a in list(example["answers"])]
  return output.decode("utf-8") if isinstance(output, bytes) else output


def register_squad_task(name: str = TASK_NAME, vocabulary=None) -> str:
  """Registers SQuAD v1.1 as ``name``; idempotent (ValueError for another vocabulary under the same name)."""
  return add_task(name, squad_source(), [squad_text], squad_postprocess, (metrics.squad,), vocabulary)


register_squad_task()
