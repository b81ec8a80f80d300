"""Statistics of a study over seeds: per grid point the mean, sample standard deviation and Student t 95%
interval of each metric; Welch's t-test between the best two points; HyperMixer's one-standard-deviation mark;
and their tables (sweep.csv, sweep.md) and figure (sweep.png).

A study is runs on a grid (learning rates, models, ...) repeated over seeds. `summarize` groups one dict per run
by the grid's columns, `write` puts the result under a folder (local or gs://); `point_metrics` reads the numbers
of one finished run. `remixer-t5 sweep` and `remixer-t5 compare --group_by_seed` write these files.

The t statistic, Welch–Satterthwaite degrees of freedom, means and standard deviations are computed here; the t
distribution's quantile and tail come from scipy.stats.t, which is always installed: jax and jaxlib require scipy.

HyperMixer's mark (Mai et al., "HyperMixer: An MLP-based Low Cost Alternative to Transformers", Table 1
caption: "Results are printed in **bold** font if they exceed the second best result by at least one standard
deviation"): the best point's mean is ahead of the second best's by at least the standard deviation of the best,
the one printed beside the bold result. The paper's numbers do not tell this reading from the others: in four of
Table 1's five validation columns the gap is above both points' deviations, in SST below both (its text: "smaller
than one standard deviation").
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from remixer_t5 import compare, storage
from remixer_t5.training import plots

OUTPUT_FILES = ("sweep.csv", "sweep.md", "sweep.png")
DIRECTIONS = ("min", "max")
# The columns of a row per metric, after the grid's columns and `n`.
STAT_SUFFIXES = ("n", "mean", "std", "ci95_low", "ci95_high")
# Metric names (the part after the last '/') that are better when lower; every other metric is better higher.
_LOWER_IS_BETTER = ("loss", "perplexity", "error")


# --- the numbers -------------------------------------------------------------------------------------------------
def _floats(values: Sequence[float], what: str) -> np.ndarray:
  out = np.asarray([float(v) for v in values], dtype=np.float64)
  bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
  if bad:
    raise ValueError(f"{what}: value {bad[0]} is {out[bad[0]]}; expected finite numbers")
  return out


def t_quantile(q: float, df: float) -> float:
  """The q-quantile of Student's t distribution with `df` degrees of freedom."""
  return float(scipy_stats.t.ppf(q, df))


def describe(values: Sequence[float]) -> dict[str, Any]:
  """{n, mean, std, ci95_low, ci95_high} of `values`: std is the sample standard deviation (ddof=1), the interval
  is Student's t 95% interval of the mean (mean ± t(0.975, n-1) · std / √n). std and the interval are None for
  n < 2; mean is None for n = 0."""
  x = _floats(values, "describe")
  n = len(x)
  out: dict[str, Any] = {
    "n": n,
    "mean": float(x.mean()) if n else None,
    "std": None,
    "ci95_low": None,
    "ci95_high": None,
  }
  if n >= 2:
    std = float(x.std(ddof=1))
    half = t_quantile(0.975, n - 1) * std / math.sqrt(n)
    out.update(std=std, ci95_low=out["mean"] - half, ci95_high=out["mean"] + half)
  return out


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, float | None]:
  """Welch's two-sided t-test of equal means without assuming equal variances: {t, df, p}, t of mean(a) - mean(b)
  over √(va/na + vb/nb) with sample variances, df by Welch–Satterthwaite. All None where the test is undefined:
  a side with fewer than 2 values, or neither side with any spread."""
  x, y = _floats(a, "welch: a"), _floats(b, "welch: b")
  undefined = {"t": None, "df": None, "p": None}
  if len(x) < 2 or len(y) < 2:
    return undefined
  vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
  if vx + vy == 0:
    return undefined
  t = float((x.mean() - y.mean()) / math.sqrt(vx + vy))
  df = float((vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1)))
  return {"t": t, "df": df, "p": float(2 * scipy_stats.t.sf(abs(t), df))}


def hypermixer_mark(best_mean: float, best_std: float | None, second_mean: float) -> bool | None:
  """HyperMixer's bold (module docstring): the best mean is ahead of the second's by at least one standard
  deviation of the best, and by more than nothing (two constant, equal points are not a win). None when the best
  has no standard deviation (one value)."""
  if best_std is None:
    return None
  gap = abs(best_mean - second_mean)
  return bool(gap > 0 and gap >= best_std)


def better(metric: str) -> str:
  """'min' for losses, perplexities and errors (by the name after the last '/'), else 'max'."""
  name = metric.rsplit("/", 1)[-1].lower()
  return "min" if any(word in name for word in _LOWER_IS_BETTER) else "max"


# --- a study ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Summary:
  """A study's statistics.

  by:      the grid's columns, metrics: {metric: 'min'|'max'} (which is better).
  rows:    one per grid point, in the order points first appear: the `by` values, `n` (runs), and per metric
           `<metric>_n` (runs that logged it), `_mean`, `_std`, `_ci95_low`, `_ci95_high`.
  values:  per row, {metric: [(seed, value), ...]}, the runs' own numbers (seed None where a point has none).
  tests:   per metric: `best` and `second` (their `by` values; `second` None with one point), `welch` (t, df, p of
           best against second, or None), `gap` (|mean difference|), `mark` (HyperMixer's, or None).
  best:    per metric, the best point's `by` values (None when no point logged it).
  """

  by: list[str]
  metrics: dict[str, str]
  rows: list[dict[str, Any]]
  values: list[dict[str, list[tuple[Any, float]]]]
  tests: dict[str, dict[str, Any]]
  best: dict[str, dict[str, Any] | None]


def summarize(points: Sequence[Mapping[str, Any]], by: Sequence[str], metrics: Mapping[str, str]) -> Summary:
  """Groups `points` (one dict per run: the grid's values, `seed`, metric values) by their `by` values and
  describes each metric per group (see Summary). A point without a metric, or with None for it, leaves that
  group's metric with fewer values (`<metric>_n`); a non-finite value is an error."""
  by, metrics = list(by), dict(metrics)
  for metric, direction in metrics.items():
    if direction not in DIRECTIONS:
      raise ValueError(f"summarize: metric {metric!r} has direction {direction!r}; expected 'min' or 'max'")
  if not points:
    raise ValueError("summarize: no points; expected one dict per run")
  groups: dict[tuple, list[Mapping[str, Any]]] = {}
  for i, point in enumerate(points):
    missing = [c for c in by if c not in point]
    if missing:
      raise ValueError(f"summarize: point {i} has no {missing[0]!r}; expected every point to carry {by}")
    groups.setdefault(tuple(point[c] for c in by), []).append(point)

  rows, values = [], []
  for key, members in groups.items():
    row: dict[str, Any] = {**dict(zip(by, key)), "n": len(members)}
    seen = {}
    for metric in metrics:
      pairs = [(p.get("seed"), p[metric]) for p in members if p.get(metric) is not None]
      stat = describe([v for _, v in pairs])
      row.update({f"{metric}_{s}": stat[s] for s in STAT_SUFFIXES})
      seen[metric] = [(seed, float(v)) for seed, v in pairs]
    rows.append(row)
    values.append(seen)

  tests, best = {}, {}
  for metric, direction in metrics.items():
    ranked = [i for i in range(len(rows)) if rows[i][f"{metric}_mean"] is not None]
    ranked.sort(key=lambda i: rows[i][f"{metric}_mean"] * (1 if direction == "min" else -1))  # stable: ties keep order
    if not ranked:
      tests[metric], best[metric] = {"best": None, "second": None, "welch": None, "gap": None, "mark": None}, None
      continue
    first = rows[ranked[0]]
    best[metric] = {c: first[c] for c in by}
    test: dict[str, Any] = {"best": best[metric], "second": None, "welch": None, "gap": None, "mark": None}
    if len(ranked) > 1:
      second = rows[ranked[1]]
      test.update(
        second={c: second[c] for c in by},
        welch=welch([v for _, v in values[ranked[0]][metric]], [v for _, v in values[ranked[1]][metric]]),
        gap=abs(first[f"{metric}_mean"] - second[f"{metric}_mean"]),
        mark=hypermixer_mark(first[f"{metric}_mean"], first[f"{metric}_std"], second[f"{metric}_mean"]),
      )
    tests[metric] = test
  return Summary(by=by, metrics=metrics, rows=rows, values=values, tests=tests, best=best)


def point_metrics(model_dir) -> dict[str, float]:
  """A finished run's numbers for `summarize` (compare.run_numbers of compare.load_run): `validation/loss` (the
  best validation loss), `train/loss` (the final one) and `<task>/<metric>` of each task's latest evaluation."""
  return compare.run_numbers(compare.load_run(model_dir, params=False))


# --- tables and figure -------------------------------------------------------------------------------------------
def _columns(summary: Summary) -> list[str]:
  return summary.by + ["n"] + [f"{m}_{s}" for m in summary.metrics for s in STAT_SUFFIXES]


def csv_table(summary: Summary) -> str:
  """The rows, unformatted (floats as repr, None empty)."""
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=_columns(summary), lineterminator="\n")
  writer.writeheader()
  writer.writerows(
    {c: "" if row[c] is None else repr(row[c]) if isinstance(row[c], float) else row[c] for c in writer.fieldnames}
    for row in summary.rows
  )
  return buf.getvalue()


def _num(x: float | None) -> str:
  return "" if x is None else f"{x:.4g}"


def cell(row: Mapping[str, Any], metric: str) -> str:
  """'mean ± std [low, high]', or the mean alone for one value; '(n=k)' when fewer runs than the point's."""
  n, mean = row[f"{metric}_n"], row[f"{metric}_mean"]
  if mean is None:
    return ""
  text = (
    _num(mean)
    if row[f"{metric}_std"] is None
    else f"{_num(mean)} ± {_num(row[f'{metric}_std'])} [{_num(row[f'{metric}_ci95_low'])}, {_num(row[f'{metric}_ci95_high'])}]"
  )
  return text + (f" (n={n})" if n != row["n"] else "")


def point_label(summary: Summary, values: Mapping[str, Any] | None) -> str:
  """`name=value, ...` of a point's grid values; a single text value (a label) alone."""
  if values is None:
    return "-"
  return ", ".join(
    f"{c}={values[c]}" if len(summary.by) > 1 or not isinstance(values[c], str) else values[c] for c in summary.by
  )


def markdown_table(summary: Summary, title: str = "sweep") -> str:
  """A column per grid name, n, each metric as `mean ± std [low, high]` (bold for the best point where
  HyperMixer's mark holds); then per metric the best two points' Welch t-test."""
  esc = lambda s: str(s).replace("|", "\\|")
  lines = [
    f"# {title}",
    "",
    "Mean ± sample standard deviation [Student t 95% interval of the mean] over seeds. **Bold**: the best "
    "point leads the second best by at least one standard deviation of the best (HyperMixer, Table 1).",
    "",
    "| "
    + " | ".join(
      [*summary.by, "n"]
      + [f"{m} ({'lower' if d == 'min' else 'higher'} is better)" for m, d in summary.metrics.items()]
    )
    + " |",
    "|" + "|".join(["---"] * len(summary.by) + ["---:"] * (1 + len(summary.metrics))) + "|",
  ]
  for row in summary.rows:
    cells = [esc(row[c]) for c in summary.by] + [str(row["n"])]
    for metric in summary.metrics:
      text = esc(cell(row, metric))
      test = summary.tests[metric]
      if text and test["mark"] and {c: row[c] for c in summary.by} == test["best"]:
        text = f"**{text}**"
      cells.append(text)
    lines.append("| " + " | ".join(cells) + " |")
  lines.append("")
  for metric, test in summary.tests.items():
    lines.append(f"- {metric}: {welch_line(summary, test)}")
  return "\n".join(lines) + "\n"


def welch_line(summary: Summary, test: Mapping[str, Any]) -> str:
  """One sentence: the best two points, Welch's t, df and p, and whether HyperMixer's mark holds."""
  if test["best"] is None:
    return "no point logged it"
  best = point_label(summary, test["best"])
  if test["second"] is None:
    return f"best {best}; no second point to test against"
  text = f"best {best}, second {point_label(summary, test['second'])}: "
  w = test["welch"]
  text += (
    f"Welch's t = {w['t']:.3f}, df = {w['df']:.1f}, p = {w['p']:.3g}"
    if w and w["t"] is not None
    else "Welch's t-test undefined (fewer than 2 values on a side, or no spread on either)"
  )
  mark = {True: "holds", False: "does not hold", None: "undefined (one value)"}[test["mark"]]
  return text + f"; gap {test['gap']:.4g}, one-standard-deviation mark {mark}"


def plot(summary: Summary, path, title: str = "sweep"):
  """Per metric a panel: each seed's value (small points, labelled with the seed) and the mean with its 95%
  interval per grid point; the best point's mean in red."""
  plt = plots.pyplot()
  k = len(summary.metrics)
  cols = min(k, 3) or 1
  nrows = max(1, math.ceil(k / cols))
  fig, axes = plt.subplots(
    nrows, cols, figsize=(max(5.0, 1.2 * len(summary.rows) + 2.5) * cols, 4.2 * nrows), squeeze=False
  )
  labels = [point_label(summary, row) for row in summary.rows]
  for ax, (metric, direction) in zip(axes.flat, summary.metrics.items()):
    for x, (row, seen) in enumerate(zip(summary.rows, summary.values)):
      pairs = seen[metric]
      if pairs:
        offsets = np.linspace(-0.15, 0.15, len(pairs)) if len(pairs) > 1 else [0.0]
        ax.plot(x + np.asarray(offsets), [v for _, v in pairs], "o", color="0.55", ms=4, zorder=2)
        for dx, (seed, v) in zip(offsets, pairs):
          if seed is not None and len(pairs) <= 12:
            ax.annotate(str(seed), (x + dx, v), textcoords="offset points", xytext=(3, 2), fontsize=6, color="0.4")
      mean = row[f"{metric}_mean"]
      if mean is None:
        continue
      is_best = {c: row[c] for c in summary.by} == summary.best[metric]
      color = "tab:red" if is_best else "tab:blue"
      if row[f"{metric}_std"] is not None:
        err = [[mean - row[f"{metric}_ci95_low"]], [row[f"{metric}_ci95_high"] - mean]]
        ax.errorbar([x + 0.3], [mean], yerr=err, fmt="D", color=color, ms=7, capsize=5, lw=1.5, zorder=3)
      else:
        ax.plot([x + 0.3], [mean], "D", color=color, ms=7, zorder=3)
    ax.set_xticks(
      range(len(labels)),
      labels,
      rotation=20 if len(labels) > 3 else 0,
      fontsize=8,
      ha="right" if len(labels) > 3 else "center",
    )
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.margins(y=0.15)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{metric} ({'lower' if direction == 'min' else 'higher'} is better)", fontsize=10)
    ax.set_xlabel(" / ".join(summary.by))
  for ax in list(axes.flat)[k:]:
    ax.axis("off")
  axes.flat[0].plot([], [], "o", color="0.55", ms=4, label="one seed (its number beside it)")
  axes.flat[0].plot([], [], "D-", color="tab:blue", label="mean and its Student t 95% interval")
  axes.flat[0].plot([], [], "D", color="tab:red", label="best mean")
  axes.flat[0].legend(fontsize=7, loc="best")
  fig.suptitle(title)
  fig.tight_layout()
  return plots.save_png(fig, path)


def write(out_dir, summary: Summary, title: str = "sweep") -> list:
  """sweep.csv, sweep.md and sweep.png under `out_dir` (a local folder or gs://), each written whole through
  remixer_t5.storage; returns their paths."""
  out = storage.run_path(out_dir)
  storage.check_bucket(out, "--out")
  storage.write_text(out / "sweep.csv", csv_table(summary))
  storage.write_text(out / "sweep.md", markdown_table(summary, title))
  return [out / "sweep.csv", out / "sweep.md", plot(summary, out / "sweep.png", title)]


def report(
  points: Sequence[Mapping[str, Any]], by: Sequence[str], out_dir, title: str = "sweep"
) -> tuple[Summary, list]:
  """`summarize` over every metric the points carry (their '<split or task>/<metric>' keys, each better as
  `better` says), then `write` into `out_dir`: (the summary, the files written)."""
  metrics = {m: better(m) for m in dict.fromkeys(k for p in points for k in p if "/" in k)}  # in the points' order
  summary = summarize(points, by, metrics)
  return summary, write(out_dir, summary, title)
