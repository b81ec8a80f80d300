"""NLI seqio tasks in T5's text-to-text format: ``mnli``, ``anli_r1``..``anli_r3``, ``conjnli``, ``abductive_nli``,
``qnli``; all scored by accuracy, a decoded string that is no label counting as wrong.

Inputs ``"<name> hypothesis: <hypothesis> premise: <premise>"`` (T5's ``glue`` layout; tasks/glue.py's
preprocessor) -> ``entailment`` / ``neutral`` / ``contradiction``; QNLI is GLUE's (``qnli question: ... sentence:
...`` -> ``entailment`` / ``not_entailment``); αNLI: ``"abductive_nli observation1: ... observation2: ...
hypothesis1: ... hypothesis2: ..."`` -> ``1`` / ``2`` (the more plausible hypothesis).

``mnli`` is a seqio Mixture of ``mnli_matched`` (MNLI train; validation/test = the matched halves) and
``mnli_mismatched`` (validation/test = the mismatched halves, no train split). Training on ``mnli`` reads MNLI
train once (seqio skips a mixture member that lacks the split), and an Evaluator on ``mnli`` scores every member
with a ``validation`` split and metrics: matched and mismatched accuracy, reported per task.

Data (``<data dir>`` = ``$REMIXER_T5_DATA_DIR`` or the ``data_dir`` binding), else TFDS where it has the dataset:
  mnli, qnli: ``glue/MNLI``, ``glue/QNLI`` (see tasks/glue.py) or TFDS ``glue/mnli``, ``glue/qnli`` 2.0.0.
  anli_rN: ``anli/RN/{train,dev,test}.jsonl`` of the anli_v1.0 release (uid, context, hypothesis, label e|n|c)
    or TFDS ``anli/rN:0.1.0``; validation = dev.
  conjnli: ``conjnli/adversarial_train_15k.tsv`` (train) and ``conjnli/conj_dev.tsv`` (validation), TSV with a
    BOM and header ``Premise Hypothesis Label``; TFDS has no ConjNLI.
  abductive_nli: ``alphanli/{train,dev}.jsonl`` (obs1, obs2, hyp1, hyp2) with the line-aligned
    ``{train,dev}-labels.lst`` (1 or 2); tensorflow_datasets 4.9.10 has no ``art``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import seqio
import tensorflow as tf
from remixer_t5.tasks import glue, metrics
from remixer_t5.tasks.common import add_task, as_vocabulary
from remixer_t5.tasks.sources import LocalOrTfdsSource, read_jsonl, read_tsv

ANLI_TFDS_VERSION = "0.1.0"  # tensorflow_datasets 4.9.10
NLI_LABELS = ("entailment", "neutral", "contradiction")  # TFDS's class order for MNLI and ANLI (e, n, c)
ANLI_LABELS = {"e": 0, "n": 1, "c": 2}
ABDUCTIVE_LABELS = ("1", "2")
MNLI = "mnli"


def _spec(**dtypes):
  return {k: tf.TensorSpec([], getattr(tf, v)) for k, v in dtypes.items()}


def nli_preprocessor(prefix: str, premise_key: str = "premise"):
  """``<prefix> hypothesis: ... premise: ...`` -> entailment/neutral/contradiction."""
  return functools.partial(
    glue.text_to_text,
    prefix=prefix,
    fields=(("hypothesis", "hypothesis"), ("premise", premise_key)),
    label_names=NLI_LABELS,
  )


_NLI_POSTPROCESS = functools.partial(glue.string_label_to_class_id, label_classes=NLI_LABELS)


# --- readers: release rows -> TFDS-like features --------------------------------------------------------------
def read_anli(path: str) -> Iterator[dict]:
  """anli_v1.0 jsonl rows as TFDS ``anli`` features (label e/n/c -> 0/1/2)."""
  for lineno, row in read_jsonl(path, required=("uid", "context", "hypothesis", "label")):
    label = row["label"]
    if label not in ANLI_LABELS:
      raise ValueError(f"{path}:{lineno}: unknown ANLI label {label!r}; expected one of {list(ANLI_LABELS)}")
    yield {
      "uid": str(row["uid"]),
      "context": row["context"],
      "hypothesis": row["hypothesis"],
      "label": ANLI_LABELS[label],
    }


def read_conjnli(path: str) -> Iterator[dict]:
  """ConjNLI TSV rows (Premise, Hypothesis, Label word) as premise/hypothesis/label id."""
  for lineno, row in read_tsv(path, ("Premise", "Hypothesis", "Label")):
    label = row["Label"].strip()
    if label not in NLI_LABELS:
      raise ValueError(f"{path}:{lineno}: unknown ConjNLI label {label!r}; expected one of {list(NLI_LABELS)}")
    yield {"premise": row["Premise"], "hypothesis": row["Hypothesis"], "label": NLI_LABELS.index(label)}


def alphanli_labels_path(path: str) -> str:
  """``train.jsonl`` -> ``train-labels.lst`` (the αNLI release's naming)."""
  return re.sub(r"\.jsonl$", "", path) + "-labels.lst"


def read_alphanli(path: str) -> Iterator[dict]:
  """αNLI jsonl rows joined with the line-aligned labels file; label 1 or 2 as in the release."""
  labels_path = alphanli_labels_path(path)
  if not tf.io.gfile.exists(labels_path):
    raise FileNotFoundError(
      f"{path}: its labels file {labels_path} is missing (the αNLI release ships <split>.jsonl with <split>-labels.lst)"
    )
  labels = list(read_tsv(labels_path, ("label",), header=False))
  rows = list(read_jsonl(path, required=("obs1", "obs2", "hyp1", "hyp2")))
  if len(labels) != len(rows):
    raise ValueError(
      f"{labels_path}: {len(labels)} labels for the {len(rows)} rows of {path}; the files must be line-aligned"
    )
  for (_, row), (label_line, label) in zip(rows, labels):
    value = label["label"].strip()
    if value not in ABDUCTIVE_LABELS:
      raise ValueError(f"{labels_path}:{label_line}: unknown αNLI label {value!r}; expected 1 or 2")
    yield {
      "observation_1": row["obs1"],
      "observation_2": row["obs2"],
      "hypothesis_1": row["hyp1"],
      "hypothesis_2": row["hyp2"],
      "label": int(value),
    }


@seqio.map_over_dataset
def abductive_text(x):
  """``abductive_nli observation1: ... observation2: ... hypothesis1: ... hypothesis2: ...`` -> ``1``/``2``."""
  parts = ["abductive_nli"]
  for shown, key in (
    ("observation1", "observation_1"),
    ("observation2", "observation_2"),
    ("hypothesis1", "hypothesis_1"),
    ("hypothesis2", "hypothesis_2"),
  ):
    parts += [f"{shown}:", x[key]]
  return {"inputs": tf.strings.join(parts, separator=" "), "targets": tf.as_string(x["label"])}


def abductive_postprocess(output, example=None, is_target=False, **unused) -> int:
  """``"1"``/``"2"`` -> 1/2; any other string -> -1 (wrong)."""
  del example, is_target, unused
  text = metrics._text(output)
  return int(text) if text in ABDUCTIVE_LABELS else -1


# --- sources --------------------------------------------------------------------------------------------------
def mnli_sources() -> dict[str, LocalOrTfdsSource]:
  """``mnli_matched`` (train + matched halves) and ``mnli_mismatched`` (mismatched halves) over glue/MNLI."""
  b, splits = glue.BENCHMARKS, glue.TFDS_SPLITS
  return {
    "mnli_matched": glue.glue_source(
      b["mnli"], {"train": "train.tsv", **b["mnli_matched"].files}, splits["mnli_matched"]
    ),
    "mnli_mismatched": glue.glue_source(b["mnli"], b["mnli_mismatched"].files, splits["mnli_mismatched"]),
  }


def anli_source(round_: int) -> LocalOrTfdsSource:
  return LocalOrTfdsSource(
    local_dir=f"anli/R{round_}",
    local_files={"train": "train.jsonl", "validation": "dev.jsonl", "test": "test.jsonl"},
    reader=read_anli,
    features=_spec(uid="string", context="string", hypothesis="string", label="int64"),
    tfds_name=f"anli/r{round_}:{ANLI_TFDS_VERSION}",
  )


def conjnli_source() -> LocalOrTfdsSource:
  return LocalOrTfdsSource(
    local_dir="conjnli",
    local_files={"train": "adversarial_train_15k.tsv", "validation": "conj_dev.tsv"},
    reader=read_conjnli,
    features=_spec(premise="string", hypothesis="string", label="int64"),
  )


def abductive_source() -> LocalOrTfdsSource:
  return LocalOrTfdsSource(
    local_dir="alphanli",
    local_files={"train": "train.jsonl", "validation": "dev.jsonl"},
    reader=read_alphanli,
    features=_spec(
      observation_1="string", observation_2="string", hypothesis_1="string", hypothesis_2="string", label="int64"
    ),
  )


# --- registration ---------------------------------------------------------------------------------------------
def register_nli_task(name: str, task_name: str | None = None, vocabulary=None) -> str:
  """Registers NLI task ``name`` (mnli_matched, mnli_mismatched, anli_r1..3, conjnli, abductive_nli, qnli) as
  ``task_name`` (default ``name``); idempotent."""
  post = _NLI_POSTPROCESS
  if name in ("mnli_matched", "mnli_mismatched"):
    source, pre = mnli_sources()[name], nli_preprocessor("mnli")
  elif re.fullmatch(r"anli_r[123]", name):
    source, pre = anli_source(int(name[-1])), nli_preprocessor("anli", premise_key="context")
  elif name == "conjnli":
    source, pre = conjnli_source(), nli_preprocessor("conjnli")
  elif name == "abductive_nli":
    source, pre, post = abductive_source(), abductive_text, abductive_postprocess
  elif name == "qnli":
    b = glue.BENCHMARKS["qnli"]
    source, pre, post = glue.glue_source(b), b.preprocessor(), b.postprocess_fn()
  else:
    raise ValueError(f"unknown NLI task {name!r}")
  return add_task(task_name or name, source, [pre], post, (metrics.accuracy,), vocabulary)


NLI_TASKS = ("mnli_matched", "mnli_mismatched", "anli_r1", "anli_r2", "anli_r3", "conjnli", "abductive_nli", "qnli")


def register_mnli_mixture(name: str = MNLI, matched: str = "mnli_matched", mismatched: str = "mnli_mismatched"):
  """``mnli`` = mnli_matched + mnli_mismatched. The rates only weigh the two halves when a validation/test split of
  the mixture itself is read (e.g. for an eval loss); train data is MNLI train alone either way."""
  if name not in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.add(name, [(matched, 1.0), (mismatched, 1.0)])
  return name


def register_nli_tasks(vocabulary=None) -> list[str]:
  """Registers every NLI task and the ``mnli`` mixture; idempotent (ValueError for another vocabulary)."""
  vocabulary = as_vocabulary(vocabulary)
  names = [register_nli_task(n, vocabulary=vocabulary) for n in NLI_TASKS]
  register_mnli_mixture()
  return names + [MNLI]


register_nli_tasks()
