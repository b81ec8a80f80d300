"""Metric functions for remixer_t5's seqio tasks (for now: COGS).

seqio calls a metric function as ``fn(targets, predictions)`` where
``targets`` are the task's postprocessed targets and ``predictions`` the
postprocessed model outputs. For COGS the task's ``postprocess_fn``
(``cogs_postprocess``) turns each *target* into ``{"target": str,
"category": str}`` using the full example seqio passes with
``is_target=True``, so ``cogs_accuracy`` can report accuracy per category;
predictions stay plain strings.

Strings are compared after whitespace normalisation (``" ".join(s.split())``),
so a SentencePiece round trip that only changes spacing still matches.
All values are percentages (0-100).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence


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
    """``{"exact_match": 100 * mean(target == prediction)}``; 0.0 for no examples.

    A target may be a string or a ``{"target": str, ...}`` dict (as COGS' targets are).
    """
    _check_lengths(targets, predictions)
    if not targets:
        return {"exact_match": 0.0}
    hits = sum(_text(t) == _text(p) for t, p in zip(targets, predictions))
    return {"exact_match": 100.0 * hits / len(targets)}


def cogs_accuracy(targets: Sequence[Mapping[str, str]], predictions: Sequence[str]) -> dict[str, float]:
    """COGS exact match overall (``exact_match``) and per category (``accuracy_<category>``).

    ``targets``: ``{"target": str, "category": str}`` dicts (``cogs_postprocess``
    with ``is_target=True``); a plain-string target counts only in the overall score.
    """
    _check_lengths(targets, predictions)
    result = exact_match(targets, predictions)
    hits: dict[str, int] = defaultdict(int)
    totals: dict[str, int] = defaultdict(int)
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


def cogs_postprocess(output: Any, example: Mapping[str, Any] | None = None,
                     is_target: bool = False, **unused_kwargs) -> Any:
    """seqio ``postprocess_fn`` for COGS.

    Targets (``is_target=True`` with the example) become
    ``{"target": str, "category": str}``; predictions (and targets without an
    example) stay plain strings.
    """
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
