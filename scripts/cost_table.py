"""The cost tables of docs/benchmarks.md: base models compiled ahead of time, no TPU or GPU needed.

Each cell is one `remixer-t5 compile ... --json` (remixer_t5/aot_compile.py) in its own process (a base-size compile
takes minutes and 5-9 GiB of RAM on a CPU): pretraining settings (runs/pretrain.gin: batch 128, lengths 512/114,
Adafactor) with bfloat16 activations. `tpu`: every model on v3 slices, per rule set and memory variant (libtpu, the
`tpu` extra); `gpu`: base models on 1 and 8 H100s (XLA's CUDA compiler: the venv of `make gpu-compile-env`). Rows
are appended to docs/data/<tpu|gpu>_cost_table.jsonl, so an interrupted run resumes where it stopped, and record
the commit and which model files had uncommitted changes; the tables are rendered into docs/benchmarks.md between
their markers (and the TPU table's every cell into docs/data/tpu_cost_table.md).

  nice -n 19 python scripts/cost_table.py tpu                 # measure what is missing (v3-32 first), then render
  nice -n 19 .venv-gpu/bin/python scripts/cost_table.py gpu   # the same for the GPU table
  python scripts/cost_table.py tpu --render                   # only re-render the markdown
  python scripts/cost_table.py gpu --redo hypermixer_base     # measure a changed model's cells again
  python scripts/cost_table.py tpu --again remixer_base       # a model's cells again first (its rows stay till then)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"


def git_state() -> dict:
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  dirty = subprocess.run(
    ["git", "status", "--porcelain", "--", "remixer_t5", "gin"], cwd=ROOT, capture_output=True, text=True
  ).stdout.split("\n")
  return {"commit": commit, "uncommitted": sorted(line[3:] for line in dirty if line.strip())}


def load(path: Path) -> list[dict]:
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compile_cell(row: dict, gin_file: str, flags: list[str], timeout: int) -> dict:
  """`row` with the report (or the error) of `remixer-t5 compile` of `gin_file` with runs/pretrain.gin in
  bfloat16 and `flags`, in a process of its own with the host as its only platform."""
  cmd = [
    sys.executable,
    "-m",
    "remixer_t5.cli",
    "compile",
    f"--gin_file={gin_file}",
    "--gin_file=runs/pretrain.gin",
    "--gin.ACTIVATION_DTYPE='bfloat16'",
    *flags,
    "--json",
  ]
  row = {**row, **git_state(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  t0 = time.time()
  try:
    proc = subprocess.run(
      cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
  except subprocess.TimeoutExpired:
    return row | {"error": f"compile did not finish in {timeout} s"}
  row["wall_seconds"] = round(time.time() - t0, 1)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if not lines:
    return row | {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]}
  return row | {"report": json.loads(lines[-1])}


def write_between(start: str, end: str, table: str) -> None:
  text = DOC.read_text()
  if start not in text:
    raise SystemExit(f"{DOC} has no {start} marker: add the section first")
  head, rest = text.split(start, 1)
  _, tail = rest.split(end, 1)
  DOC.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def _fmt(x, spec):
  return "" if x is None else format(x, spec)


# --- TPU v3 slices ----------------------------------------------------------------------------------------
TPU_JSONL = ROOT / "docs" / "data" / "tpu_cost_table.jsonl"
CELLS_DOC = ROOT / "docs" / "data" / "tpu_cost_table.md"  # every cell; DOC holds the summary
TPU_START, TPU_END = "<!-- tpu-cost-table:start -->", "<!-- tpu-cost-table:end -->"

# name -> (gin file, label, the Remixer paper's Table 1 steps/s on 16 v3 chips, or None)
TPU_MODELS = {
  "t5_1_1_base": ("models/t5_1_1/base.gin", "T5.1.1-base", 9),
  "mixer_enc_base": ("models/mixer_enc/base.gin", "Mixer_Enc-base", 11),
  "mixer_encdec_base": ("models/mixer_encdec/base.gin", "Mixer_EncDec-base", 11),
  "remixer_sbase": ("models/remixer/sbase.gin", "Remixer_SBase", 8),
  "remixer_base": ("models/remixer/base.gin", "Remixer_Base", 6),
  "hypermixer_base": ("models/hypermixer/base.gin", "HyperMixer-base", None),
  "gmlp_base": ("models/gmlp/base.gin", "gMLP-base", None),
  "amlp_base": ("models/amlp/base.gin", "aMLP-base", None),
  "fnet_base": ("models/fnet/base.gin", "FNet-base", None),
  "linear_attention_base": ("models/linear_attention/base.gin", "linear attention-base", None),
  "pnlp_mixer_base": ("models/pnlp_mixer/base.gin", "pNLP-Mixer-base", None),
  "t5_1_1_large": ("models/t5_1_1/large.gin", "T5.1.1-large", None),
  "t5_1_1_xl": ("models/t5_1_1/xl.gin", "T5.1.1-xl", None),
  # A control, not an architecture: T5.1.1's blocks at Remixer_SBase's 18 + 3 layers (preset rules only).
  "t5_1_1_sbase_layout": ("models/t5_1_1/sbase_layout.gin", "T5.1.1-base at 18 + 3 layers", None),
}
TPU_VARIANTS = {
  "": [],
  "remat_full": ["--gin.network.T5Config.remat_policy='full'"],
  "scan": ["--gin.network.T5Config.scan_layers=True"],
}
BIG = ["t5_1_1_large", "t5_1_1_xl"]
CONTROLS = ["t5_1_1_sbase_layout"]
BASE = [m for m in TPU_MODELS if m not in BIG + CONTROLS]


# Each cell's rule set and the size of its 'model' mesh axis: data and fsdp over every core (N, 1); data_model
# with a 4-way 'model' axis (Megatron-style tensor parallelism; on (N, 1) data_model compiles the same program as
# data); fsdp_model is fsdp on (N/4, 4), the mesh the tpu_v3_128 preset used before this table decided it.
RULES = {"data": ("data", 1), "fsdp": ("fsdp", 1), "data_model": ("data_model", 4), "fsdp_model": ("fsdp", 4)}
T5_SIZES = ("t5_1_1_base", "t5_1_1_large", "t5_1_1_xl")


def mesh_for(topology: str, rules: str) -> str:
  cores = int(topology.split("-")[1])
  model = RULES[rules][1]
  return f"{cores // model}x{model}"


def rules_label(topology: str, rules: str) -> str:
  return f"{RULES[rules][0]} ({mesh_for(topology, rules)})"


# The cells that decide the tpu_v3_* presets, measured right after the paper's v3-32 comparison (a base compile
# takes 2-7 minutes here, so the full table is a night's work): per slice and model size, the rule sets that can
# be fastest (data only for base; remat only where nothing else fits).
PRESET_CELLS = [
  ("t5_1_1_base", "v3-8", "fsdp", ""),
  ("t5_1_1_base", "v3-8", "data_model", ""),
  ("t5_1_1_base", "v3-8", "data", ""),
  ("t5_1_1_base", "v3-128", "fsdp", ""),
  ("t5_1_1_base", "v3-128", "fsdp_model", ""),
  ("t5_1_1_base", "v3-128", "data_model", ""),
  ("t5_1_1_large", "v3-8", "fsdp", ""),
  ("t5_1_1_large", "v3-32", "fsdp", ""),
  ("t5_1_1_large", "v3-128", "fsdp", ""),
  ("t5_1_1_large", "v3-8", "fsdp", "remat_full"),
  ("t5_1_1_xl", "v3-32", "fsdp", ""),
  ("t5_1_1_xl", "v3-128", "fsdp", ""),
  ("t5_1_1_large", "v3-32", "data_model", ""),
  ("t5_1_1_large", "v3-128", "fsdp_model", ""),
  ("t5_1_1_xl", "v3-32", "data_model", ""),
  ("t5_1_1_xl", "v3-128", "fsdp_model", ""),
  ("t5_1_1_xl", "v3-8", "fsdp", "remat_full"),
  ("t5_1_1_large", "v3-8", "data_model", ""),
  ("t5_1_1_xl", "v3-8", "fsdp", ""),
]


def tpu_cells() -> list[tuple[str, str, str, str]]:
  """(model, topology, rules, variant) in the order they are measured: the paper's v3-32 comparison first, then
  the cells that choose the tpu_v3_* presets, then every architecture under those presets' rules (fsdp) on v3-8
  and v3-128 and under data_model on v3-32, then T5.1.1's remaining settings, then every other cell, then the
  controls (under the presets' rules)."""
  first = ["t5_1_1_base", "remixer_sbase", "remixer_base"]
  out = [(m, "v3-32", "fsdp", "") for m in first] + [("t5_1_1_base", "v3-32", "data_model", "")]
  out += [(m, "v3-32", "fsdp", "") for m in BASE if m not in first]
  out += PRESET_CELLS
  for topo in ("v3-8", "v3-128"):  # every architecture under each slice's preset rules
    out += [(m, topo, "fsdp", "") for m in BASE]
  out += [(m, "v3-32", "data_model", "") for m in BASE]
  for topo in ("v3-8", "v3-32", "v3-128"):  # the rest of T5.1.1's settings
    for m in T5_SIZES:
      for rules in ("fsdp", "data_model", "data", "fsdp_model"):
        out.append((m, topo, rules, ""))
      for variant in ("remat_full", "scan"):
        out.append((m, topo, "fsdp", variant))
  for topo in ("v3-32", "v3-8", "v3-128"):  # every architecture
    for rules in ("data_model", "fsdp", "data"):
      out += [(m, topo, rules, "") for m in BASE]
  out += [(m, topo, "fsdp", "") for m in CONTROLS for topo in ("v3-32", "v3-8", "v3-128")]
  seen: set = set()
  return [c for c in out if not (c in seen or seen.add(c))]


def tpu_key(row) -> tuple:
  return (row["name"], row["topology"], row["rules"], row["variant"])


def tpu_measure(name: str, topology: str, rules: str, variant: str, timeout: int) -> dict:
  row = {"name": name, "topology": topology, "rules": rules, "variant": variant}
  return compile_cell(
    row,
    TPU_MODELS[name][0],
    [
      *TPU_VARIANTS[variant],
      f"--topology={topology}",
      f"--mesh={mesh_for(topology, rules)}",
      f"--rules={RULES[rules][0]}",
    ],
    timeout,
  )


def tpu_render(rows: list[dict]) -> str:
  latest = {tpu_key(r): r for r in rows}
  base_step = {
    (r["topology"], r["rules"], r["variant"]): r["report"]["steps"]["train"].get("optimal_seconds")
    for r in latest.values()
    if r["name"] == "t5_1_1_base" and "report" in r and r["report"]["steps"]["train"]["fits"]
  }
  head = (
    "| model | slice | rules (mesh) | variant | fits | GiB/core | peak GiB | est. step ms | est. steps/s | × T5.1.1-base step "
    "| est. MFU | paper steps/s (16 v3 chips) | measured at |\n"
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
  )
  lines = [head]
  missing: list = []
  for cell in tpu_cells():
    name, topo, rules, variant = cell
    label, paper = TPU_MODELS[name][1], (TPU_MODELS[name][2] if topo == "v3-32" else None)
    r = latest.get(cell)
    if r is None:
      missing.append(cell)
      continue
    at = r["commit"] + (
      " (+ uncommitted: " + ", ".join(Path(p).name for p in r["uncommitted"]) + ")" if r.get("uncommitted") else ""
    )
    if "report" not in r:
      lines.append(
        f"| {label} | {topo} | {rules_label(topo, rules)} | {variant or '-'} | error: {r.get('error', '')[:80]} | | | | | | | "
        f"{paper or ''} | {at} |"
      )
      continue
    t = r["report"]["steps"]["train"]
    if not t["fits"]:
      need = t.get("needs_bytes")
      lines.append(
        f"| {label} | {topo} | {rules_label(topo, rules)} | {variant or '-'} | no | "
        f"{_fmt(need and need / 2**30, '.2f')} | | | | | | {paper or ''} | {at} |"
      )
      continue
    row = (
      f"| {label} | {topo} | {rules_label(topo, rules)} | {variant or '-'} | yes | "
      f"{t['memory']['total_bytes'] / 2**30:.2f} | "
      f"{_fmt(t['memory'].get('peak_bytes') and t['memory']['peak_bytes'] / 2**30, '.2f')} | "
    )
    if "est_steps_per_s" not in t:  # a loop XLA's cost model counts once: no step time (aot_compile)
      what = "the scanned layers" if variant == "scan" else "the mixers' scans"
      lines.append(row + f"n/a (XLA counts a loop body once: {what}) | | | | {paper or ''} | {at} |")
      continue
    step = t["optimal_seconds"]
    ref = base_step.get((topo, rules, variant))
    ratio = f"{step / ref:.2f}" if step and ref else ""
    lines.append(
      row + f"{step * 1e3:.1f} | {t['est_steps_per_s']:.2f} | {ratio} | "
      f"{_fmt(t.get('est_mfu') and 100 * t['est_mfu'], '.1f')}{'%' if t.get('est_mfu') else ''} | "
      f"{paper or ''} | {at} |"
    )
  if missing:
    models = sorted({TPU_MODELS[c[0]][1] for c in missing})
    lines.append(
      f"\n{len(missing)} of {len(tpu_cells())} cells are not measured yet (models: {', '.join(models)}); "
      "`nice -n 19 python scripts/cost_table.py tpu` measures them, in the order of `tpu_cells()`."
    )
  return "\n".join(lines)


def tpu_summary(rows: list[dict]) -> str:
  """Per model and slice, the fastest measured setting that fits (no remat or scan variant unless nothing else
  fits) and its estimated step as a multiple of T5.1.1-base's fastest on that slice, beside the paper's ratio."""
  latest = {tpu_key(r): r for r in rows if "report" in r}
  best: dict = {}
  for (name, topo, rules, variant), r in latest.items():
    t = r["report"]["steps"]["train"]
    if not t["fits"]:
      continue
    step = t.get("optimal_seconds") if "est_steps_per_s" in t else None
    rank = (variant != "", step is None, step or 0.0)  # plain settings first, then any that fits
    if (name, topo) not in best or rank < best[(name, topo)][0]:
      best[(name, topo)] = (rank, step, rules_label(topo, rules) + (f" {variant}" if variant else ""))
  topos = ("v3-8", "v3-32", "v3-128")
  paper_base = TPU_MODELS["t5_1_1_base"][2]
  lines = [
    "| model | "
    + " | ".join(f"{t}: fastest fitting setting, est. step × T5.1.1-base" for t in topos)
    + " | paper: step × T5.1.1-base (v3, 16 chips) |",
    "|---|" + "---|" * len(topos) + "---:|",
  ]
  for name in TPU_MODELS:
    label, paper = TPU_MODELS[name][1], TPU_MODELS[name][2]
    entries = []
    for topo in topos:
      mine, ref = best.get((name, topo)), best.get(("t5_1_1_base", topo))
      measured = any(k[0] == name and k[1] == topo for k in latest)
      if mine is None:
        entries.append("does not fit" if measured else "not measured")
      elif mine[1] is None:
        entries.append(f"{mine[2]}: no estimate (loops)")
      else:
        ratio = f"{mine[1] / ref[1]:.2f}x" if ref and ref[1] else ""
        entries.append(f"{mine[2]}: {mine[1] * 1e3:.1f} ms, {ratio}")
    lines.append(f"| {label} | " + " | ".join(entries) + f" | {f'{paper_base / paper:.2f}x' if paper else ''} |")
  return "\n".join(lines)


CELLS_HEAD = """# TPU cost table: every cell

Written by `python scripts/cost_table.py tpu --render` from `tpu_cost_table.jsonl` (beside this page); the columns
and the settings are explained in [Benchmarks](../benchmarks.md#tpu-compiled-without-a-tpu), which shows the fastest
fitting setting per model and slice.

"""


def tpu_write_doc(rows: list[dict]) -> None:
  CELLS_DOC.write_text(CELLS_HEAD + tpu_render(rows) + "\n")
  write_between(TPU_START, TPU_END, tpu_summary(rows))


def tpu_main(args) -> None:
  rows = load(TPU_JSONL)
  if args.redo:
    rows = [r for r in rows if r["name"] not in args.redo]
    TPU_JSONL.write_text("".join(json.dumps(r) + "\n" for r in rows))
  if not args.render:
    done = {tpu_key(r) for r in rows if "report" in r and r["name"] not in args.again}  # failed cells: tried again
    todo = [
      c
      for c in tpu_cells()
      if c not in done
      and (not args.only or c[0] in args.only.split(","))
      and (not args.topologies or c[1] in args.topologies.split(","))
    ]
    todo.sort(key=lambda c: c[0] not in args.again)  # stable: the models asked for again come first
    measure(todo[: args.limit], tpu_measure, rows, TPU_JSONL, args, lambda: tpu_write_doc(rows))
  tpu_write_doc(rows)


def measure(cells: list[tuple], measure_cell, rows: list[dict], jsonl: Path, args, render) -> None:
  """Each cell compiled (`args.jobs` at a time: XLA's TPU compiler runs mostly on one core, each compile needs
  5-9 GiB of RAM), its row appended to `rows` and `jsonl` and the tables rendered as each lands."""
  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    futures = {pool.submit(measure_cell, *cell, timeout=args.timeout): (i, cell) for i, cell in enumerate(cells)}
    for future in concurrent.futures.as_completed(futures):
      i, cell = futures[future]
      row = future.result()
      with jsonl.open("a") as f:
        f.write(json.dumps(row) + "\n")
      rows.append(row)
      t = row.get("report", {}).get("steps", {}).get("train", {})
      print(
        f"[{i + 1}/{len(cells)}] {' '.join(c for c in cell if c)}: {row.get('wall_seconds')} s, "
        + (
          row.get("error")
          or ("fits" if t.get("fits") else "does not fit")
          + f", {t.get('needs_bytes', 0) / 2**30:.1f} GiB a device, step {t.get('optimal_seconds', '')}"
        ),
        file=sys.stderr,
        flush=True,
      )
      render()


# --- GPUs -------------------------------------------------------------------------------------------------
GPU_JSONL = ROOT / "docs" / "data" / "gpu_cost_table.jsonl"
GPU_START, GPU_END = "<!-- gpu-cost-table:start -->", "<!-- gpu-cost-table:end -->"

GPU_MODELS = {
  "t5_1_1_base": ("models/t5_1_1/base.gin", "T5.1.1-base"),
  "t5_1_1_large": ("models/t5_1_1/large.gin", "T5.1.1-large"),
  "remixer_sbase": ("models/remixer/sbase.gin", "Remixer_SBase"),
  "remixer_base": ("models/remixer/base.gin", "Remixer_Base"),
  "hypermixer_base": ("models/hypermixer/base.gin", "HyperMixer-base"),
  "amlp_base": ("models/amlp/base.gin", "aMLP-base"),
}
GPU_VARIANTS = {"": [], "remat_full": ["--gin.network.T5Config.remat_policy='full'"]}
# (topology, rules, mesh): one GPU; 8 GPUs with the gpu_8 preset's rules (fsdp).
SETUPS = [("h100", "data", "1x1"), ("h100x8", "fsdp", "8x1")]


def gpu_cells() -> list[tuple[str, str, str, str, str]]:
  return [(m, topo, rules, mesh, "") for topo, rules, mesh in SETUPS for m in GPU_MODELS]


def gpu_key(row) -> tuple:
  return (row["name"], row["topology"], row["rules"], row["mesh"], row["variant"])


def gpu_todo(rows: list[dict], redo: list[str]) -> list[tuple]:
  """The cells to compile: those with no row yet, and every cell of the models in `redo`."""
  if unknown := sorted(set(redo) - set(GPU_MODELS)):
    raise SystemExit(f"--redo: unknown model(s) {', '.join(unknown)}; expected some of {', '.join(GPU_MODELS)}")
  done = {gpu_key(r) for r in rows if r["name"] not in redo}
  return [c for c in gpu_cells() if c not in done]


def gpu_measure(name: str, topology: str, rules: str, mesh: str, variant: str, timeout: int) -> dict:
  row = {"name": name, "topology": topology, "rules": rules, "mesh": mesh, "variant": variant}
  return compile_cell(
    row,
    GPU_MODELS[name][0],
    [*GPU_VARIANTS[variant], f"--topology={topology}", f"--mesh={mesh}", f"--rules={rules}"],
    timeout,
  )


def gpu_render(rows: list[dict]) -> str:
  latest = {gpu_key(r): r for r in rows}
  lines = [
    "| model | GPUs | rules (mesh) | variant | fits | GiB/GPU | XLA TFLOP/GPU | model TFLOP/GPU | roofline ms "
    "| est. steps/s | est. MFU | notes | measured at |",
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for cell in gpu_cells():
    name, topo, rules, mesh, variant = cell
    r = latest.get(cell)
    if r is None:
      continue
    at = r["commit"] + (" (+ uncommitted)" if r.get("uncommitted") else "")
    head = f"| {GPU_MODELS[name][1]} | {topo} | {rules} ({mesh}) | {variant or '-'} | "
    if "report" not in r:
      lines.append(head + f"error: {r.get('error', '')[:80]} | | | | | | | | {at} |")
      continue
    t = r["report"]["steps"]["train"]
    need = t.get("needs_bytes")
    if not t["fits"]:
      lines.append(
        head + f"no | {need / 2**30:.1f} | | | | | | needs {need / 2**30:.1f} of "
        f"{t['available_bytes'] / 2**30:.1f} GiB | {at} |"
      )
      continue
    notes = []
    if t.get("loops"):
      notes.append(f"{len(t['loops'])} while loop(s): no step time (a loop body counts once)")
    if t.get("kernel_calls"):
      notes.append(
        f"{t['kernel_calls']} Pallas kernel call(s): no step time (XLA counts neither their FLOPs nor their bytes)"
      )
    if t.get("xla_options"):
      notes.append("cuBLAS GEMMs (Triton found no tiling without autotuning)")
    if t.get("roofline_note"):
      notes.append("roofline on model FLOPs")
    rt = t.get("roofline_seconds")
    mfu = t.get("est_mfu")
    lines.append(
      head + f"yes | {t['memory']['total_bytes'] / 2**30:.1f} | "
      f"{'n/a (cuBLAS)' if t.get('flops_note') else format(t['xla_flops_per_device'] / 1e12, '.1f')} | "
      f"{t['model_flops_per_device'] / 1e12:.1f} | {'' if rt is None else f'{rt * 1e3:.0f}'} | "
      f"{'' if rt is None else f'{1 / rt:.2f}'} | {'' if mfu is None else f'{100 * mfu:.0f}%'} | "
      f"{'; '.join(notes)} | {at} |"
    )
  return "\n".join(lines)


def gpu_main(args) -> None:
  rows = load(GPU_JSONL)
  render = lambda: write_between(GPU_START, GPU_END, gpu_render(rows))
  if not args.render:
    measure(gpu_todo(rows, args.redo), gpu_measure, rows, GPU_JSONL, args, render)
  render()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("platform", choices=("tpu", "gpu"), help="which table")
  p.add_argument("--render", action="store_true", help="only re-render the markdown from the JSON lines")
  p.add_argument(
    "--redo",
    default="",
    help="comma-separated models whose cells are measured again "
    "(tpu: their rows dropped first; gpu: kept, the newest row of a cell is the one rendered)",
  )
  p.add_argument(
    "--timeout",
    type=int,
    help="seconds per compile (default: tpu 7200, at nice 19 on a shared "
    "2-core machine a base model's TPU compile has taken over 30 minutes; gpu 1800)",
  )
  p.add_argument(
    "--again",
    default="",
    help="tpu: comma-separated models measured again first (their rows stay until the new ones land)",
  )
  p.add_argument("--only", help="tpu: comma-separated model names to measure (default: all)")
  p.add_argument("--topologies", help="tpu: comma-separated slices to measure (default: all)")
  p.add_argument("--limit", type=int, help="tpu: measure at most this many cells")
  p.add_argument(
    "--jobs",
    type=int,
    default=1,
    help="compiles at a time (XLA's TPU compiler uses about one core each; 5-9 GiB of RAM each at base size)",
  )
  args = p.parse_args(argv)
  args.redo = [m for m in args.redo.split(",") if m]
  args.again = [m for m in args.again.split(",") if m]
  if args.timeout is None:
    args.timeout = 7200 if args.platform == "tpu" else 1800
  (tpu_main if args.platform == "tpu" else gpu_main)(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
