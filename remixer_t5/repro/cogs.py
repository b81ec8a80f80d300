"""COGS from scratch on a CPU (Kim & Linzen, "COGS", EMNLP 2020; the Remixer paper's §3.4 and Table 4).

For each model (a folder of gin/models/ with a ``cogs.gin``) and seed, ``remixer-t5 train`` trains the model
from scratch on COGS's train split in a subprocess (``models/<model>/cogs.gin`` and ``runs/cogs_scratch.gin``,
its log in ``<out>/runs/<model>-seed<seed>/train.log``); the run's last checkpoint then decodes dev, test and the
generalization file greedily (``evaluation.infer_eval``; with ``--jobs`` > 1 in a child process on the run's
cores, its log in ``<run>/decode.log``), and every split and gen category gets an exact-match score.

The protocol, with its reasons, is docs/reproductions.md's "COGS from scratch": the train split's word vocabulary (task
``cogs_words``); a fixed step budget and the LAST checkpoint, no model selection on dev (Csordás et al. 2021, §3);
Adafactor with T5's inverse-square-root schedule, dropout 0.1, no label smoothing; the model's lengths declared for the
release (``MODEL_LENGTHS``), training rows packed at lengths fixed from the train split (``TRAIN_LENGTHS``), a longer
row refused (``check_lengths``); each split decoded only to its own longest target (``decode_lengths``).

Outputs (``--out DIR``, rewritten after every run; a rerun skips the finished runs): ``cogs.jsonl`` (a row per
model, seed and split or gen category), ``cogs_table.md`` (mean and range over seeds) and ``cogs.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from remixer_t5 import gin_utils, runtime
from remixer_t5.data import word_vocab
from remixer_t5.repro import emitter, ints, mean_range, pyplot
from remixer_t5.tasks import cogs, sources
from remixer_t5.training import checkpoints, evaluation

DEFAULT_MODELS = ("t5_1_1", "remixer", "mixer_encdec", "hypermixer")
LABELS = {
  "t5_1_1": "T5.1.1",
  "remixer": "Remixer",
  "mixer_encdec": "MLP-Mixer enc-dec",
  "hypermixer": "HyperMixer",
  "gmlp": "gMLP",
  "amlp": "aMLP",
  "fnet": "FNet",
  "linear_attention": "Linear attention",
  "mixer_enc": "MLP-Mixer enc",
  "pnlp_mixer": "pNLP-Mixer",
}
TASK = "cogs_words"
SPLITS = ("validation", "test", "gen")
SPLIT_LABELS = {"validation": "dev", "test": "test", "gen": "gen"}
MODEL_FILE = "cogs.gin"
RUN_FILE = "runs/cogs_scratch.gin"
# Steps between a run's checkpoints (the last 3 kept): a run killed without SIGTERM's save
# (a closed terminal, the OOM killer) loses at most this many steps when rerun.
CHECKPOINT_EVERY = 1000

# Published gen exact match (%) the runs are held against (see the module docstring and docs/reproductions.md).
REFERENCES = (
  ("Kim & Linzen 2020 Transformer (9.5M, from scratch)", 35.0),
  ("Csordás et al. 2021 Transformer (relative positions, no early stopping)", 81.0),
)


@dataclasses.dataclass(frozen=True)
class Settings:
  models: tuple[str, ...] = DEFAULT_MODELS
  seeds: tuple[int, ...] = (0, 1, 2)
  # Optimisation steps per run (batch rows of packed examples): far fewer leave T5.1.1 and the Remixer short
  # of generalising (docs/reproductions.md, "How many steps gen needs").
  steps: int = 12000
  batch_size: int = 4  # packed rows per step (~6.4 examples each: ~26 examples per step)
  warmup: int = 300  # rsqrt schedule: base / sqrt(max(step, warmup))
  base_lr: float = 1.0  # rsqrt schedule's base (T5's 1.0): every step's rate scales with it
  cooldown: int = 0  # > 0: the rate decays linearly to 0 over the last `cooldown` steps (optim.py)
  eval_batch_size: int = 250  # examples decoded at once
  gen_file: str | None = None  # None: <data>/cogs/gen.tsv, else gen_sample.tsv
  eval_examples: int | None = None  # first N examples of each split (None: all)

  def __post_init__(self):
    if not self.models:
      raise ValueError("--models: name at least one model (a folder of gin/models/ with cogs.gin)")
    for name in ("steps", "batch_size", "warmup", "eval_batch_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
    if len(set(self.models)) != len(self.models):
      raise ValueError(f"--models must be distinct, got {','.join(self.models)}")
    if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
      raise ValueError(f"--seeds must be distinct non-negative integers, got {self.seeds}")
    if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
      raise ValueError(f"--base_lr must be a positive finite number, got {self.base_lr}")
    if self.cooldown == 1 or not 0 <= self.cooldown <= self.steps:
      raise ValueError(f"--cooldown must be 0 (none) or 2 to --steps ({self.steps}), got {self.cooldown}")
    if self.eval_examples is not None and self.eval_examples <= 0:
      raise ValueError(f"--eval_examples must be positive, got {self.eval_examples}")


# The model's lengths (tokens with EOS, `cogs_words` vocabulary), declared for the COGS release and never measured
# from the files at hand, as they size the fixed-length mixers: RELEASE_LONGEST rounded up to a multiple of 64
# (docs/reproductions.md, "Lengths, declared for the release"). runs/cogs_scratch.gin binds the same values (a test
# holds them equal).
MODEL_LENGTHS = {"inputs": 64, "targets": 576}
# The release's longest input and target (both cp_recursion rows of its 21,000 gen rows); tests hold MODEL_LENGTHS
# to them.
RELEASE_LONGEST = {"inputs": 62, "targets": 539}
# Packed training rows (runs/cogs_scratch.gin's TASK_FEATURE_LENGTHS), fixed from the train split alone: its
# examples average 9.7 input and 44.7 target tokens with EOS, so a row holds ~6.4 of them; its longest example
# (23 / 166) fits a row. A train example longer than a row is refused (check_lengths), never cut.
TRAIN_LENGTHS = {"inputs": 64, "targets": 320}
QUICK = dict(models=("t5_1_1", "remixer"), seeds=(0,), steps=1800)
QUICK_JOBS = 2  # --quick's two runs side by side (jobs_from_args): one small run does not keep 2 cores busy


def model_gin(model: str) -> str:
  """``models/<model>/cogs.gin``; ValueError naming the models that have one when it is missing."""
  if (gin_utils.gin_dir() / "models" / model / MODEL_FILE).is_file():
    return f"models/{model}/{MODEL_FILE}"
  have = sorted(p.parent.name for p in (gin_utils.gin_dir() / "models").glob(f"*/{MODEL_FILE}"))
  raise ValueError(
    f"unknown COGS model {model!r}: gin/models/{model}/{MODEL_FILE} does not exist; models with "
    f"a COGS config: {', '.join(have)}"
  )


# --- data -------------------------------------------------------------------------------------------------
def measure_splits(progress: Callable[[str], None] = print, eval_examples: int | None = None) -> dict:
  """Per split: rows, examples that do not round-trip through the vocabulary, the longest input and target (tokens with
  EOS); the model lengths (`MODEL_LENGTHS`, declared: not measured) and the packed training rows' (`TRAIN_LENGTHS`).
  ValueError naming the file, line, length and limit when a row does not fit (check_lengths). For gen, `categories`
  counts the rows of each category that are decoded (the first `eval_examples` of the file)."""
  vocab = cogs.cogs_word_vocabulary()
  gen = cogs.gen_path()
  out = {
    "gen_file": portable_path(gen),
    "gen_digest": word_vocab.file_digest(gen),
    "vocab_size": int(vocab.vocab_size),
    "splits": {},
  }
  for split in ("train",) + SPLITS:
    path = cogs.split_path(split)
    numbered = cogs.read_cogs_tsv_lines(path)
    rows = [r for _, r in numbered]
    bad = word_vocab.round_trip_failures(vocab, [t for r in rows for t in r[:2]])
    lengths = {
      f: [len(e) + 1 for e in vocab.tokenizer.encode([r[i] for r in rows])]  # with EOS
      for i, f in enumerate(("inputs", "targets"))
    }
    check_lengths(path, split, [n for n, _ in numbered], lengths)
    info = {
      "rows": len(rows),
      "round_trip_failures": len(bad),
      "max_input_tokens": max(lengths["inputs"]),
      "max_target_tokens": max(lengths["targets"]),
      "mean_target_tokens": round(float(np.mean(lengths["targets"])), 1),
    }
    if split == "gen":
      decoded = rows[:eval_examples] if eval_examples else rows
      info["categories"] = {c: sum(r[2] == c for r in decoded) for c in sorted({r[2] for r in decoded})}
    out["splits"][split] = info
    progress(
      f"cogs {SPLIT_LABELS.get(split, split)}: {len(rows)} rows, {len(bad)} do not round-trip, longest "
      f"input {info['max_input_tokens']} and target {info['max_target_tokens']} tokens (with EOS)"
      + (f" [{out['gen_file']}]" if split == "gen" else "")
    )
  out["model_lengths"] = dict(MODEL_LENGTHS)
  out["train_lengths"] = dict(TRAIN_LENGTHS)
  return out


def check_lengths(path: str | os.PathLike, split: str, lines: Sequence[int], lengths: dict[str, list[int]]) -> None:
  """ValueError when a row of `path` (split `split`; `lines[i]` the file line of row i) is longer, in tokens
  with EOS (`lengths[feature][i]`), than the recipe holds: a train row than a packed training row
  (TRAIN_LENGTHS), a row of dev, test or gen than the model (MODEL_LENGTHS). The message names the file, the
  first such line, its length and the limit, and counts the rows that do not fit. The lengths are declared,
  not fitted to the files: seqio would cut such a row short (a wrong target to score or train on), and fitting
  the model to it would make the files at hand change the model."""
  limits, name = (TRAIN_LENGTHS, "TRAIN_LENGTHS") if split == "train" else (MODEL_LENGTHS, "MODEL_LENGTHS")
  over = sorted((i, f) for f in ("inputs", "targets") for i, n in enumerate(lengths[f]) if n > limits[f])
  if not over:
    return
  i, f = over[0]
  what = {"inputs": "input (sentence)", "targets": "target (logical form)"}[f]
  n = len({i for i, _ in over})
  why = (
    "a packed training row's length"
    if split == "train"
    else "the model's length, declared for the full COGS release: it does not follow the evaluation files at hand"
  )
  raise ValueError(
    f"{path}:{lines[i]}: this {SPLIT_LABELS.get(split, split)} row's {what} is {lengths[f][i]} tokens with EOS "
    f"(cogs_words vocabulary), longer than the {limits[f]} of {name}[{f!r}] (remixer_t5/repro/cogs.py), "
    f"{why}; {n} row{'s' * (n > 1)} of this file {'do' if n > 1 else 'does'} not fit. Remove or shorten "
    "such rows (the COGS release has none)."
  )


def portable_path(path: str | os.PathLike) -> str:
  """`path`, absolute, with the data folder written `$REMIXER_T5_DATA_DIR` when it lies inside it (as written,
  or once symbolic links are resolved): settings.json and data.json then name no machine's folders (results
  are committed and resumed elsewhere)."""
  path = Path(path).expanduser()
  root = os.environ.get(sources.DATA_ENV_VAR)
  if root:
    root = Path(root).expanduser()
    for p, r in ((Path(os.path.abspath(path)), Path(os.path.abspath(root))), (path.resolve(), root.resolve())):
      try:
        return f"${sources.DATA_ENV_VAR}/{p.relative_to(r).as_posix()}"
      except ValueError:
        pass
  return str(path.resolve())


def decode_lengths(data: dict, split: str) -> dict:
  """Lengths one split is decoded at: the model's input length, and the split's longest target (with EOS)
  rounded up to 16 as the most tokens decoded. A longer prediction cannot be an exact match (it differs from
  every target at or before the target's EOS), so this changes no score and spares dev and test decoding the
  cache length gen needs (a decode step's cost grows with it)."""
  longest = data["splits"][split]["max_target_tokens"]
  return {
    "inputs": data["model_lengths"]["inputs"],
    "targets": min(data["model_lengths"]["targets"], -(-longest // 16) * 16),
  }


# --- one run ----------------------------------------------------------------------------------------------
def _gin_args(model: str, model_dir: Path, seed: int, settings: Settings, lengths: dict) -> list[str]:
  """The gin flags of `model`'s run: `lengths` the model's (MODEL_LENGTHS; a run folder's recorded ones when it
  is decoded), the training rows packed at TRAIN_LENGTHS whatever they are."""
  return [
    f"--gin_file={model_gin(model)}",
    f"--gin_file={RUN_FILE}",
    f"--gin.MODEL_DIR='{model_dir}'",
    f"--gin.RANDOM_SEED={seed}",
    f"--gin.TRAIN_STEPS={settings.steps}",
    f"--gin.BATCH_SIZE={settings.batch_size}",
    f"--gin.CHECKPOINT_PERIOD={min(settings.steps, CHECKPOINT_EVERY)}",
    "--gin.EVAL_PERIOD=0",
    f"--gin.optim.rsqrt_schedule.warmup_steps={settings.warmup}",
    *([f"--gin.optim.rsqrt_schedule.cooldown_steps={settings.cooldown}"] if settings.cooldown else []),
    *([f"--gin.optim.rsqrt_schedule.base_learning_rate={settings.base_lr!r}"] if settings.base_lr != 1.0 else []),
    f"--gin.MODEL_LENGTHS={json.dumps(lengths)}",
    f"--gin.TASK_FEATURE_LENGTHS={json.dumps(TRAIN_LENGTHS)}",
  ]


def settings_match(path: Path, record: dict) -> bool:
  """Whether the settings.json at `path` records `record`'s settings; a setting the file lacks (a folder made
  before it existed) counts as its default. The gen file is the same when its bytes are (`gen_digest`: the first
  12 hex digits of their sha256), wherever it lies and however `--gen` named it; a folder from before the
  digest was recorded compares the file's name. A folder from before `train_lengths` was recorded packed its
  rows at TRAIN_LENGTHS cut to its model lengths."""
  old, new = json.loads(path.read_text()), json.loads(json.dumps(record))
  for f in dataclasses.fields(Settings):
    old.get("settings", {}).setdefault(f.name, f.default)
  for r in (old, new):
    if "model_lengths" in r and "train_lengths" not in r:
      r["train_lengths"] = {k: min(v, r["model_lengths"][k]) for k, v in TRAIN_LENGTHS.items()}
  old_gen, new_gen = old.pop("gen_file", None), new.pop("gen_file", None)
  new_digest = new.pop("gen_digest", None)
  if "gen_digest" in old:
    same_gen = old.pop("gen_digest") == new_digest
    old["settings"].pop("gen_file", None)  # the --gen flag's spelling: the digest decides
    new["settings"].pop("gen_file", None)
  else:
    same_gen = Path(str(old_gen)).name == Path(str(new_gen)).name
  return same_gen and old == new


def training_seconds(run_dir: Path) -> float | None:
  """Seconds the run's counted steps took, from the trainer's metrics.jsonl: the sum of the train rows' windows,
  each step's row taken from its last writer. A run killed and resumed repeats the steps after its last
  checkpoint; their first try's windows are left out and each start's compile counts once. None when a row
  lacks `window_seconds` (logs written before the trainer recorded it)."""
  windows: dict[int, float | None] = {}
  path = run_dir / "metrics.jsonl"
  for line in path.read_text().splitlines() if path.is_file() else ():
    row = json.loads(line)
    if row.get("split") == "train":
      windows[row["step"]] = row.get("window_seconds")
  if not windows or any(v is None for v in windows.values()):
    return None
  return float(sum(windows.values()))


# The training and decoding subprocesses running now (an interrupted driver stops them: `run`).
_CHILDREN: set = set()


class Interrupted(Exception):
  """Raised in a run's thread at its next progress line once the driver was interrupted (`run`)."""


def _run_child(
  cmd: list[str],
  log_path: Path,
  cpus: Sequence[int] | None,
  progress: Callable[[str], None],
  forward: tuple[str, ...],
  what: str,
) -> None:
  """Runs `cmd` (a remixer-t5 command) in a subprocess, its output appended to `log_path`, lines starting with
  one of `forward` passed to `progress`; `cpus` pins it ($REMIXER_T5_CPUS: the CLI pins itself before any thread
  pool starts, and XLA sizes its pool to them). Stopped (Interrupted at a progress line, Ctrl-C) it gets SIGTERM.
  RuntimeError naming `what` and the log when it fails."""
  with open(log_path, "a") as log:
    log.write("$ " + " ".join(cmd) + "\n")  # a pinned child logs its own cores (the CLI's 'cores:' line)
    log.flush()
    env = {**os.environ, runtime.CPUS_ENV: ",".join(map(str, cpus))} if cpus else os.environ
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _CHILDREN.add(proc)
    try:
      for line in proc.stdout:
        log.write(line)
        if line.startswith(forward):
          progress(line.rstrip())
      code = proc.wait()
    except BaseException:  # stopped: a trainer saves and exits on SIGTERM, a decode just stops
      proc.terminate()
      log.write(proc.communicate()[0])  # drained, so its last lines cannot block on a full pipe
      raise
    finally:
      _CHILDREN.discard(proc)
  if code:
    raise RuntimeError(f"{what} failed (exit {code}): {_last_error(log_path)}; see {log_path}")


def _last_error(log_path: Path) -> str:
  """The cause a failed child printed last: its last 'remixer-t5: error:' line, else its last line."""
  lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith("remixer-t5: error:")]
  last = (errors or lines or ["(no output)"])[-1]
  return last[:300] + ("..." if len(last) > 300 else "")


def train_run(
  model: str,
  seed: int,
  settings: Settings,
  lengths: dict,
  run_dir: Path,
  progress: Callable[[str], None],
  extra_gin: Sequence[str] = (),
  cpus: Sequence[int] | None = None,
) -> float:
  """`remixer-t5 train` in a subprocess (resumes a started run); its output in run_dir/train.log, its
  [train] lines passed to `progress`; `extra_gin` flags come last (they override); `cpus` pins it to those
  cores (_run_child). Returns the seconds it took."""
  run_dir.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "remixer_t5", "train", *_gin_args(model, run_dir, seed, settings, lengths), *extra_gin]
  t0 = time.time()
  _run_child(
    cmd,
    run_dir / "train.log",
    cpus,
    lambda line: progress(f"{model} seed {seed}: {line}"),
    ("[train]", "[validation]", "model:"),
    f"training {model} seed {seed}",
  )
  # A trainer stopped by SIGTERM saves, says so and exits 0: decoding that checkpoint would report a short run.
  ckpt = checkpoints.Checkpointer(run_dir)
  reached = ckpt.latest_step()
  ckpt.close()
  if reached != settings.steps:
    raise RuntimeError(
      f"training {model} seed {seed} stopped at step {reached} of {settings.steps} (preempted?); "
      f"rerun the same command to resume it; see {run_dir}/train.log"
    )
  return time.time() - t0


def evaluate_run(
  model: str,
  seed: int,
  settings: Settings,
  data: dict,
  run_dir: Path,
  progress: Callable[[str], None],
  step: int | None = None,
  splits: Sequence[str] = SPLITS,
) -> dict[str, dict]:
  """Decode `splits` (dev, test and gen) with the run's checkpoint of `step` (None: the last), each at
  `decode_lengths`; {split: {metrics..., stats...}}."""
  lengths = data["model_lengths"]
  flags = _gin_args(model, run_dir, seed, settings, lengths)
  gin_utils.parse_gin(
    [f[len("--gin_file=") :] for f in flags if f.startswith("--gin_file=")],
    [f[len("--gin.") :] for f in flags if f.startswith("--gin.")],
  )
  mdl = gin_utils.macro("MODEL")
  params = checkpoints.restore_any_params(run_dir if step is None else run_dir / "checkpoints" / str(step))
  out = {}
  for split in splits:
    stats: dict = {}
    t0 = time.time()
    decoding = evaluation.Decoding(
      settings.eval_batch_size,
      stats=stats,
      progress=lambda s, sp=split: progress(f"{model} seed {seed} {SPLIT_LABELS[sp]}: {s}"),
    )
    per_task = evaluation.infer_eval(
      mdl,
      params,
      TASK,
      decoding,
      feature_lengths=decode_lengths(data, split),
      split=split,
      num_examples=settings.eval_examples,
      log_dir=str(run_dir / "inference_eval"),
      step=settings.steps if step is None else step,
      lengths_on_purpose=True,
    )
    out[split] = {**per_task[TASK], **stats, "wall_seconds": time.time() - t0}
  return out


DECODE_SPEC, DECODE_RESULT = "decode_spec.json", "decode.json"


def decode_run(
  model: str,
  seed: int,
  settings: Settings,
  data: dict,
  run_dir: Path,
  progress: Callable[[str], None],
  cpus: Sequence[int] | None = None,
  lock: "contextlib.AbstractContextManager | None" = None,
) -> dict[str, dict]:
  """evaluate_run's result for a trained run. Unpinned (`cpus` None: `--jobs 1`, or no affinity support as on
  macOS, where several runs may be unpinned at once) it decodes in this process, holding `lock` (gin's
  configuration is global: one such decode at a time). Pinned, it decodes in a child process on the run's own
  cores (`remixer-t5 repro cogs --decode_spec`, its output in run_dir/decode.log), so runs trained side by side
  also decode side by side: a greedy decode barely gains from a second core, so two at once take about half
  the time of one after the other."""
  if not cpus:
    with lock or contextlib.nullcontext():
      return evaluate_run(model, seed, settings, data, run_dir, progress)
  spec_path, result_path = run_dir / DECODE_SPEC, run_dir / DECODE_RESULT
  run_dir.mkdir(parents=True, exist_ok=True)
  result_path.unlink(missing_ok=True)
  spec = {"model": model, "seed": seed, "settings": dataclasses.asdict(settings), "data": data, "run_dir": str(run_dir)}
  spec_path.write_text(json.dumps(spec))
  cmd = [sys.executable, "-m", "remixer_t5", "repro", "cogs", "--decode_spec", str(spec_path)]
  _run_child(cmd, run_dir / "decode.log", cpus, progress, (f"{model} seed {seed} ",), f"decoding {model} seed {seed}")
  if not result_path.is_file():
    raise RuntimeError(f"decoding {model} seed {seed} wrote no {result_path}; see {run_dir}/decode.log")
  return json.loads(result_path.read_text())


def decode_child(spec_path: Path) -> int:
  """The child side of decode_run: evaluate_run of the spec's run, its progress on stderr, its result written
  to run_dir/decode.json whole (a temporary file renamed) or not at all."""
  spec = json.loads(Path(spec_path).read_text())
  kw = dict(spec["settings"])
  kw["models"], kw["seeds"] = tuple(kw["models"]), tuple(kw["seeds"])
  settings, run_dir = Settings(**kw), Path(spec["run_dir"])
  if settings.gen_file:
    cogs.set_gen_file(settings.gen_file)
  results = evaluate_run(
    spec["model"], spec["seed"], settings, spec["data"], run_dir, lambda s: print(s, file=sys.stderr, flush=True)
  )
  tmp = run_dir / (DECODE_RESULT + ".tmp")
  tmp.write_text(json.dumps(results))
  os.replace(tmp, run_dir / DECODE_RESULT)
  return 0


def category_scores(result: dict) -> dict[str, float]:
  """Exact match (0-1) per gen category of one decoded split's metrics (seqio's `accuracy_<category>`)."""
  return {k[len("accuracy_") :]: v / 100.0 for k, v in result.items() if k.startswith("accuracy_")}


def _rows(
  model: str,
  seed: int,
  params: int,
  settings: Settings,
  results: dict,
  train_seconds: float,
  categories: dict[str, int],
  gen_file: str,
) -> list[dict]:
  rows = []
  for split in SPLITS:
    r = results[split]
    base = {
      "model": model,
      "seed": seed,
      "split": SPLIT_LABELS[split],
      "params": params,
      "train_steps": settings.steps,
      "cooldown_steps": settings.cooldown,
      "base_lr": settings.base_lr,
      "train_seconds": round(train_seconds, 1),
      "seconds": round(r["seconds"], 1),
      "decode_examples_per_s": round(r["examples"] / r["seconds"], 1),
      "decode_tokens_per_s": round(r["tokens"] / r["seconds"], 1),
    }
    if split != "gen":
      rows.append({**base, "category": None, "exact_match": r["exact_match"] / 100.0, "n": r["examples"]})
      continue
    cats = category_scores(r)
    for cat, acc in sorted(cats.items()):
      rows.append({**base, "category": cat, "exact_match": acc, "n": categories.get(cat), "gen_file": gen_file})
    rows.append(
      {
        **base,
        "category": "mean over categories",
        "exact_match": float(np.mean(list(cats.values()))),
        "n": r["examples"],
        "categories": len(cats),
        "gen_file": gen_file,
      }
    )
  return rows


# --- the sweep --------------------------------------------------------------------------------------------
def core_groups(jobs: int) -> list[list[int] | None]:
  """The cores each of `jobs` concurrent trainings is pinned to: this process's cores in `jobs` contiguous
  groups (sizes differ by at most one). One job is not pinned; where affinity cannot be set (macOS), none is.
  ValueError when there are fewer cores than jobs."""
  if jobs < 1:
    raise ValueError(f"--jobs {jobs}: at least 1")
  if jobs == 1 or not hasattr(os, "sched_setaffinity"):
    return [None] * jobs
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < jobs:
    raise ValueError(f"--jobs {jobs}: this process may use {len(cpus)} core(s) ({cpus}); give at most one job per core")
  return [cpus[len(cpus) * k // jobs : len(cpus) * (k + 1) // jobs] for k in range(jobs)]


def _prepare(settings: Settings, out_dir: Path | None, progress: Callable[[str], None]) -> tuple[Path, dict]:
  """(the sweep's folder, the splits' measurements): the gen file set, the models' names and
  the examples' round trips checked, the folder's settings.json written or matched, before anything runs."""
  if settings.gen_file:
    cogs.set_gen_file(settings.gen_file)
    os.environ[cogs.GEN_ENV_VAR] = str(Path(settings.gen_file).expanduser().resolve())  # for the subprocesses
  for m in settings.models:
    model_gin(m)  # unknown names fail before anything runs
  data = measure_splits(progress, settings.eval_examples)
  bad = {s: v["round_trip_failures"] for s, v in data["splits"].items() if v["round_trip_failures"]}
  if bad:
    raise ValueError(f"COGS examples that do not round-trip through the word vocabulary: {bad}")
  lengths = data["model_lengths"]
  progress(f"model lengths {lengths} (declared for the COGS release), training rows packed at {TRAIN_LENGTHS}")
  work = Path(out_dir) if out_dir is not None else Path(os.environ.get("TMPDIR", "/tmp")) / "remixer_t5_cogs"
  work.mkdir(parents=True, exist_ok=True)
  record = {
    "settings": dataclasses.asdict(settings) | {"models": None, "seeds": None},
    "gen_file": data["gen_file"],
    "gen_digest": data["gen_digest"],
    "model_lengths": lengths,
    "train_lengths": dict(TRAIN_LENGTHS),
  }
  if settings.gen_file:
    record["settings"]["gen_file"] = portable_path(settings.gen_file)
  settings_path = work / "settings.json"
  if settings_path.exists():
    if not settings_match(settings_path, record):
      old = json.loads(settings_path.read_text())
      raise ValueError(
        f"{work} holds runs made with other settings ({settings_path}); use another --out "
        f"or remove it.\n  there: {json.dumps(old)}\n  now:   {json.dumps(record)}"
      )
  else:
    settings_path.write_text(json.dumps(record, indent=2))
  (work / "data.json").write_text(json.dumps(data, indent=2))
  return work, data


def _kept_and_todo(
  work: Path, settings: Settings, progress: Callable[[str], None], emit: Callable[[dict], None]
) -> tuple[list[dict], list[tuple[int, str, int]]]:
  """(the rows of runs finished before, emitted again; the (index, model, seed) runs still to do)."""
  results_path = work / "cogs.jsonl"
  records = [json.loads(line) for line in results_path.read_text().splitlines()] if results_path.exists() else []
  done = {(r["model"], r["seed"]) for r in records}
  total = len(settings.models) * len(settings.seeds)
  todo = []
  for i, (seed, model) in enumerate(itertools.product(settings.seeds, settings.models), start=1):
    if (model, seed) in done:
      progress(f"[{i}/{total}] {model} seed {seed}: done before, kept")
      for r in records:
        if (r["model"], r["seed"]) == (model, seed):
          emit(r)
    else:
      todo.append((i, model, seed))
  return records, todo


def _stop_all(stop, futures) -> None:
  """Interrupted: no run starts; a decode stops at its next batch (its progress line), a training's reader at its
  next line; each training child gets SIGTERM (the trainer saves a checkpoint and exits; a rerun resumes it)."""
  stop.set()
  for f in futures:
    f.cancel()
  for proc in list(_CHILDREN):
    proc.terminate()


def _train_and_decode(
  label: str,
  model: str,
  seed: int,
  settings: Settings,
  data: dict,
  run_dir: Path,
  cpus: Sequence[int] | None,
  lock,
  progress: Callable[[str], None],
) -> tuple[float, dict]:
  """One run on `cpus`: train (or resume) it, then decode it; (its training seconds over all its starts,
  decode_run's results)."""
  on = f" on cores {','.join(map(str, cpus))}" if cpus else ""
  progress(f"{label}: training {settings.steps} steps in {run_dir}{on}")
  train_seconds = train_run(model, seed, settings, data["model_lengths"], run_dir, progress, cpus=cpus)
  train_seconds = training_seconds(run_dir) or train_seconds  # all starts of a resumed run
  progress(f"{label}: decoding{on}")  # and where an interrupted driver stops it
  return train_seconds, decode_run(model, seed, settings, data, run_dir, progress, cpus, lock)


def _eta(took: Sequence[float], started: dict, ended: dict, runs: int, jobs: int) -> float:
  """eta_seconds of a sweep of `runs` runs, `started` and `ended` saying when each run took and gave back its
  cores. Snapshots (the runs' threads write both), ended's first, so every run is counted exactly once: done,
  running (begun, not ended) or queued (not begun)."""
  ends, begun = dict(ended), dict(started)
  now = time.time()
  running = [now - t for k, t in begun.items() if k not in ends]
  return eta_seconds(float(np.mean(took)), running, runs - len(begun), jobs)


def run(
  settings: Settings,
  out_dir: Path | None,
  *,
  emit: Callable[[dict], None] = lambda r: None,
  progress: Callable[[str], None] = lambda s: None,
  jobs: int = 1,
) -> list[dict]:
  """Every model x seed: train (or resume), decode, score; outputs rewritten after every run.

  `jobs` > 1 trains that many runs at once, each pinned to its share of the cores (core_groups), which it keeps
  while it decodes (decode_run); rows then come in the order runs finish and carry `jobs`. Such a run is not
  bit-identical to the same run with `jobs` 1 (XLA splits its sums differently over fewer threads). A run that
  fails does not stop the others; the failures are raised together at the end. Interrupted (Ctrl-C), the runs
  stop as `_stop_all` says; rerunning the command resumes them."""
  groups = core_groups(jobs)
  work, data = _prepare(settings, out_dir, progress)
  records, todo = _kept_and_todo(work, settings, progress, emit)
  total = len(settings.models) * len(settings.seeds)
  if 0 < len(todo) < jobs:  # fewer runs left than jobs: each keeps all of its share, none gets a split meant for more
    jobs = len(todo)
    groups = core_groups(jobs)
  free, decoding, stop = queue.Queue(), threading.Lock(), threading.Event()
  for g in groups:
    free.put(g)

  def said(text: str) -> None:  # a run's progress; where it stops once the driver is interrupted
    if stop.is_set():
      raise Interrupted(text)
    progress(text)

  def one(i: int, model: str, seed: int) -> tuple[float, dict]:
    cpus = free.get()
    started[(model, seed)] = time.time()
    try:
      return _train_and_decode(
        f"[{i}/{total}] {model} seed {seed}",
        model,
        seed,
        settings,
        data,
        work / "runs" / f"{model}-seed{seed}",
        cpus,
        decoding,
        said,
      )
    finally:
      ended[(model, seed)] = time.time()  # before its cores go to the next run (the ETA's bookkeeping)
      free.put(cpus)

  # The ETA's bookkeeping: when each run took its cores and gave them back (written by the runs' threads);
  # took: seconds each finished run took, start to scores.
  failed, started, ended, took = [], {}, {}, []
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    futures = {pool.submit(one, *t): t for t in todo}
    try:
      for fut in concurrent.futures.as_completed(futures):
        i, model, seed = futures[fut]
        try:
          train_seconds, results = fut.result()
        except Exception as e:  # noqa: BLE001 - the other runs go on; all failures are raised at the end
          failed.append(f"{model} seed {seed}: {e}")
          progress(f"[{i}/{total}] {model} seed {seed} FAILED: {e}")
          continue
        params = _param_count(work / "runs" / f"{model}-seed{seed}")
        new = _rows(
          model,
          seed,
          params,
          settings,
          results,
          train_seconds,
          data["splits"]["gen"]["categories"],
          Path(data["gen_file"]).name,
        )
        records += new
        for r in new:
          r["jobs"] = jobs  # runs trained at once: train seconds and decode speeds shared the cores
          emit(r)
        decode_seconds = sum(r["seconds"] for r in results.values())
        took.append(run_cost(ended[(model, seed)] - started[(model, seed)], train_seconds, decode_seconds))
        eta = _eta(took, started, ended, len(todo), jobs)
        progress(
          f"[{i}/{total}] {model} seed {seed}: test {results['test']['exact_match']:.1f}%, gen mean "
          f"{new[-1]['exact_match'] * 100:.1f}% (train {train_seconds:.0f}s, decode "
          f"{decode_seconds:.0f}s); ETA {eta / 60:.0f} min"
        )
        _write_outputs(work, records)
    except BaseException:  # Ctrl-C: runs not started stay unstarted, running ones stop (their checkpoints kept)
      _stop_all(stop, futures)
      raise
  if failed or out_dir is not None:
    _write_outputs(work, records)
  if failed:
    raise RuntimeError(
      f"{len(failed)} of {len(todo)} runs failed (the others' rows are written):\n  " + "\n  ".join(failed)
    )
  return records


def run_cost(wall_seconds: float, train_seconds: float, decode_seconds: float) -> float:
  """Seconds a finished run stands for in the ETA: what a run from scratch takes. A run this driver resumed
  spent only its last stretch here (a resumed run that had finished training: its decode alone), so its
  training over all its starts counts instead; a fresh run's wall time also holds its start-up."""
  return max(wall_seconds, train_seconds + decode_seconds)


def eta_seconds(run_seconds: float, running: Sequence[float], queued: int, jobs: int) -> float:
  """Seconds until a sweep ends if every run takes `run_seconds` (the finished runs' mean): the runs in flight,
  `running` seconds into theirs, end when that is up; each of `queued` runs not started takes the first of the
  `jobs` slots to free."""
  slots = [max(0.0, run_seconds - r) for r in running] + [0.0] * max(0, jobs - len(running))
  heapq.heapify(slots)
  for _ in range(queued):
    heapq.heappush(slots, heapq.heappop(slots) + run_seconds)
  return max(slots, default=0.0)


def _param_count(run_dir: Path) -> int:
  """Parameters of the run, from the trainer's log line ('model: 1,115,904 params | ...')."""
  for line in (run_dir / "train.log").read_text().splitlines():
    if line.startswith("model: ") and " params " in line:
      return int(line.split()[1].replace(",", ""))
  raise ValueError(f"no parameter count in {run_dir}/train.log")


def _write_outputs(out_dir: Path, records: Sequence[dict]) -> None:
  tmp = out_dir / "cogs.jsonl.tmp"
  tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
  tmp.replace(out_dir / "cogs.jsonl")
  (out_dir / "cogs_table.md").write_text(markdown_table(records))
  plot(records, out_dir / "cogs.png")


# --- tables and figures -----------------------------------------------------------------------------------
def _columns(records: Sequence[dict]) -> list[tuple[str, str | None]]:
  cats = sorted({r["category"] for r in records if r["split"] == "gen" and r["category"] != "mean over categories"})
  return [("dev", None), ("test", None), ("gen", "mean over categories")] + [("gen", c) for c in cats]


def _by_model(records: Sequence[dict]) -> dict[str, dict]:
  """{model: {(split, category): rows}}, the known models (LABELS) in their order first, then the others."""
  order = DEFAULT_MODELS + tuple(LABELS)
  by: dict[str, dict] = {}
  for r in sorted(records, key=lambda r: order.index(r["model"]) if r["model"] in order else len(order)):
    by.setdefault(r["model"], {}).setdefault((r["split"], r["category"]), []).append(r)
  return by


def _steps_cell(row: dict) -> str:
  cooldown = row.get("cooldown_steps") or 0  # rows written before --cooldown existed lack it
  base_lr = row.get("base_lr", 1.0)  # likewise --base_lr
  return (
    f"{row['train_steps']}"
    + (f" (cooldown {cooldown})" if cooldown else "")
    + (f" (base lr {base_lr:g})" if base_lr != 1.0 else "")
  )


def markdown_table(records: Sequence[dict]) -> str:
  """Exact match (%) per model: mean over seeds (min-max), per split and gen category; decode speed."""
  cols = _columns(records)
  head = (
    ["model", "params", "seeds", "steps"]
    + [("gen mean" if c == "mean over categories" else f"gen: {c}") if s == "gen" else s for s, c in cols]
    + ["decode ex/s", "decode tok/s", "train s"]
  )
  lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for m, cells in _by_model(records).items():
    any_rows = [r for rows in cells.values() for r in rows]
    seeds = sorted({r["seed"] for r in any_rows})
    gen_rows = cells.get(("gen", "mean over categories"), [])
    speed = lambda k: f"{np.mean([r[k] for r in gen_rows]):.0f}" if gen_rows else "-"
    lines.append(
      "| "
      + " | ".join(
        [LABELS.get(m, m), f"{any_rows[0]['params']:,}", str(len(seeds)), _steps_cell(any_rows[0])]
        + [mean_range([100 * r["exact_match"] for r in cells.get(c, [])], 1) for c in cols]
        + [speed("decode_examples_per_s"), speed("decode_tokens_per_s"), speed("train_seconds")]
      )
      + " |"
    )
  gen_file = next((r.get("gen_file") for r in records if r.get("gen_file")), None)
  notes = [
    "",
    "Exact match in %, mean over seeds (min-max). 'gen mean' is the mean over the gen categories "
    f"present ({gen_file or 'no gen file'}); decode speeds are greedy decoding of gen with the cache.",
    "Published gen exact match: " + "; ".join(f"{name}: {v:.0f}%" for name, v in REFERENCES) + ".",
  ]
  return "\n".join(lines + notes) + "\n"


def plot(records: Sequence[dict], path: Path) -> None:
  """Bars: exact match per split / gen category (x) and model (colour), mean over seeds with min-max ticks."""
  plt, save_png = pyplot()
  cols = _columns(records)
  by = _by_model(records)
  models = list(by)
  fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(cols) + 2), 4.2))
  width = 0.8 / max(len(models), 1)
  x = np.arange(len(cols))
  for k, m in enumerate(models):
    n = len({r["seed"] for c in by[m].values() for r in c})
    vals = [[100 * r["exact_match"] for r in by[m].get(c, [])] or [np.nan] for c in cols]
    mean = [np.mean(v) for v in vals]
    lo, hi = [mu - np.min(v) for mu, v in zip(mean, vals)], [np.max(v) - mu for mu, v in zip(mean, vals)]
    bars = ax.bar(
      x + (k - (len(models) - 1) / 2) * width,
      mean,
      width,
      yerr=[lo, hi],
      capsize=2,
      label=f"{LABELS.get(m, m)} ({n} seed{'s' * (n > 1)})",
    )
    ax.bar_label(bars, labels=["" if np.isnan(v) else f"{v:.0f}" for v in mean], fontsize=6, padding=1)
  for name, v in REFERENCES:
    ax.axhline(v, ls="--", lw=0.8, color="grey")
    ax.text(len(cols) - 0.5, v + 1, name.split(" (")[0] + " gen", fontsize=6, ha="right", color="grey")
  ax.set_xticks(x)
  ax.set_xticklabels(
    [("gen mean" if c == "mean over categories" else c) if s == "gen" else s for s, c in cols],
    rotation=20,
    ha="right",
    fontsize=8,
  )
  ax.set_ylabel("exact match (%)")
  ax.set_ylim(0, 105)
  ax.set_title("COGS from scratch (mean over each model's seeds; bars: min-max)", fontsize=10)
  ax.legend(fontsize=7, loc="lower left")
  ax.grid(True, axis="y", alpha=0.3)
  fig.tight_layout()
  save_png(fig, path, dpi=110)


# --- command line -----------------------------------------------------------------------------------------
def add_arguments(p) -> None:
  p.add_argument(
    "--quick",
    action="store_true",
    help=f"T5.1.1 and the Remixer, 1 seed, {QUICK['steps']} steps; trained side by side where there are 2 "
    "cores or more (Linux), each run decoded on its own cores (its time: docs/reproductions.md)",
  )
  p.add_argument(
    "--models", help=f"comma-separated folders of gin/models/ with {MODEL_FILE} (default: {','.join(DEFAULT_MODELS)})"
  )
  p.add_argument("--seeds", help="a count N (seeds 0..N-1) or comma-separated seeds, e.g. 3,4 (default 3)")
  p.add_argument("--steps", type=int, help=f"training steps per run (default {Settings.steps})")
  p.add_argument("--batch_size", "--batch-size", type=int, help=f"packed rows per step (default {Settings.batch_size})")
  p.add_argument("--warmup", type=int, help=f"rsqrt schedule warm-up steps (default {Settings.warmup})")
  p.add_argument(
    "--base_lr",
    "--base-lr",
    type=float,
    help=f"base of the rsqrt schedule, base / sqrt(max(step, warmup)) (default {Settings.base_lr}: T5's)",
  )
  p.add_argument(
    "--cooldown",
    type=int,
    help="end each run with a linear decay of the rate over its last N steps, "
    "to 1/N of it at the last update (default 0: T5's rsqrt schedule to the end)",
  )
  p.add_argument(
    "--eval_batch_size",
    "--eval-batch-size",
    type=int,
    help=f"examples decoded at once (default {Settings.eval_batch_size})",
  )
  p.add_argument("--eval_examples", "--eval-examples", type=int, help="decode only the first N of each split")
  p.add_argument(
    "--gen",
    help="the gen file (default: <data>/cogs/gen.tsv, else gen_sample.tsv); it is scored, "
    "never trained on: a row longer than the model's declared lengths "
    f"({MODEL_LENGTHS['inputs']} / {MODEL_LENGTHS['targets']} tokens) is an error",
  )
  p.add_argument("--data_dir", "--data-dir", help="folder holding cogs/ (default: $REMIXER_T5_DATA_DIR)")
  p.add_argument("--json", action="store_true", help="one JSON line per model, seed and split or gen category")
  p.add_argument("--out", help="directory for cogs.jsonl, cogs_table.md, cogs.png and the runs (resumable)")
  p.add_argument(
    "--jobs",
    type=int,
    help="runs trained at once, each pinned to its share of the cores (default 1; with --quick 2 "
    "where this process may use 2 cores or more, on Linux); never more than the runs left to train; "
    "rows come in the order runs finish. A run on fewer "
    "cores sums in another order, so its numbers are not bit-identical to --jobs 1's (as between "
    "machines)",
  )
  p.add_argument("--decode_spec", help=argparse.SUPPRESS)  # decode_run's child process (internal)


def jobs_from_args(args) -> int:
  """--jobs as given; unset, QUICK_JOBS for --quick where this process may use that many cores and can pin its
  runs to them (Linux), else 1. `run` lowers it to the number of runs left to train. On 2 cores --quick fits its
  15-minute budget only side by side (docs/reproductions.md, "Results: `--quick`")."""
  if args.jobs is not None:
    return args.jobs
  if not args.quick or not hasattr(os, "sched_setaffinity"):  # unpinned side by side (macOS): never measured
    return 1
  return QUICK_JOBS if len(os.sched_getaffinity(0)) >= QUICK_JOBS else 1


def settings_from_args(args) -> Settings:
  kw: dict = dict(QUICK) if args.quick else {}
  if args.models:
    kw["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
  if args.seeds:
    vals = ints(args.seeds, "seeds")
    if len(vals) == 1 and "," not in args.seeds and vals[0] < 1:
      raise ValueError(
        f"--seeds {args.seeds}: a single number is a count of seeds (0..N-1) and must be at least "
        "1; to run seed 0 alone pass --seeds 1, other seeds as a list, e.g. --seeds 2,3"
      )
    kw["seeds"] = tuple(range(vals[0])) if len(vals) == 1 and "," not in args.seeds else vals
  for arg in ("steps", "batch_size", "warmup", "base_lr", "cooldown", "eval_batch_size", "eval_examples"):
    if getattr(args, arg) is not None:
      kw[arg] = getattr(args, arg)
  if args.gen:
    kw["gen_file"] = args.gen
  return Settings(**kw)


def main(args) -> int:
  if args.decode_spec:  # decode_run's child: one run's decode on the cores it was pinned to
    return decode_child(Path(args.decode_spec))
  settings = settings_from_args(args)
  if args.data_dir:
    os.environ[sources.DATA_ENV_VAR] = str(Path(args.data_dir).expanduser().resolve())  # the runs read it too
  out = Path(args.out) if args.out else None
  progress = lambda s: (sys.stderr.write(s + "\n"), sys.stderr.flush())  # one write: runs' lines don't interleave
  progress(f"repro cogs: {json.dumps(dataclasses.asdict(settings))}")
  jobs = jobs_from_args(args)
  if args.jobs is None and jobs > 1:
    progress(
      f"repro cogs: --quick trains {jobs} runs at a time, each pinned to its share of the cores (--jobs "
      f"{jobs}; --jobs 1 for one after the other)"
    )
  records = run(settings, out, emit=emitter(args.json), progress=progress, jobs=jobs)
  if not args.json:
    print(markdown_table(records), end="")
  if out is not None:
    progress(f"wrote {out}/cogs.jsonl, cogs_table.md, cogs.png")
  return 0
