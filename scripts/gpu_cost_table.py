"""The GPU cost table of docs/benchmarks.md: base models compiled ahead of time for 1 and 8 H100s, no GPU.

Each cell is one `remixer-t5 compile --topology h100[x8] ... --json` (remixer_t5/aot_compile.py: XLA's CUDA
compiler through the jax-cuda12 plugin) in its own process, one at a time: pretraining settings
(runs/pretrain.gin: batch 128, lengths 512/114, Adafactor) with bfloat16 activations. Rows are appended to
docs/data/gpu_cost_table.jsonl (an interrupted run resumes); `--render` writes the markdown table into
docs/benchmarks.md between its markers. Every row records the commit and any uncommitted model files.

Run with the venv that has the plugin (`make gpu-compile-env`):
  nice -n 19 .venv-gpu/bin/python scripts/gpu_cost_table.py      # measure what is missing, then render
  .venv-gpu/bin/python scripts/gpu_cost_table.py --render        # only re-render
  .venv-gpu/bin/python scripts/gpu_cost_table.py --redo hypermixer_base   # measure a changed model's cells again
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tpu_cost_table import git_state  # scripts/: the same commit record as the TPU table's rows

ROOT = Path(__file__).resolve().parents[1]
JSONL = ROOT / "docs" / "data" / "gpu_cost_table.jsonl"
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- gpu-cost-table:start -->", "<!-- gpu-cost-table:end -->"

MODELS = {
    "t5_1_1_base": ("models/t5_1_1/base.gin", "T5.1.1-base"),
    "t5_1_1_large": ("models/t5_1_1/large.gin", "T5.1.1-large"),
    "remixer_sbase": ("models/remixer/sbase.gin", "Remixer_SBase"),
    "remixer_base": ("models/remixer/base.gin", "Remixer_Base"),
    "hypermixer_base": ("models/hypermixer/base.gin", "HyperMixer-base"),
    "amlp_base": ("models/amlp/base.gin", "aMLP-base"),
}
VARIANTS = {"": [], "remat_full": ["--gin.network.T5Config.remat_policy='full'"]}
# (topology, rules, mesh): one GPU; 8 GPUs with the gpu_8 preset's rules (fsdp).
SETUPS = [("h100", "data", "1x1"), ("h100x8", "fsdp", "8x1")]


def cells() -> list[tuple[str, str, str, str, str]]:
  return [(m, topo, rules, mesh, "") for topo, rules, mesh in SETUPS for m in MODELS]


def key(row) -> tuple:
  return (row["name"], row["topology"], row["rules"], row["mesh"], row["variant"])


def todo(rows: list[dict], redo: list[str]) -> list[tuple]:
  """The cells to compile: those with no row yet, and every cell of the models in `redo`."""
  if unknown := sorted(set(redo) - set(MODELS)):
    raise SystemExit(f"--redo: unknown model(s) {', '.join(unknown)}; expected some of {', '.join(MODELS)}")
  done = {key(r) for r in rows if r["name"] not in redo}
  return [c for c in cells() if c not in done]


def load() -> list[dict]:
  if not JSONL.exists():
    return []
  return [json.loads(line) for line in JSONL.read_text().splitlines() if line.strip()]


def measure(name: str, topology: str, rules: str, mesh: str, variant: str, timeout: int) -> dict:
  cmd = [sys.executable, "-m", "remixer_t5.cli", "compile", f"--gin_file={MODELS[name][0]}",
         "--gin_file=runs/pretrain.gin", "--gin.ACTIVATION_DTYPE='bfloat16'", *VARIANTS[variant],
         f"--topology={topology}", f"--mesh={mesh}", f"--rules={rules}", "--json"]
  row = {"name": name, "topology": topology, "rules": rules, "mesh": mesh, "variant": variant, **git_state(),
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  except subprocess.TimeoutExpired:
    return row | {"error": f"compile did not finish in {timeout} s"}
  row["wall_seconds"] = round(time.time() - t0, 1)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if not lines:
    return row | {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]}
  return row | {"report": json.loads(lines[-1])}


def render(rows: list[dict]) -> str:
  latest = {key(r): r for r in rows}
  lines = ["| model | GPUs | rules (mesh) | variant | fits | GiB/GPU | XLA TFLOP/GPU | model TFLOP/GPU | roofline ms "
           "| est. steps/s | est. MFU | notes | measured at |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
  for cell in cells():
    name, topo, rules, mesh, variant = cell
    r = latest.get(cell)
    if r is None:
      continue
    at = r["commit"] + (" (+ uncommitted)" if r.get("uncommitted") else "")
    head = f"| {MODELS[name][1]} | {topo} | {rules} ({mesh}) | {variant or '-'} | "
    if "report" not in r:
      lines.append(head + f"error: {r.get('error', '')[:80]} | | | | | | | | {at} |")
      continue
    t = r["report"]["steps"]["train"]
    need = t.get("needs_bytes")
    if not t["fits"]:
      lines.append(head + f"no | {need / 2 ** 30:.1f} | | | | | | needs {need / 2 ** 30:.1f} of "
                   f"{t['available_bytes'] / 2 ** 30:.1f} GiB | {at} |")
      continue
    notes = []
    if t.get("loops"):
      notes.append(f"{len(t['loops'])} while loop(s): no step time (a loop body counts once)")
    if t.get("kernel_calls"):
      notes.append(f"{t['kernel_calls']} Pallas kernel call(s): no step time (XLA counts neither their FLOPs nor "
                   "their bytes)")
    if t.get("xla_options"):
      notes.append("cuBLAS GEMMs (Triton found no tiling without autotuning)")
    if t.get("roofline_note"):
      notes.append("roofline on model FLOPs")
    rt = t.get("roofline_seconds")
    mfu = t.get("est_mfu")
    lines.append(head + f"yes | {t['memory']['total_bytes'] / 2 ** 30:.1f} | "
                 f"{'n/a (cuBLAS)' if t.get('flops_note') else format(t['xla_flops_per_device'] / 1e12, '.1f')} | "
                 f"{t['model_flops_per_device'] / 1e12:.1f} | {'' if rt is None else f'{rt * 1e3:.0f}'} | "
                 f"{'' if rt is None else f'{1 / rt:.2f}'} | {'' if mfu is None else f'{100 * mfu:.0f}%'} | "
                 f"{'; '.join(notes)} | {at} |")
  return "\n".join(lines)


def write_doc(table: str) -> None:
  text = DOC.read_text()
  if START not in text:
    raise SystemExit(f"{DOC} has no {START} marker")
  head, rest = text.split(START, 1)
  _, tail = rest.split(END, 1)
  DOC.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--render", action="store_true", help="only re-render the markdown table")
  ap.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
  ap.add_argument("--redo", default="", help=f"comma-separated models to compile again although measured "
                  f"(after a change to them); of {', '.join(MODELS)}")
  args = ap.parse_args()
  rows = load()
  if not args.render:
    cells_left = todo(rows, [m for m in args.redo.split(",") if m])
    for i, cell in enumerate(cells_left, 1):
      print(f"[{i}/{len(cells_left)}] {' '.join(c for c in cell if c)} ...", file=sys.stderr, flush=True)
      row = measure(*cell, timeout=args.timeout)
      rows.append(row)
      with JSONL.open("a") as f:
        f.write(json.dumps(row) + "\n")
      t = row.get("report", {}).get("steps", {}).get("train", {})
      print(f"    {row.get('wall_seconds', '?')} s: " + (row["error"] if "error" in row else
            f"fits {t.get('fits')}, {t.get('needs_bytes', 0) / 2 ** 30:.1f} GiB/GPU"), file=sys.stderr, flush=True)
  write_doc(render(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
