"""PNG plots of what people look at: the training and validation curves of a run."""
from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(model_dir: str, out: str | None = None) -> Path:
  """Loss and accuracy against step for the train and validation rows of MODEL_DIR/metrics.jsonl."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines() if line]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for split, style in (("train", "-"), ("validation", "o-")):
    pts = sorted((r["step"], r["loss"], r["accuracy"]) for r in rows if r.get("split") == split)
    if pts:
      steps, loss, acc = zip(*pts)
      axes[0].plot(steps, loss, style, label=split)
      axes[1].plot(steps, acc, style, label=split)
  for ax, name in zip(axes, ("loss (cross-entropy + z-loss per target token)", "token accuracy")):
    ax.set_xlabel("step")
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(str(Path(model_dir).name))
  fig.tight_layout()
  path = Path(out) if out else Path(model_dir) / "metrics.png"
  tmp = path.with_name(path.stem + ".tmp.png")
  fig.savefig(tmp, dpi=100)
  plt.close(fig)
  tmp.replace(path)
  return path
