"""`remixer-t5 compare MODEL_DIR... --out DIR`: several runs' curves and final numbers side by side.

Reads each run's `metrics.jsonl` (rows `{"step", "split": "train"|"validation"|"infer/<task>", "loss", ...}`,
written by metrics_log.MetricsLogger), `run_signature.json` and `config.gin`, and `inference_eval/<task>-metrics.jsonl`
(seqio's JSON logger: `{"step", <metric>: value}`) when present. Writes under DIR:

  compare.png   loss against step and against tokens seen (train lines, validation markers), best validation
                loss per run, and a table of the final numbers
  compare.md    the same numbers as a markdown table (also printed)
  compare.csv   the same numbers, unformatted

How the numbers are derived (all from what the runs logged):
  * a resumed run re-logs the steps between its last checkpoint and its interruption: the rows no later `start`
    row supersedes count (metrics_log.current_rows; in older files the last row logged for a (split, step));
  * tokens seen: real (non-padding) input + target tokens. A train row covers the steps since the previous train
    row and logs `tokens_per_s` and `steps_per_s` over its window, so it adds
    (tokens_per_s / steps_per_s) x (its step - the previous row's step); a row carrying `tokens_seen` itself is
    taken as is. Validation points get the tokens seen at their step (interpolated between train rows);
  * tokens/s: the median of the train rows' `tokens_per_s`, leaving out the first row of the file when there
    are more (it includes compilation); windows that ran an evaluation include its time;
  * goodput and input share: over the same windows, the step's and the input's share of their wall time
    (`time/step`, `time/input` over `window_seconds`: training/time_split.py);
  * parameters: counted from the shapes of the model in config.gin (no weights are read); empty when
    config.gin is missing or no longer parses;
  * task metrics: the latest `infer/<task>` row of metrics.jsonl, else the latest row of
    inference_eval/<task>-metrics.jsonl; numeric values only, as `<task>/<metric>`.

With --group_by_seed, runs whose config.gin differ only in the seed (and the run's own folder) are one group:
`seed_points` labels each run with its group and seed for remixer_t5.study, which writes sweep.csv/md/png.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from remixer_t5 import gin_utils, info, storage
from remixer_t5.training import plots
from remixer_t5.training.metrics_log import current_rows
from remixer_t5.training.run_identity import SIGNATURE_FILE

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.gin"
OUTPUT_FILES = ("compare.png", "compare.md", "compare.csv")

# Short names of network.Transformer's slots for the model column.
_SLOTS = {
  "encoder_token_mixer": "enc token",
  "decoder_token_mixer": "dec token",
  "decoder_cross_mixer": "dec cross",
  "encoder_feature_mixer": "enc feature",
  "decoder_feature_mixer": "dec feature",
  "encoder_input_layer": "enc input",
  "decoder_input_layer": "dec input",
}


@dataclasses.dataclass
class Run:
  """One run's curves and final numbers."""

  name: str
  model_dir: Path
  model: str = ""
  params: int | None = None
  steps: int = 0
  train: list[tuple[int, float, float | None]] = dataclasses.field(default_factory=list)  # step, loss, tokens
  validation: list[tuple[int, float, float | None]] = dataclasses.field(default_factory=list)
  tokens_seen: float | None = None
  tokens_per_s: float | None = None
  goodput: float | None = None
  input_share: float | None = None
  final_train_loss: float | None = None
  best_validation_loss: float | None = None
  best_validation_step: int | None = None
  task_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  notes: list[str] = dataclasses.field(default_factory=list)


# --- reading ---------------------------------------------------------------------------------------------
def read_metrics(model_dir: str | Path) -> list[dict[str, Any]]:
  """The rows of MODEL_DIR/metrics.jsonl (a local folder or gs://) in file order. A run killed mid-write may
  leave a cut last line: it is skipped; any other unreadable line is an error naming the file and line."""
  model_dir = storage.run_path(model_dir)
  storage.check_bucket(model_dir)
  if not model_dir.is_dir():
    raise FileNotFoundError(f"run directory {model_dir} does not exist")
  path = model_dir / METRICS_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f"{model_dir} has no {METRICS_FILE}: is it a MODEL_DIR of `remixer-t5 train`? "
      f"(train writes one row per logged step to MODEL_DIR/{METRICS_FILE})"
    )
  lines = path.read_text().splitlines()
  rows = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines):
        continue  # cut off by a kill during the write
      raise ValueError(f"{path}:{i}: not a JSON object ({e.msg}); expected one metrics row per line") from e
    if not isinstance(row, dict) or "step" not in row or "split" not in row:
      raise ValueError(f"{path}:{i}: expected a JSON object with 'step' and 'split', got {line[:80]!r}")
    rows.append(row)
  return rows


def latest_rows(rows: Iterable[Mapping[str, Any]], split: str) -> list[dict[str, Any]]:
  """The rows of `split` sorted by step, a resumed run's re-logged steps superseding the earlier ones
  (metrics_log.current_rows; the last one logged for a step winning in files without `start` rows)."""
  by_step = {int(row["step"]): dict(row) for row in current_rows(list(rows)) if row["split"] == split}
  return [by_step[s] for s in sorted(by_step)]


def _finite(x) -> float | None:
  try:
    x = float(x)
  except (TypeError, ValueError):
    return None
  return x if math.isfinite(x) else None


def cumulative_tokens(train_rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
  """Real tokens seen at each train row (see the module docstring); None from the first row that lacks the fields on."""
  out, total, prev = [], 0.0, 0
  for row in train_rows:
    step = int(row["step"])
    if total is not None and _finite(row.get("tokens_seen")) is not None:
      total = float(row["tokens_seen"])
    elif total is not None:
      tps, sps = _finite(row.get("tokens_per_s")), _finite(row.get("steps_per_s"))
      total = total + tps / sps * (step - prev) if tps is not None and sps else None
    out.append(total)
    prev = step
  return out


def _tokens_at(step: int, train: Sequence[tuple[int, float, float | None]]) -> float | None:
  """Tokens seen at `step`, linear between train rows (from 0 at step 0); past the last row at its rate."""
  pts = [(0, 0.0)] + [(s, t) for s, _, t in train if t is not None]
  if len(pts) < 2 or len(pts) != len(train) + 1:
    return None
  for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
    if step <= s1:
      return t0 + (t1 - t0) * (step - s0) / (s1 - s0) if s1 > s0 else t1
  (s0, t0), (s1, t1) = pts[-2], pts[-1]
  return t1 + (t1 - t0) / (s1 - s0) * (step - s1) if s1 > s0 else t1


def task_metrics(rows: Sequence[Mapping[str, Any]], model_dir: Path) -> dict[str, float]:
  """{'<task>/<metric>': value} of the latest decode-and-score evaluation of each task."""
  out: dict[str, float] = {}
  tasks = sorted({r["split"][len("infer/") :] for r in rows if str(r["split"]).startswith("infer/")})
  for task in tasks:
    latest = latest_rows(rows, f"infer/{task}")[-1]
    out.update(
      {
        f"{task}/{k}": float(v)
        for k, v in latest.items()
        if k not in ("step", "split", "time") and _finite(v) is not None
      }
    )
  for path in sorted((model_dir / "inference_eval").glob("*-metrics.jsonl")):
    task = path.name[: -len("-metrics.jsonl")]
    if task in tasks:
      continue
    logged = [r for r in map(_json_or_none, path.read_text().splitlines()) if isinstance(r, dict) and "step" in r]
    if logged:
      latest = max(logged, key=lambda r: r["step"])
      out.update({f"{task}/{k}": float(v) for k, v in latest.items() if k != "step" and _finite(v) is not None})
  return out


def _json_or_none(line: str):
  try:
    return json.loads(line)
  except json.JSONDecodeError:
    return None


def model_label(config_text: str, signature: Mapping[str, Any] | None) -> str:
  """'T5.1.1' or the token/feature mixers that replace T5.1.1's (from config.gin's network.Transformer slots),
  with the width and depth from run_signature.json, e.g. 'HyperMixing: enc token, dec token, dec cross; d128 2+2'."""
  by_class: dict[str, list[str]] = {}
  for slot, value in re.findall(r"^network\.Transformer\.(\w+)\s*=\s*(.+)$", config_text, re.M):
    if slot not in _SLOTS:
      continue
    value = value.strip()
    cls = "none" if value == "None" else re.sub(r"\(\)$", "", value).rsplit(".", 1)[-1].lstrip("@")
    by_class.setdefault(cls, []).append(_SLOTS[slot])
  order = list(_SLOTS.values())
  label = (
    "; ".join(f"{cls}: {', '.join(sorted(slots, key=order.index))}" for cls, slots in by_class.items()) or "T5.1.1"
  )
  sig = signature or {}
  if "config.emb_dim" in sig:
    label += (
      f"; d{sig['config.emb_dim']} {sig.get('config.num_encoder_layers', '?')}+"
      f"{sig.get('config.num_decoder_layers', '?')}"
    )
  return label


def count_params(config_path: Path) -> int:
  """Parameters of the model config.gin describes, from shapes alone (jax.eval_shape; nothing allocated)."""
  gin_utils.parse_gin([storage.local_copy(config_path)], [], macro_defaults={"MODEL_DIR": "None"})
  lengths = gin_utils.macro("TASK_FEATURE_LENGTHS") or {"inputs": 8, "targets": 8}
  return info.param_count(gin_utils.macro("MODEL"), lengths)


def load_run(model_dir: str | Path, name: str | None = None, params: bool = True) -> Run:
  """A Run from MODEL_DIR's files (see the module docstring for how each number is derived)."""
  model_dir = storage.run_path(model_dir)
  rows = read_metrics(model_dir)
  run = Run(name=name or model_dir.name, model_dir=model_dir)
  train, validation = latest_rows(rows, "train"), latest_rows(rows, "validation")
  if not train and not validation:
    raise ValueError(
      f"{model_dir / METRICS_FILE} has no train or validation rows (splits found: "
      f"{sorted({str(r['split']) for r in rows}) or 'none'})"
    )
  tokens = cumulative_tokens(train)
  loss = lambda r: _finite(r.get("loss")) if _finite(r.get("loss")) is not None else float("nan")
  run.train = [(int(r["step"]), loss(r), t) for r, t in zip(train, tokens)]
  run.validation = [(int(r["step"]), loss(r), _tokens_at(int(r["step"]), run.train)) for r in validation]
  run.steps = max(s for s, _, _ in run.train + run.validation)
  if run.train:
    run.final_train_loss = _finite(run.train[-1][1])
    run.tokens_seen = run.train[-1][2]
    first_in_file = next(int(r["step"]) for r in rows if r["split"] == "train")
    timed = [
      v
      for r in train
      if (v := _finite(r.get("tokens_per_s"))) is not None and (int(r["step"]) != first_in_file or len(train) == 1)
    ]
    run.tokens_per_s = float(statistics.median(timed)) if timed else None
    split = [r for r in train if "time/step" in r and (int(r["step"]) != first_in_file or len(train) == 1)]
    seconds = sum(float(r["window_seconds"]) for r in split)
    if seconds > 0:
      run.goodput = sum(float(r["time/step"]) for r in split) / seconds
      run.input_share = sum(float(r["time/input"]) for r in split) / seconds
  finite_val = [(loss, step) for step, loss, _ in run.validation if _finite(loss) is not None]
  if finite_val:
    run.best_validation_loss, run.best_validation_step = min(finite_val)
  run.task_metrics = task_metrics(rows, model_dir)
  sig_path = model_dir / SIGNATURE_FILE
  signature = json.loads(sig_path.read_text()) if sig_path.is_file() else None
  config = model_dir / CONFIG_FILE
  if config.is_file():
    run.model = model_label(config.read_text(), signature)
    if params:
      try:
        run.params = count_params(config)
      except Exception as e:  # noqa: BLE001 - an old or foreign config: the table says so, the curves still come
        run.notes.append(f"{run.name}: parameters unknown ({type(e).__name__}: {str(e)[:200]})")
  else:
    run.model = model_label("", signature) if signature else "?"
    run.notes.append(f"{run.name}: no {CONFIG_FILE}: model and parameters unknown")
  return run


def unique_names(model_dirs: Sequence[str | Path]) -> list[str]:
  """Directory names, with as many parent directories as it takes to tell equal names apart."""
  paths = [Path(str(d)[len("gs://") :]) if storage.is_bucket(d) else Path(d).resolve() for d in model_dirs]
  depth = [1] * len(paths)
  while True:
    names = ["/".join(p.parts[-d:]) for p, d in zip(paths, depth)]
    clash = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(paths[i].parts)]
    if not clash:
      return names
    for i in clash:
      depth[i] += 1


# --- the table ---------------------------------------------------------------------------------------------
# The fixed columns (each a Run field, `run` its name) and their headers.
_HEADERS = {
  "run": "run",
  "model": "model",
  "params": "parameters",
  "steps": "steps",
  "tokens_seen": "tokens seen",
  "tokens_per_s": "tokens/s",
  "goodput": "goodput",
  "input_share": "input share",
  "final_train_loss": "final train loss",
  "best_validation_loss": "best validation loss",
  "best_validation_step": "at step",
}
TABLE_COLUMNS = tuple(_HEADERS)


def table_rows(runs: Sequence[Run]) -> tuple[list[str], list[dict[str, Any]]]:
  """(columns, one dict per run): the fixed columns, then every task metric any run has."""
  extra = sorted({k for r in runs for k in r.task_metrics})
  rows = [
    {"run": r.name, **{c: getattr(r, c) for c in TABLE_COLUMNS[1:]}, **{k: r.task_metrics.get(k) for k in extra}}
    for r in runs
  ]
  return list(TABLE_COLUMNS) + extra, rows


def _si(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.3g}{unit}"
  return f"{x:.3g}"


def _fmt(column: str, value) -> str:
  if value is None:
    return ""
  if column == "params":
    return f"{int(value):,}"
  if column in ("tokens_seen", "tokens_per_s"):
    return _si(float(value))
  if column in ("goodput", "input_share"):
    return f"{float(value):.0%}"
  if isinstance(value, float):
    return f"{value:.4f}"
  return str(value)


def markdown_table(runs: Sequence[Run]) -> str:
  columns, rows = table_rows(runs)
  esc = lambda s: s.replace("|", "\\|")
  lines = [
    "| " + " | ".join(_HEADERS.get(c, c) for c in columns) + " |",
    "|" + "|".join("---" if c in ("run", "model") else "---:" for c in columns) + "|",
  ]
  lines += ["| " + " | ".join(esc(_fmt(c, row[c])) for c in columns) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def csv_table(runs: Sequence[Run]) -> str:
  columns, rows = table_rows(runs)
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
  writer.writeheader()
  writer.writerows(
    {c: ("" if row[c] is None else repr(row[c]) if isinstance(row[c], float) else row[c]) for c in columns}
    for row in rows
  )
  return buf.getvalue()


# --- the figure --------------------------------------------------------------------------------------------
def plot(runs: Sequence[Run], path: str | Path) -> Path:
  """One PNG: loss against step and against tokens seen (train lines, validation markers + dashes, one colour
  per run), best validation loss per run, and the table's main numbers."""
  plt = plots.pyplot()
  fig = plt.figure(figsize=(14, 9.5))
  grid = fig.add_gridspec(2, 2, height_ratios=(1.25, 1))
  by_step, by_tokens = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1], sharey=None)
  bars, table_ax = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  losses = []
  for i, run in enumerate(runs):
    c = colors[i % len(colors)]
    for ax, x in ((by_step, 0), (by_tokens, 2)):
      tr = [(p[x], p[1]) for p in run.train if p[x] is not None]
      va = [(p[x], p[1]) for p in run.validation if p[x] is not None]
      if tr:
        ax.plot(*zip(*tr), "-", color=c, lw=1.6, label=f"{run.name} train")
      if va:
        ax.plot(*zip(*va), "o--", color=c, lw=1, ms=5, label=f"{run.name} validation")
    losses += [p[1] for p in run.train + run.validation]
    # Dots, not bars: the differences that matter are small against the losses themselves.
    if run.best_validation_loss is not None:
      bars.plot([i], [run.best_validation_loss], "o", color=c, ms=10)
      bars.annotate(
        f"{run.best_validation_loss:.3f} (step {run.best_validation_step})",
        (i, run.best_validation_loss),
        textcoords="offset points",
        xytext=(0, 9),
        ha="center",
        fontsize=8,
      )
    if run.final_train_loss is not None:
      bars.plot([i], [run.final_train_loss], "x", color=c, ms=8, mew=2)
  top = _robust_top(losses)
  for ax, xlabel in ((by_step, "step"), (by_tokens, "tokens seen (real input + target tokens)")):
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (cross-entropy + z-loss per target token)")
    ax.grid(alpha=0.3)
    if top is not None:
      ax.set_ylim(top=top)
  by_step.set_title("loss against step")
  by_tokens.set_title("loss against tokens seen")
  by_tokens.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: _si(v)))
  by_step.legend(fontsize=8, ncol=1 if len(runs) < 4 else 2)
  bars.plot([], [], "ko", label="best validation loss")
  bars.plot([], [], "kx", label="final train loss")
  bars.legend(fontsize=8, loc="best")
  bars.set_xticks(range(len(runs)), [r.name for r in runs], rotation=15 if len(runs) > 4 else 0, fontsize=9)
  bars.set_xlim(-0.5, len(runs) - 0.5)
  bars.margins(y=0.25)
  bars.set_ylabel("loss")
  bars.set_title("best validation loss and final train loss (lower is better)")
  bars.grid(alpha=0.3, axis="y")

  table_ax.axis("off")
  columns, rows = table_rows(runs)
  shown = ["run", "params", "steps", "tokens_seen", "tokens_per_s", "final_train_loss", "best_validation_loss"]
  shown += [c for c in columns if c not in TABLE_COLUMNS][:4]
  cells = [[_fmt(c, row[c]) for c in shown] for row in rows]
  headers = ["\n".join(textwrap.wrap(_HEADERS[c] if c in _HEADERS else c.replace("/", "/ "), 11)) for c in shown]
  height = min(0.8, 0.11 * (len(runs) + 1.5))
  t = table_ax.table(cellText=cells, colLabels=headers, cellLoc="center", bbox=[0, 1 - height, 1, height])
  t.auto_set_font_size(False)
  t.set_fontsize(9)
  for j in range(len(shown)):
    t[0, j].set_text_props(fontweight="bold")
  models = "\n".join(f"{r.name}: {r.model}" for r in runs)
  table_ax.text(0.0, 1 - height - 0.05, models, transform=table_ax.transAxes, fontsize=8, va="top", family="monospace")
  table_ax.set_title("final numbers (compare.md / compare.csv)")
  fig.tight_layout()
  return plots.save_png(fig, path)


def _robust_top(losses: Sequence[float]) -> float | None:
  """A y-limit that keeps the first steps' large losses from flattening the rest: the 90th percentile of all
  points + 15% of the range below it (None: let matplotlib choose)."""
  v = sorted(x for x in losses if math.isfinite(x))
  if len(v) < 5:
    return None
  high, low = v[int(0.9 * (len(v) - 1))], v[0]
  return high + 0.15 * (high - low) if high > low else None


# --- the command -------------------------------------------------------------------------------------------
def compare(
  model_dirs: Sequence[str | Path],
  out: str | Path,
  names: Sequence[str] | None = None,
  log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
  group_by_seed: bool = False,
) -> tuple[list[Run], dict[str, Path]]:
  """Load the runs, write OUTPUT_FILES under `out`; returns (runs, {file name: path}). `group_by_seed`: first
  check that the runs group over seeds (seed_points), so that runs it refuses leave nothing written."""
  if not model_dirs:
    raise ValueError("compare needs at least one MODEL_DIR")
  if names is not None and len(names) != len(model_dirs):
    raise ValueError(f"--names gives {len(names)} names for {len(model_dirs)} run directories")
  names = list(names) if names is not None else unique_names(model_dirs)
  for d in model_dirs:  # every missing file is reported before any work
    read_metrics(d)
  runs = [load_run(d, n) for d, n in zip(model_dirs, names)]
  for run in runs:
    for note in run.notes:
      log(note)
  if group_by_seed:
    seed_points(runs)
  out = storage.run_path(out)
  storage.check_bucket(out, "--out")
  written = {"compare.png": plot(runs, out / "compare.png")}
  for name, text in (("compare.md", markdown_table(runs)), ("compare.csv", csv_table(runs))):
    storage.write_text(out / name, text)
    written[name] = out / name
  return runs, written


# --- runs that differ only in their seed ---------------------------------------------------------------------
# config.gin statements that differ between the seeds of one setting: the seed, and the run's own folder.
SEED_KEYS = ("RANDOM_SEED", "run_config.Training.random_seed")
OWN_KEYS = SEED_KEYS + ("MODEL_DIR", "run_config.Run.model_dir")
_STATEMENT = re.compile(r"^([A-Za-z_][\w./]*)\s*=\s*(.*)$")
_LABEL_CHARS = 60


def run_numbers(run: Run) -> dict[str, float]:
  """A run's numbers for remixer_t5.study: `validation/loss` (its best), `train/loss` (its final one) and each
  task metric (`<task>/<metric>`); a number the run did not log is left out."""
  out = {"validation/loss": run.best_validation_loss, "train/loss": run.final_train_loss, **run.task_metrics}
  return {k: v for k, v in out.items() if v is not None}


def gin_settings(config_text: str) -> dict[str, str]:
  """config.gin's statements as {key: value}: `KEY = VALUE`, a value that gin wrapped over indented lines (after
  a `\\`) joined by spaces; any other statement (an import) its own key with an empty value; comments and blank lines
  left out."""
  settings: dict[str, str] = {}
  key = None
  for line in config_text.splitlines():
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    if line[0].isspace() and key is not None:
      settings[key] = (settings[key].removesuffix("\\").rstrip() + " " + line.strip()).strip()
      continue
    match = _STATEMENT.match(line.strip())
    key = match.group(1) if match else line.strip()
    settings[key] = match.group(2).strip() if match else ""
  return settings


def _seed(settings: Mapping[str, str]) -> int | str | None:
  for key in SEED_KEYS:
    value = settings.get(key, "")
    if value and not value.startswith("%"):
      return int(value) if re.fullmatch(r"-?\d+", value) else value
  return None


def seed_points(runs: Sequence[Run]) -> list[dict[str, Any]]:
  """One point per run for study.summarize(points, by=["group"], ...): {"group", "seed", "run", **run_numbers}.

  Runs whose config.gin statements are equal but for OWN_KEYS are one group; its label is the settings that tell
  the groups apart (`KEY=value, ...`; `unset` where a group lacks one), or, when one of those runs past 60
  characters or there is one group, the group's first run name with `+k` for its other k runs. Two runs of one group with the
  same seed are an error: they would count one measurement twice."""
  settings = []
  for run in runs:
    path = run.model_dir / CONFIG_FILE
    if not path.is_file():
      raise FileNotFoundError(
        f"--group_by_seed: {run.model_dir} has no {CONFIG_FILE}; expected the config.gin "
        f"train writes, to tell which runs differ only in their seed"
      )
    settings.append(gin_settings(path.read_text()))
  groups: dict[tuple, list[int]] = {}
  for i, s in enumerate(settings):
    groups.setdefault(tuple(sorted((k, v) for k, v in s.items() if k not in OWN_KEYS)), []).append(i)
  keys = sorted({k for key in groups for k, _ in key})
  differing = [k for k in keys if " " not in k and len({dict(key).get(k) for key in groups}) > 1]  # not imports
  labels = {key: ", ".join(f"{k}={dict(key).get(k, 'unset')}" for k in differing) for key in groups}
  if not differing or max(map(len, labels.values())) > _LABEL_CHARS:
    labels = {
      key: runs[members[0]].name + (f" +{len(members) - 1}" if len(members) > 1 else "")
      for key, members in groups.items()
    }
  for members in groups.values():
    seeds = [_seed(settings[i]) for i in members]
    for j, seed in enumerate(seeds):
      if seed in seeds[:j]:
        other = members[seeds.index(seed)]
        raise ValueError(
          f"--group_by_seed: runs {runs[other].name} and {runs[members[j]].name} have the same "
          f"config.gin and seed {'(the default)' if seed is None else seed}; expected one run per "
          f"seed in a group"
        )
  out = []
  for key, members in groups.items():
    out += [
      {"group": labels[key], "seed": _seed(settings[i]), "run": runs[i].name, **run_numbers(runs[i])} for i in members
    ]
  return out
