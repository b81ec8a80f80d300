"""Metric functions for remixer_t5's seqio tasks: the generic scores (accuracy, F1, MCC, correlations,
SQuAD-style EM/F1) and COGS' per-category accuracy. Task-specific groupings (MultiRC, ReCoRD) build on these.

seqio calls a metric function as ``fn(targets, predictions)`` where ``targets`` are the task's postprocessed targets and
``predictions`` the postprocessed model outputs. For COGS the task's ``postprocess_fn`` (``cogs_postprocess``) turns
each *target* into ``{"target": str, "category": str}`` using the full example seqio passes with ``is_target=True``, so
``cogs_accuracy`` can report accuracy per category; predictions stay plain strings.

Strings are compared after whitespace normalisation (``" ".join(s.split())``), so a SentencePiece round trip that
only changes spacing still matches. All values are percentages (0-100).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np


def _text(value: Any) -> str:
  if isinstance(value, Mapping):
    value = value["target"]
  if isinstance(value, bytes):
    value = value.decode("utf-8")
  return " ".join(str(value).split())


def _check_lengths(targets: Sequence, predictions: Sequence) -> None:
  if len(targets) != len(predictions):
    raise ValueError(f"got {len(targets)} targets but {len(predictions)} predictions")


def exact_match(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """``{"exact_match": 100 * mean(target == prediction)}``; 0.0 for no examples. A target may be a string or a
  ``{"target": str, ...}`` dict (as COGS' targets are)."""
  _check_lengths(targets, predictions)
  if not targets:
    return {"exact_match": 0.0}
  hits = sum(_text(t) == _text(p) for t, p in zip(targets, predictions))
  return {"exact_match": 100.0 * hits / len(targets)}


def cogs_accuracy(targets: Sequence[Mapping[str, str]], predictions: Sequence[str]) -> dict[str, float]:
  """COGS exact match overall (``exact_match``) and per category (``accuracy_<category>``). ``targets``:
  ``{"target": str, "category": str}`` dicts (``cogs_postprocess`` with ``is_target=True``); a plain-string
  target counts only in the overall score."""
  _check_lengths(targets, predictions)
  result = exact_match(targets, predictions)
  hits: dict[str, int] = collections.defaultdict(int)
  totals: dict[str, int] = collections.defaultdict(int)
  for target, prediction in zip(targets, predictions):
    if not isinstance(target, Mapping) or "category" not in target:
      continue
    category = target["category"]
    if isinstance(category, bytes):
      category = category.decode("utf-8")
    totals[category] += 1
    hits[category] += _text(target) == _text(prediction)
  for category in sorted(totals):
    result[f"accuracy_{category}"] = 100.0 * hits[category] / totals[category]
  return result


def cogs_postprocess(
  output: Any, example: Mapping[str, Any] | None = None, is_target: bool = False, **unused_kwargs
) -> Any:
  """seqio ``postprocess_fn`` for COGS: targets (``is_target=True`` with the example) become ``{"target": str,
  "category": str}``; predictions (and targets without an example) stay plain strings."""
  if isinstance(output, bytes):
    output = output.decode("utf-8")
  if is_target and example is not None and "category" in example:
    category = example["category"]
    if hasattr(category, "numpy"):
      category = category.numpy()
    if isinstance(category, bytes):
      category = category.decode("utf-8")
    return {"target": output, "category": str(category)}
  return output


# --- generic scores (T5's evaluation metrics, written here) --------------------------------------------------
def accuracy(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """``{"accuracy": 100 * mean(target == prediction)}`` on the values as given (labels or strings)."""
  _check_lengths(targets, predictions)
  if not targets:
    return {"accuracy": 0.0}
  return {"accuracy": 100.0 * float(np.mean([t == p for t, p in zip(targets, predictions)]))}


def _binary_f1(targets: Sequence, predictions: Sequence, positive: Hashable) -> float:
  tp = sum(t == positive and p == positive for t, p in zip(targets, predictions))
  fp = sum(t != positive and p == positive for t, p in zip(targets, predictions))
  fn = sum(t == positive and p != positive for t, p in zip(targets, predictions))
  return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def f1_binary(targets: Sequence, predictions: Sequence, positive: Hashable = 1) -> dict[str, float]:
  """``{"f1": ...}``: F1 of the ``positive`` class (0 when it is never predicted correctly), in percent."""
  _check_lengths(targets, predictions)
  return {"f1": 100.0 * _binary_f1(targets, predictions, positive)}


def f1_macro(targets: Sequence, predictions: Sequence, labels: Sequence | None = None) -> dict[str, float]:
  """``{"f1_macro": ...}``: the unweighted mean of per-class F1 over ``labels`` (default: the classes in
  ``targets``), in percent; a prediction outside ``labels`` counts as wrong."""
  _check_lengths(targets, predictions)
  classes = list(labels) if labels is not None else sorted(set(targets), key=str)
  if not classes:
    return {"f1_macro": 0.0}
  return {"f1_macro": 100.0 * float(np.mean([_binary_f1(targets, predictions, c) for c in classes]))}


def matthews_corrcoef(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """``{"mcc": ...}``: Matthews correlation (multi-class form, Gorodkin 2004), in percent; 0 when undefined."""
  _check_lengths(targets, predictions)
  classes = sorted(set(targets) | set(predictions), key=str)
  index = {c: i for i, c in enumerate(classes)}
  cm = np.zeros((len(classes), len(classes)), np.float64)
  for t, p in zip(targets, predictions):
    cm[index[t], index[p]] += 1
  n, correct = cm.sum(), np.trace(cm)
  true_k, pred_k = cm.sum(axis=1), cm.sum(axis=0)
  cov = correct * n - true_k @ pred_k
  denom = np.sqrt((n * n - pred_k @ pred_k) * (n * n - true_k @ true_k))
  return {"mcc": 0.0 if denom == 0 else 100.0 * float(cov / denom)}


def pearson_spearman(targets: Sequence[float], predictions: Sequence[float]) -> dict[str, float]:
  """``{"pearson": ..., "spearman": ...}`` correlations in percent (0 when a side is constant)."""
  from scipy import stats  # here: 0.6 s and its own BLAS threads, for every run that registers the tasks

  _check_lengths(targets, predictions)
  t, p = np.asarray(targets, np.float64), np.asarray(predictions, np.float64)
  if len(t) < 2 or np.ptp(t) == 0 or np.ptp(p) == 0:
    return {"pearson": 0.0, "spearman": 0.0}
  return {"pearson": 100.0 * float(stats.pearsonr(t, p)[0]), "spearman": 100.0 * float(stats.spearmanr(t, p)[0])}


def normalize_answer(text: str) -> str:
  """SQuAD v1.1's answer normalisation: lower case, no punctuation, no articles, single spaces."""
  text = text.lower()
  text = "".join(ch for ch in text if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return " ".join(text.split())


def _token_f1(target: str, prediction: str) -> float:
  t, p = normalize_answer(target).split(), normalize_answer(prediction).split()
  common = collections.Counter(t) & collections.Counter(p)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(p), same / len(t)
  return 2 * precision * recall / (precision + recall)


def squad(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
  """``{"em": ..., "f1": ...}``: SQuAD v1.1 exact match and token F1, each the max over a question's
  reference answers, averaged over questions, in percent. ``targets``: a list of answers per example."""
  _check_lengths(targets, predictions)
  if not targets:
    return {"em": 0.0, "f1": 0.0}
  em, f1 = [], []
  for answers, prediction in zip(targets, predictions):
    answers = [answers] if isinstance(answers, (str, bytes)) else list(answers)
    answers = [a.decode("utf-8") if isinstance(a, bytes) else a for a in answers]
    if not answers:
      raise ValueError("an example has no reference answer")
    em.append(max(float(normalize_answer(a) == normalize_answer(prediction)) for a in answers))
    f1.append(max(_token_f1(a, prediction) for a in answers))
  return {"em": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f1))}


def mean_group_metric(
  metric: Callable[[Sequence, Sequence], Mapping[str, float]], group_key: str = "group", value_key: str = "value"
) -> Callable:
  """A metric that applies ``metric`` within each group and averages over groups (T5's MultiRC EM).

  Targets and predictions are ``{group_key: id, value_key: label}`` dicts (or predictions plain labels)."""

  def grouped(targets: Sequence[Mapping], predictions: Sequence) -> dict[str, float]:
    _check_lengths(targets, predictions)
    groups: dict[Any, tuple[list, list]] = collections.OrderedDict()
    for t, p in zip(targets, predictions):
      g = groups.setdefault(t[group_key], ([], []))
      g[0].append(t[value_key])
      g[1].append(p[value_key] if isinstance(p, Mapping) else p)
    scores = collections.defaultdict(list)
    for ts, ps in groups.values():
      for k, v in metric(ts, ps).items():
        scores[k].append(v)
    return {k: float(np.mean(v)) for k, v in scores.items()}

  return grouped


# --- SuperGLUE (T5's t5/data/glue_utils.py SUPERGLUE_METRICS and t5/evaluation/metrics.py, written here) -----
# Labels are class ids from the tasks' postprocessors; -1 (a prediction naming no class) is always wrong.
def _sg_value(x: Any) -> Any:
  return x["value"] if isinstance(x, Mapping) else x


def super_glue_cb(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
  """CommitmentBank: ``f1_macro`` (unweighted mean F1 of the 3 classes, T5's mean_multiclass_f1) and ``accuracy``."""
  return {**f1_macro(targets, predictions, labels=(0, 1, 2)), **accuracy(targets, predictions)}


def _sg_all_match(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  return {"exact_match": 100.0 * float(list(targets) == list(predictions))}


def super_glue_multirc(targets: Sequence[Mapping], predictions: Sequence) -> dict[str, float]:
  """MultiRC: ``f1a``, F1 of the True class over all answer options (T5's f1_score_with_invalid: an invalid
  prediction counts as the wrong class), and ``exact_match``, the share of questions with every option right,
  averaged over questions (T5's mean_group_metric(all_match)). Targets ``{"value", "group"}``."""
  _check_lengths(targets, predictions)
  gold = [_sg_value(t) for t in targets]
  pred = [_sg_value(p) if _sg_value(p) in (0, 1) else 1 - g for g, p in zip(gold, predictions)]
  return {
    "f1a": 100.0 * _binary_f1(gold, pred, 1),
    **mean_group_metric(_sg_all_match)(targets, [_sg_value(p) for p in predictions]),
  }


def super_glue_record(targets: Sequence[Mapping], predictions: Sequence) -> dict[str, float]:
  """ReCoRD: SQuAD ``em`` / ``f1`` max over a query's answers, each query once (its per-answer copies share a
  ``group``: T5's deduplicate_metric(squad)). Targets ``{"value": answers, "group"}``."""
  _check_lengths(targets, predictions)
  seen, answers, guesses = set(), [], []
  for target, prediction in zip(targets, predictions):
    if target["group"] in seen:
      continue
    seen.add(target["group"])
    answers.append(target["value"])
    guesses.append(_sg_value(prediction))
  return squad(answers, guesses)


def super_glue_axg(targets: Sequence, predictions: Sequence) -> dict[str, float]:
  """Winogender diagnostic: ``accuracy`` and ``gender_parity``, the share of minimal pairs (the examples idx
  2k and 2k+1, as the release orders them and jiant's GenderParity reads them; the same hypothesis, the
  premise's pronoun male vs female) whose two predictions agree. Pairs cut by a subsample are left out;
  parity needs targets ``{"value", "idx", "hypothesis"}``."""
  _check_lengths(targets, predictions)
  result = accuracy([_sg_value(t) for t in targets], [_sg_value(p) for p in predictions])
  pairs: dict[int, list] = collections.defaultdict(list)
  for target, prediction in zip(targets, predictions):
    if isinstance(target, Mapping) and "idx" in target:
      pairs[target["idx"] // 2].append((target.get("hypothesis"), _sg_value(prediction)))
  same = total = 0
  for key, members in sorted(pairs.items()):
    if len(members) != 2:
      continue
    if members[0][0] != members[1][0]:
      raise ValueError(
        f"AX-g examples idx {2 * key} and {2 * key + 1} have different hypotheses "
        f"({members[0][0]!r} vs {members[1][0]!r}): they are not a minimal pair"
      )
    total += 1
    same += members[0][1] == members[1][1]
  if total:
    result["gender_parity"] = 100.0 * same / total
  return result
