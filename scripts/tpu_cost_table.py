"""The TPU cost table of docs/benchmarks.md: every base model compiled ahead of time for v3 slices.

Each cell is one `remixer-t5 compile ... --json` (remixer_t5/aot_compile.py) in its own process, run one at a
time (a base-size compile takes minutes and 7-9 GiB of RAM on a CPU): pretraining settings (runs/pretrain.gin:
batch 128, lengths 512/114, Adafactor) with bfloat16 activations, for each model, slice, rule set and memory
variant. Results are appended as JSON lines to docs/data/tpu_cost_table.jsonl, so an interrupted run resumes where
it stopped; `--render` writes the summary (the fastest fitting setting per model and slice) into docs/benchmarks.md
between its markers and every cell into docs/data/tpu_cost_table.md. Every row records
the git commit it was measured at and which model files had uncommitted changes then.

  nice -n 19 python scripts/tpu_cost_table.py            # measure what is missing, v3-32 first, then render
  python scripts/tpu_cost_table.py --render               # only re-render the markdown
  python scripts/tpu_cost_table.py --redo remixer_base    # drop a model's rows and measure them again
  python scripts/tpu_cost_table.py --again remixer_base   # measure a model's cells again first (after a change)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSONL = ROOT / "docs" / "data" / "tpu_cost_table.jsonl"
DOC = ROOT / "docs" / "benchmarks.md"
CELLS_DOC = ROOT / "docs" / "data" / "tpu_cost_table.md"  # every cell; DOC holds the summary
START, END = "<!-- tpu-cost-table:start -->", "<!-- tpu-cost-table:end -->"

# name -> (gin file, label, the Remixer paper's Table 1 steps/s on 16 v3 chips, or None)
MODELS = {
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
VARIANTS = {"": [], "remat_full": ["--gin.network.T5Config.remat_policy='full'"],
            "scan": ["--gin.network.T5Config.scan_layers=True"]}
BIG = ["t5_1_1_large", "t5_1_1_xl"]
CONTROLS = ["t5_1_1_sbase_layout"]
BASE = [m for m in MODELS if m not in BIG + CONTROLS]


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
    ("t5_1_1_base", "v3-8", "fsdp", ""), ("t5_1_1_base", "v3-8", "data_model", ""), ("t5_1_1_base", "v3-8", "data", ""),
    ("t5_1_1_base", "v3-128", "fsdp", ""), ("t5_1_1_base", "v3-128", "fsdp_model", ""),
    ("t5_1_1_base", "v3-128", "data_model", ""),
    ("t5_1_1_large", "v3-8", "fsdp", ""), ("t5_1_1_large", "v3-32", "fsdp", ""), ("t5_1_1_large", "v3-128", "fsdp", ""),
    ("t5_1_1_large", "v3-8", "fsdp", "remat_full"),
    ("t5_1_1_xl", "v3-32", "fsdp", ""), ("t5_1_1_xl", "v3-128", "fsdp", ""),
    ("t5_1_1_large", "v3-32", "data_model", ""), ("t5_1_1_large", "v3-128", "fsdp_model", ""),
    ("t5_1_1_xl", "v3-32", "data_model", ""), ("t5_1_1_xl", "v3-128", "fsdp_model", ""),
    ("t5_1_1_xl", "v3-8", "fsdp", "remat_full"), ("t5_1_1_large", "v3-8", "data_model", ""),
    ("t5_1_1_xl", "v3-8", "fsdp", ""),
]


def cells() -> list[tuple[str, str, str, str]]:
  """(model, topology, rules, variant) in the order they are measured: the paper's v3-32 comparison first, then
  the cells that choose the tpu_v3_* presets, then every architecture under those presets' rules (fsdp) on v3-8
  and v3-128 and under data_model on v3-32, then T5.1.1's remaining settings, then every other cell, then the
  controls (under the presets' rules)."""
  first = ["t5_1_1_base", "remixer_sbase", "remixer_base"]
  out = [(m, "v3-32", "fsdp", "") for m in first] + [("t5_1_1_base", "v3-32", "data_model", "")]
  out += [(m, "v3-32", "fsdp", "") for m in BASE if m not in first]
  out += PRESET_CELLS
  for topo in ("v3-8", "v3-128"):   # every architecture under each slice's preset rules
    out += [(m, topo, "fsdp", "") for m in BASE]
  out += [(m, "v3-32", "data_model", "") for m in BASE]
  for topo in ("v3-8", "v3-32", "v3-128"):   # the rest of T5.1.1's settings
    for m in T5_SIZES:
      for rules in ("fsdp", "data_model", "data", "fsdp_model"):
        out.append((m, topo, rules, ""))
      for variant in ("remat_full", "scan"):
        out.append((m, topo, "fsdp", variant))
  for topo in ("v3-32", "v3-8", "v3-128"):   # every architecture
    for rules in ("data_model", "fsdp", "data"):
      out += [(m, topo, rules, "") for m in BASE]
  out += [(m, topo, "fsdp", "") for m in CONTROLS for topo in ("v3-32", "v3-8", "v3-128")]
  seen: set = set()
  return [c for c in out if not (c in seen or seen.add(c))]


def key(row) -> tuple:
  return (row["name"], row["topology"], row["rules"], row["variant"])


def load() -> list[dict]:
  if not JSONL.exists():
    return []
  return [json.loads(line) for line in JSONL.read_text().splitlines() if line.strip()]


def git_state() -> dict:
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  dirty = subprocess.run(["git", "status", "--porcelain", "--", "remixer_t5", "gin"], cwd=ROOT,
                         capture_output=True, text=True).stdout.split("\n")
  return {"commit": commit, "uncommitted": sorted(line[3:] for line in dirty if line.strip())}


def measure(name: str, topology: str, rules: str, variant: str, timeout: int) -> dict:
  gin_file, _, _ = MODELS[name]
  cmd = [sys.executable, "-m", "remixer_t5.cli", "compile", f"--gin_file={gin_file}",
         "--gin_file=runs/pretrain.gin", "--gin.ACTIVATION_DTYPE='bfloat16'", *VARIANTS[variant],
         f"--topology={topology}", f"--mesh={mesh_for(topology, rules)}", f"--rules={RULES[rules][0]}", "--json"]
  row = {"name": name, "topology": topology, "rules": rules, "variant": variant, **git_state(),
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    row["error"] = f"compile did not finish in {timeout} s"
    return row
  row["wall_seconds"] = round(time.time() - t0, 1)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if not lines:
    row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]
    return row
  report = json.loads(lines[-1])
  row["report"] = report
  return row


def _fmt(x, spec):
  return "" if x is None else format(x, spec)


def render(rows: list[dict]) -> str:
  latest = {key(r): r for r in rows}
  base_step = {(r["topology"], r["rules"], r["variant"]): r["report"]["steps"]["train"].get("optimal_seconds")
               for r in latest.values() if r["name"] == "t5_1_1_base" and "report" in r
               and r["report"]["steps"]["train"]["fits"]}
  head = ("| model | slice | rules (mesh) | variant | fits | GiB/core | peak GiB | est. step ms | est. steps/s | × T5.1.1-base step "
          "| est. MFU | paper steps/s (16 v3 chips) | measured at |\n"
          "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
  lines = [head]
  missing: list = []
  for cell in cells():
    name, topo, rules, variant = cell
    label, paper = MODELS[name][1], (MODELS[name][2] if topo == "v3-32" else None)
    r = latest.get(cell)
    if r is None:
      missing.append(cell)
      continue
    at = r["commit"] + (" (+ uncommitted: " + ", ".join(Path(p).name for p in r["uncommitted"]) + ")"
                        if r.get("uncommitted") else "")
    if "report" not in r:
      lines.append(f"| {label} | {topo} | {rules_label(topo, rules)} | {variant or '-'} | error: {r.get('error', '')[:80]} | | | | | | | "
                   f"{paper or ''} | {at} |")
      continue
    t = r["report"]["steps"]["train"]
    if not t["fits"]:
      need = t.get("needs_bytes")
      lines.append(f"| {label} | {topo} | {rules_label(topo, rules)} | {variant or '-'} | no | "
                   f"{_fmt(need and need / 2 ** 30, '.2f')} | | | | | | {paper or ''} | {at} |")
      continue
    row = f"| {label} | {topo} | {rules_label(topo, rules)} | {variant or '-'} | yes | " \
          f"{t['memory']['total_bytes'] / 2 ** 30:.2f} | " \
          f"{_fmt(t['memory'].get('peak_bytes') and t['memory']['peak_bytes'] / 2 ** 30, '.2f')} | "
    if "est_steps_per_s" not in t:  # a loop XLA's cost model counts once: no step time (aot_compile)
      what = "the scanned layers" if variant == "scan" else "the mixers' scans"
      lines.append(row + f"n/a (XLA counts a loop body once: {what}) | | | | {paper or ''} | {at} |")
      continue
    step = t["optimal_seconds"]
    ref = base_step.get((topo, rules, variant))
    ratio = f"{step / ref:.2f}" if step and ref else ""
    lines.append(row + f"{step * 1e3:.1f} | {t['est_steps_per_s']:.2f} | {ratio} | "
                 f"{_fmt(t.get('est_mfu') and 100 * t['est_mfu'], '.1f')}{'%' if t.get('est_mfu') else ''} | "
                 f"{paper or ''} | {at} |")
  if missing:
    models = sorted({MODELS[c[0]][1] for c in missing})
    lines.append(f"\n{len(missing)} of {len(cells())} cells are not measured yet (models: {', '.join(models)}); "
                 "`nice -n 19 python scripts/tpu_cost_table.py` measures them, in the order of `cells()`.")
  return "\n".join(lines)


def summary(rows: list[dict]) -> str:
  """Per model and slice, the fastest measured setting that fits (no remat or scan variant unless nothing else
  fits) and its estimated step as a multiple of T5.1.1-base's fastest on that slice, beside the paper's ratio."""
  latest = {key(r): r for r in rows if "report" in r}
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
  paper_base = MODELS["t5_1_1_base"][2]
  lines = ["| model | " + " | ".join(f"{t}: fastest fitting setting, est. step × T5.1.1-base" for t in topos)
           + " | paper: step × T5.1.1-base (v3, 16 chips) |", "|---|" + "---|" * len(topos) + "---:|"]
  for name in MODELS:
    label, paper = MODELS[name][1], MODELS[name][2]
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

Written by `python scripts/tpu_cost_table.py --render` from `tpu_cost_table.jsonl` (beside this page); the columns
and the settings are explained in [Benchmarks](../benchmarks.md#tpu-compiled-without-a-tpu), which shows the fastest
fitting setting per model and slice.

"""


def write_doc(rows: list[dict]) -> None:
  CELLS_DOC.write_text(CELLS_HEAD + render(rows) + "\n")
  table = summary(rows)
  text = DOC.read_text()
  if START not in text:
    raise SystemExit(f"{DOC} has no {START} marker: add the section first")
  before, rest = text.split(START, 1)
  _, after = rest.split(END, 1)
  DOC.write_text(before + START + "\n" + table + "\n" + END + after)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--render", action="store_true", help="only render docs/benchmarks.md and docs/data/tpu_cost_table.md from the JSON lines")
  p.add_argument("--redo", nargs="*", default=[], help="model names whose rows are measured again")
  p.add_argument("--again", nargs="*", default=[], help="model names measured again first (their rows stay "
                 "until the new ones land; the newest row of a cell is the one rendered)")
  p.add_argument("--only", help="comma-separated model names to measure (default: all)")
  p.add_argument("--topologies", help="comma-separated slices to measure (default: all)")
  p.add_argument("--limit", type=int, help="measure at most this many cells")
  p.add_argument("--jobs", type=int, default=1, help="compiles at a time (XLA's TPU compiler uses about one core "
                 "each, and 5-9 GiB of RAM at base size)")
  p.add_argument("--timeout", type=int, default=7200, help="seconds per compile (on a shared 2-core machine at "
                 "nice 19 a base model's compile has taken over 30 minutes)")
  args = p.parse_args(argv)
  rows = load()
  if args.redo:
    rows = [r for r in rows if r["name"] not in args.redo]
    JSONL.write_text("".join(json.dumps(r) + "\n" for r in rows))
  if not args.render:
    done = {key(r) for r in rows if "report" in r and r["name"] not in args.again}  # failed cells: tried again
    todo = [c for c in cells() if c not in done
            and (not args.only or c[0] in args.only.split(","))
            and (not args.topologies or c[1] in args.topologies.split(","))]
    todo.sort(key=lambda c: c[0] not in args.again)  # stable: the models asked for again come first
    todo = todo[:args.limit]
    # XLA's TPU compiler runs mostly on one core: --jobs 2 keeps two compiles going (each needs 5-9 GiB of RAM).
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
      futures = {}
      for i, cell in enumerate(todo):
        futures[pool.submit(measure, *cell, timeout=args.timeout)] = (i, cell)
      for future in concurrent.futures.as_completed(futures):
        i, cell = futures[future]
        row = future.result()
        with JSONL.open("a") as f:
          f.write(json.dumps(row) + "\n")
        rows.append(row)
        t = row.get("report", {}).get("steps", {}).get("train", {})
        print(f"[{i + 1}/{len(todo)}] {cell} -> {row.get('error') or ('fits' if t.get('fits') else 'does not fit')} "
              f"{t.get('optimal_seconds', '')} ({row.get('wall_seconds')} s)", file=sys.stderr, flush=True)
        write_doc(rows)
  write_doc(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
