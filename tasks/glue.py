"""GLUE as T5's text-to-text seqio tasks (T5: t5/data/glue_utils.py, preprocessors.glue/stsb, tasks.py glue_*_v002).

Tasks ``glue_<benchmark>`` for cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli, plus ``glue_mnli_matched`` and
``glue_mnli_mismatched`` (MNLI's two validation/test halves as ``validation``/``test``: what an evaluator scores, as
T5 did), and the mixture ``glue_proportional`` (T5's ``glue_v002_proportional``: rates = training set sizes, WNLI
left out as T5 did, the MNLI halves at rate 0 so they are evaluated but never trained on).

Text format (T5's ``glue`` preprocessor): the benchmark name, then ``<feature>: <text>`` for each text feature in
sorted order, e.g. ``mnli hypothesis: ... premise: ...``; the target is the label's TFDS class name
(``acceptable``, ``not_entailment``, ...), ``<unk>`` for unlabeled test rows. STS-B's target is the score rounded to
a multiple of 0.2, written with one decimal (``"3.4"``; ``"-1.0"`` for unlabeled test rows). Postprocessing maps a
decoded string back to the class id (-1, i.e. wrong, for anything else) or to a float (-1.0 when it does not parse).

Data: TFDS ``glue/<config>:2.0.0``, or the GLUE release under ``<data dir>/glue/<Folder>/{train,dev,test}.tsv``
(MNLI: ``dev_matched.tsv`` etc.), read with ``csv.QUOTE_NONE`` as TFDS does. CoLA's train/dev files have no header
(source, label, original label, sentence); every other file has one. Rows become TFDS features (``label`` class
id, or -1 in test files; ``idx`` the row's position in its file).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import seqio
import tensorflow as tf
from remixer_t5.tasks import metrics
from remixer_t5.tasks.common import add_task, as_vocabulary
from remixer_t5.tasks.sources import LocalOrTfdsSource, read_tsv

TFDS_VERSION = "2.0.0"  # tensorflow_datasets 4.9.10's glue version
MIXTURE_NAME = "glue_proportional"
COLA_NO_HEADER_FILES = ("train.tsv", "dev.tsv")
COLA_COLUMNS = ("source", "is_acceptable", "original_label", "sentence")


# --- metrics and postprocessors -------------------------------------------------------------------------------
def f1_with_invalid(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
  """T5's ``f1_score_with_invalid``: binary F1 (class 1) where a prediction other than 0/1 is turned into the
  wrong class, so an invalid output on a negative example counts as a false positive (the generic
  ``metrics.f1_binary`` would count it as a true negative)."""
  metrics._check_lengths(targets, predictions)
  fixed = [p if p in (0, 1) else 1 - t for t, p in zip(targets, predictions)]
  return metrics.f1_binary(targets, fixed, positive=1)


def string_label_to_class_id(output: Any, label_classes: Sequence[str], example=None, is_target=False, **unused) -> int:
  """T5's postprocessor: the index of the decoded string in ``label_classes``, -1 for any other string."""
  del example, is_target, unused
  text = metrics._text(output)
  return list(label_classes).index(text) if text in label_classes else -1


def string_to_float(output: Any, example=None, is_target=False, **unused) -> float:
  """T5's postprocessor for STS-B: the decoded string as a float, -1.0 when it is not a finite number."""
  del example, is_target, unused
  try:
    value = float(metrics._text(output))
  except ValueError:
    return -1.0
  return value if math.isfinite(value) else -1.0


# --- text-to-text preprocessors -------------------------------------------------------------------------------
@seqio.map_over_dataset
def text_to_text(
  x,
  prefix: str,
  fields: Sequence[tuple[str, str]],
  label_names: Sequence[str],
  *,
  strip_html: bool = False,
  passthrough: Sequence[str] = (),
):
  """``"<prefix> <name>: <x[key]> ..."`` -> the label's name (``<unk>`` for label -1), as T5's ``glue``.

  ``fields``: (name shown in the text, feature key) pairs in order. ``idx`` is kept when the example has one
  (MultiRC's nested one flattened as ``idx/<part>``), and the ``passthrough`` features; ``strip_html`` drops
  MultiRC's ``<br>`` and ``<b>`` markup from the inputs."""
  parts = [prefix]
  for shown, key in fields:
    parts += [f"{shown}:", x[key]]
  inputs = tf.strings.join(parts, separator=" ")
  if strip_html:
    inputs = tf.strings.regex_replace(tf.strings.regex_replace(inputs, "<br>", " "), "<(/)?b>", "")
  label = tf.cast(x["label"], tf.int32)
  names = tf.constant(list(label_names))
  targets = tf.cond(label < 0, lambda: tf.constant("<unk>"), lambda: tf.gather(names, label))
  out = {"inputs": inputs, "targets": targets, **{k: x[k] for k in passthrough}}
  if isinstance(x.get("idx"), Mapping):
    out.update({f"idx/{k}": v for k, v in x["idx"].items()})
  elif "idx" in x:
    out["idx"] = x["idx"]
  return out


@seqio.map_over_dataset
def stsb_text(x):
  """T5's ``stsb``: ``stsb sentence1: ... sentence2: ...`` -> the score rounded to 0.2 (TF's round half to even),
  one decimal."""
  inputs = tf.strings.join(["stsb sentence1:", x["sentence1"], "sentence2:", x["sentence2"]], separator=" ")
  targets = tf.as_string(tf.round(x["label"] * 5) / 5, precision=1)
  return {"inputs": inputs, "targets": targets, "idx": x["idx"]}


# --- the benchmarks -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One GLUE dataset: TFDS config ``name``, release ``folder``, text features (TFDS name -> release column, in
  T5's sorted order), the label column, class names (None: a float score), metrics, and split -> file."""

  name: str
  folder: str
  fields: Mapping[str, str]
  label_column: str
  label_classes: tuple[str, ...] | None
  metric_fns: tuple[Callable, ...]
  files: Mapping[str, str] = dataclasses.field(
    default_factory=lambda: {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv"}
  )

  def features(self) -> dict:
    spec = {k: tf.TensorSpec([], tf.string) for k in self.fields}
    spec["label"] = tf.TensorSpec([], tf.int64 if self.label_classes else tf.float32)
    spec["idx"] = tf.TensorSpec([], tf.int32)
    return spec

  def preprocessor(self):
    if self.label_classes is None:
      return stsb_text
    # The MNLI halves keep MNLI's prefix ("mnli"), as T5's glue_mnli_(mis)matched_v002 did.
    return functools.partial(
      text_to_text,
      prefix=self.name.split("_")[0],
      fields=tuple((k, k) for k in self.fields),
      label_names=self.label_classes,
    )

  def postprocess_fn(self):
    if self.label_classes is None:
      return string_to_float
    return functools.partial(string_label_to_class_id, label_classes=self.label_classes)


_ACC = (metrics.accuracy,)
_MNLI_FILES = {
  "train": "train.tsv",
  "validation_matched": "dev_matched.tsv",
  "validation_mismatched": "dev_mismatched.tsv",
  "test_matched": "test_matched.tsv",
  "test_mismatched": "test_mismatched.tsv",
}
_NLI3 = ("entailment", "neutral", "contradiction")
BENCHMARKS: dict[str, Benchmark] = {
  b.name: b
  for b in [
    Benchmark(
      "cola",
      "CoLA",
      {"sentence": "sentence"},
      "is_acceptable",
      ("unacceptable", "acceptable"),
      (metrics.matthews_corrcoef,),
    ),
    Benchmark("sst2", "SST-2", {"sentence": "sentence"}, "label", ("negative", "positive"), _ACC),
    Benchmark(
      "mrpc",
      "MRPC",
      {"sentence1": "#1 String", "sentence2": "#2 String"},
      "Quality",
      ("not_equivalent", "equivalent"),
      (f1_with_invalid, metrics.accuracy),
    ),
    Benchmark(
      "qqp",
      "QQP",
      {"question1": "question1", "question2": "question2"},
      "is_duplicate",
      ("not_duplicate", "duplicate"),
      (f1_with_invalid, metrics.accuracy),
    ),
    Benchmark(
      "stsb", "STS-B", {"sentence1": "sentence1", "sentence2": "sentence2"}, "score", None, (metrics.pearson_spearman,)
    ),
    Benchmark(
      "mnli", "MNLI", {"hypothesis": "sentence2", "premise": "sentence1"}, "gold_label", _NLI3, _ACC, _MNLI_FILES
    ),
    Benchmark(
      "mnli_matched",
      "MNLI",
      {"hypothesis": "sentence2", "premise": "sentence1"},
      "gold_label",
      _NLI3,
      _ACC,
      {"validation": "dev_matched.tsv", "test": "test_matched.tsv"},
    ),
    Benchmark(
      "mnli_mismatched",
      "MNLI",
      {"hypothesis": "sentence2", "premise": "sentence1"},
      "gold_label",
      _NLI3,
      _ACC,
      {"validation": "dev_mismatched.tsv", "test": "test_mismatched.tsv"},
    ),
    Benchmark(
      "qnli", "QNLI", {"question": "question", "sentence": "sentence"}, "label", ("entailment", "not_entailment"), _ACC
    ),
    Benchmark(
      "rte",
      "RTE",
      {"sentence1": "sentence1", "sentence2": "sentence2"},
      "label",
      ("entailment", "not_entailment"),
      _ACC,
    ),
    Benchmark(
      "wnli",
      "WNLI",
      {"sentence1": "sentence1", "sentence2": "sentence2"},
      "label",
      ("not_entailment", "entailment"),
      _ACC,
    ),
  ]
}
# TFDS split of each of our splits, where they differ: the MNLI halves read glue/mnli (one TFDS build for all).
TFDS_SPLITS = {
  "mnli_matched": {"validation": "validation_matched", "test": "test_matched"},
  "mnli_mismatched": {"validation": "validation_mismatched", "test": "test_mismatched"},
}
# T5's glue_utils.get_glue_weight_mapping: training examples per task (WNLI omitted, as T5 did).
MIXTURE_RATES = {
  "cola": 8_551.0,
  "sst2": 67_349.0,
  "mrpc": 3_668.0,
  "qqp": 363_849.0,
  "stsb": 5_749.0,
  "mnli": 392_702.0,
  "qnli": 104_743.0,
  "rte": 2_490.0,
  "mnli_matched": 0.0,
  "mnli_mismatched": 0.0,
}


# --- reading the release files --------------------------------------------------------------------------------
def parse_label(benchmark: Benchmark, value: str | None, where: str) -> int | float:
  """A release label as TFDS stores it: class name or its index -> index; STS-B score -> float; None -> -1."""
  if value is None:
    return -1.0 if benchmark.label_classes is None else -1
  if benchmark.label_classes is None:
    try:
      return float(value)
    except ValueError:
      raise ValueError(f"{where}: {benchmark.name} score {value!r} is not a number") from None
  classes = benchmark.label_classes
  if value in classes:
    return classes.index(value)
  if value.isdigit() and int(value) < len(classes):
    return int(value)
  raise ValueError(
    f"{where}: unknown {benchmark.name} label {value!r}; expected one of {list(classes)} or 0..{len(classes) - 1}"
  )


def read_glue_tsv(path: str, benchmark: Benchmark) -> Iterator[dict]:
  """Rows of a GLUE release TSV in TFDS's feature layout (ValueError naming file:line for a bad row)."""
  if benchmark.name == "cola" and os.path.basename(path) in COLA_NO_HEADER_FILES:
    rows = read_tsv(path, COLA_COLUMNS, header=False)
  else:
    rows = read_tsv(path, list(benchmark.fields.values()), header=True)
  for idx, (lineno, row) in enumerate(rows):
    example: dict[str, Any] = {k: row[column] for k, column in benchmark.fields.items()}
    example["label"] = parse_label(benchmark, row.get(benchmark.label_column), f"{path}:{lineno}")
    example["idx"] = idx
    yield example


def glue_source(
  benchmark: Benchmark, files: Mapping[str, str] | None = None, tfds_splits: Mapping[str, str] | None = None
) -> LocalOrTfdsSource:
  """``<data dir>/glue/<Folder>`` or TFDS ``glue/<config>:2.0.0`` (the MNLI halves: ``glue/mnli``)."""
  config = "mnli" if benchmark.folder == "MNLI" else benchmark.name
  return LocalOrTfdsSource(
    local_dir=f"glue/{benchmark.folder}",
    local_files=dict(files or benchmark.files),
    reader=functools.partial(read_glue_tsv, benchmark=benchmark),
    features=benchmark.features(),
    tfds_name=f"glue/{config}:{TFDS_VERSION}",
    tfds_splits=tfds_splits if tfds_splits is not None else TFDS_SPLITS.get(benchmark.name),
  )


# --- registration ---------------------------------------------------------------------------------------------
def register_glue_task(benchmark: str, name: str | None = None, vocabulary=None) -> str:
  """Registers GLUE ``benchmark`` (a key of ``BENCHMARKS``) as ``name`` (default ``glue_<benchmark>``)."""
  b = BENCHMARKS[benchmark]
  return add_task(
    name or f"glue_{benchmark}", glue_source(b), [b.preprocessor()], b.postprocess_fn(), b.metric_fns, vocabulary
  )


def register_glue_tasks(vocabulary=None) -> list[str]:
  """Registers every ``glue_*`` task and the ``glue_proportional`` mixture; idempotent. ``vocabulary``: default
  T5's (lazy); registering again with another one raises ValueError."""
  vocabulary = as_vocabulary(vocabulary)
  names = [register_glue_task(b, vocabulary=vocabulary) for b in BENCHMARKS]
  if MIXTURE_NAME not in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.add(MIXTURE_NAME, [(f"glue_{b}", rate) for b, rate in MIXTURE_RATES.items()])
  return names


register_glue_tasks()
