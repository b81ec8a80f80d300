"""`remixer-t5 repro cogs-curve`: exact match against training steps for one COGS run (how many steps does
generalisation need?).

Trains one model and seed exactly as `remixer-t5 repro cogs` does (remixer_t5/repro/cogs.py: same gin files,
flags and schedule; the rsqrt schedule does not depend on the step budget, so the state at step s is the state
a run of s steps ends with), but keeps a checkpoint every `--every` steps, then decodes test and gen with each
(greedy, the cache, seqio's evaluator: the sweep's own `evaluate_run`). Writes to `--out`:
  curve.jsonl  one row per (step, split or gen category): step, split, category, exact_match (0-1), n, seconds
  curve.png    exact match against steps, one line per split / gen category
Resumable: training resumes from its last checkpoint, decoded (step, split) pairs are kept.

  remixer-t5 repro cogs-curve --model t5_1_1 --seed 0 --steps 12000 --every 2000 --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from remixer_t5.repro import cogs as repro, pyplot


def add_arguments(p) -> None:
  p.add_argument("--model", default="t5_1_1")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps", type=int, default=12000)
  p.add_argument("--every", type=int, default=2000, help="decode the checkpoint of every this many steps")
  p.add_argument("--splits", default="test,gen", help="comma-separated: validation, test, gen")
  p.add_argument("--out", type=Path, required=True)


def main(args) -> int:
  splits = tuple(args.splits.split(","))
  bad = [s for s in splits if s not in repro.SPLITS]
  if bad or args.every <= 0 or args.steps % args.every:
    raise ValueError(
      f"--splits must name {', '.join(repro.SPLITS)} (got {bad}); --every must divide --steps "
      f"({args.every}, {args.steps})"
    )
  progress = lambda s: print(s, file=sys.stderr, flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  record = {"model": args.model, "seed": args.seed, "steps": args.steps, "every": args.every}
  kept = args.out / "curve_settings.json"
  if kept.exists() and json.loads(kept.read_text()) != record:
    raise ValueError(f"{args.out} holds a curve made with {kept.read_text().strip()}; use another --out")
  kept.write_text(json.dumps(record))
  settings = repro.Settings(models=(args.model,), seeds=(args.seed,), steps=args.steps)
  data = repro.measure_splits(progress)
  run_dir = args.out / "runs" / f"{args.model}-seed{args.seed}"
  repro.train_run(
    args.model,
    args.seed,
    settings,
    data["model_lengths"],
    run_dir,
    progress,
    extra_gin=[f"--gin.CHECKPOINT_PERIOD={args.every}", "--gin.run_config.Schedule.keep_checkpoints=None"],
  )
  path = args.out / "curve.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
  for step in range(args.every, args.steps + 1, args.every):
    have = {(r["step"], r["split"]) for r in rows}
    todo = [s for s in splits if (step, repro.SPLIT_LABELS[s]) not in have]
    if not todo:
      continue
    results = repro.evaluate_run(args.model, args.seed, settings, data, run_dir, progress, step=step, splits=todo)
    for split, r in results.items():
      cats = repro.category_scores(r) if split == "gen" else {}
      new = [
        {
          "step": step,
          "split": repro.SPLIT_LABELS[split],
          "category": "mean over categories" if cats else None,
          "exact_match": sum(cats.values()) / len(cats) if cats else r["exact_match"] / 100.0,
          "n": r["examples"],
          "seconds": round(r["seconds"], 1),
        }
      ]
      new += [
        {"step": step, "split": "gen", "category": c, "exact_match": v, "n": None, "seconds": None}
        for c, v in sorted(cats.items())
      ]
      rows += new
      progress(
        f"step {step} {repro.SPLIT_LABELS[split]}: "
        + ", ".join(f"{r['category'] or 'all'} {100 * r['exact_match']:.1f}%" for r in new)
      )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot(rows, args.out / "curve.png", f"{repro.LABELS.get(args.model, args.model)} seed {args.seed}")
  return 0


def plot(rows: list[dict], path: Path, title: str) -> None:
  plt, save_png = pyplot()
  lines: dict[str, list[tuple[int, float]]] = {}
  for r in rows:
    name = (
      r["split"]
      if r["category"] is None
      else ("gen mean" if r["category"] == "mean over categories" else f"gen: {r['category']}")
    )
    lines.setdefault(name, []).append((r["step"], 100 * r["exact_match"]))
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for name, pts in sorted(lines.items()):
    pts.sort()
    ax.plot(
      [s for s, _ in pts],
      [v for _, v in pts],
      marker="o",
      label=name,
      linestyle="--" if name.startswith("gen:") else "-",
    )
  ax.set(
    xlabel="training steps (batch 4 packed rows, ~26 examples)",
    ylabel="exact match (%)",
    ylim=(-2, 102),
    title=f"COGS from scratch: {title}, exact match against steps",
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  save_png(fig, path, dpi=120)
