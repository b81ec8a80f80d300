"""`remixer-t5 sweep`: a study, not a run: every point of a grid of gin settings, at each seed, trained by
`remixer-t5 train` in its own folder under `--out`, then summarised over seeds (remixer_t5/study.py).

    remixer-t5 sweep --gin_file=models/t5_1_1/tiny.gin --gin_file=runs/demo.gin \\
        --grid optim.rsqrt_schedule.base_learning_rate=0.5,1.0 --seeds 0,1,2 --out DIR --jobs 2

`--grid NAME=v1,v2,...` (repeatable; NAME a gin macro or binding) spans the grid, their product; `--seeds`
binds RANDOM_SEED. Each point is `DIR/<name=value,...,seed=s>/`, a train MODEL_DIR with every guarantee of one
(its lock, its identity, exact resume). `DIR/sweep.json` (the manifest) records the command, the grid and each
point's state; the same command again skips finished points and resumes the others; another command into the
same DIR is refused. One line per event, with the sweep's ETA.

HyperMixer's protocol (Appendix B: each model's learning rate tuned with one seed, then the seeds at the best
value) is `--tune NAME --select METRIC:min|max`: stage 1 runs NAME's values at the first seed, for each
combination of the other grid names (each model); stage 2 runs every seed at each combination's best value of
NAME by METRIC. The summary (`DIR/sweep.csv`, `sweep.md`, `sweep.png`) covers the points at all seeds.

Where the points run (`--executor`): `local` (default) runs `--jobs` processes at once, the host's cores shared
among them ($REMIXER_T5_CPUS per process); `slurm` submits one SLURM job array through submitit (`--slurm
KEY=VALUE` passes submitit's executor parameters, e.g. `partition=gpu`, `timeout_min=600`); `submitit_local` is
submitit's local executor, the same path without a cluster. `--print_commands` prints each point's `train`
command (for `launch/tpu_vm.sh ... run -- <command>` on a Cloud TPU) and runs nothing. Every point's run joins
the W&B group named after DIR when tracking is on ($WANDB_RUN_GROUP).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any, Sequence

from remixer_t5 import storage, study
from remixer_t5.commands import common
from remixer_t5.training import best
from remixer_t5.training.metrics_log import format_duration

MANIFEST = "sweep.json"
EXECUTORS = ("local", "slurm", "submitit_local")


@dataclasses.dataclass(frozen=True)
class Point:
  """One training run of the sweep: its grid values (name -> value text) and seed."""

  values: tuple[tuple[str, str], ...]
  seed: int

  @property
  def name(self) -> str:
    text = (
      ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.values) + f"{',' if self.values else ''}seed={self.seed}"
    )
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", text)

  def bindings(self) -> list[str]:
    return [f"--gin.{k}={v}" for k, v in self.values] + [f"--gin.RANDOM_SEED={self.seed}"]


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--grid",
    action="append",
    default=[],
    metavar="NAME=V1,V2,...",
    help="a gin macro or binding and its values (repeatable; the grid is their product)",
  )
  p.add_argument("--seeds", default="0", help="RANDOM_SEED values, e.g. 0,1,2 (default 0)")
  p.add_argument("--out", required=True, help="the sweep's folder (local or gs://): a MODEL_DIR per point")
  p.add_argument("--jobs", type=int, default=1, help="local: points trained at once, sharing the cores (default 1)")
  p.add_argument(
    "--tune",
    metavar="NAME",
    help="two stages: NAME's values at the first seed, then all seeds at the "
    "best value of NAME for each combination of the other grid names (needs --select)",
  )
  p.add_argument(
    "--select",
    metavar="METRIC:min|max",
    help="the metric that picks --tune's best value, e.g. validation/loss:min or cogs/exact_match:max",
  )
  p.add_argument("--executor", choices=EXECUTORS, default="local", help="where points run (default local)")
  p.add_argument(
    "--slurm",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="slurm/submitit_local: a submitit executor parameter (repeatable), e.g. timeout_min=600",
  )
  p.add_argument(
    "--print_commands",
    "--print-commands",
    action="store_true",
    help="print each point's train command (for launch/) and run nothing",
  )


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[str]]]:
  """['NAME=v1,v2', ...] -> [(NAME, ['v1', 'v2']), ...]; ValueError naming the bad item."""
  grid = []
  for item in items:
    name, sep, values = item.partition("=")
    name = name.strip().removeprefix("--gin.")
    vals = [v.strip() for v in _split_values(values)] if sep else []
    if not re.fullmatch(r"[A-Za-z_][\w./]*", name) or not vals or any(not v for v in vals):
      raise ValueError(
        f"--grid {item!r}: expected NAME=V1,V2,... with a gin macro or binding as NAME, e.g. "
        "optim.rsqrt_schedule.base_learning_rate=0.5,1.0"
      )
    if name in {n for n, _ in grid}:
      raise ValueError(f"--grid {name} is given twice; give its values once, comma-separated")
    if name in ("RANDOM_SEED", "run_config.Training.random_seed"):
      raise ValueError(f"--grid {name}: seeds are --seeds")
    grid.append((name, vals))
  return grid


def _split_values(text: str) -> list[str]:
  """Comma-separated values; commas inside brackets or quotes stay (a tuple or dict value)."""
  out, depth, quote, cur = [], 0, None, ""
  for ch in text:
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      out.append(cur)
      cur = ""
      continue
    cur += ch
  return out + [cur]


def parse_seeds(text: str) -> list[int]:
  try:
    seeds = [int(s) for s in str(text).split(",") if s.strip()]
  except ValueError:
    seeds = []
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds {text!r}: expected distinct integers, e.g. 0,1,2")
  return seeds


def points(grid, seeds: Sequence[int]) -> list[Point]:
  names = [n for n, _ in grid]
  return [Point(tuple(zip(names, combo)), seed) for combo in itertools.product(*(v for _, v in grid)) for seed in seeds]


class Manifest:
  """DIR/sweep.json: the command that defines the sweep and each point's state (pending, running, done, failed
  with its exit code), rewritten whole after every event."""

  def __init__(self, out, spec: dict):
    self.path = storage.run_path(out) / MANIFEST
    self.spec = spec
    self.points: dict[str, dict[str, Any]] = {}
    if self.path.exists():
      old = json.loads(self.path.read_text())
      if old.get("spec") != spec:
        diff = sorted(k for k in set(old.get("spec", {})) | set(spec) if old.get("spec", {}).get(k) != spec.get(k))
        raise ValueError(
          f"--out {storage.run_path(out)} holds another sweep (its {', '.join(diff)} differ: see "
          f"{self.path}); use another --out or the same command"
        )
      self.points = old.get("points", {})

  def state(self, point: Point) -> str:
    return self.points.get(point.name, {}).get("state", "pending")

  def set(self, point: Point, **fields) -> None:
    self.points.setdefault(point.name, {"values": dict(point.values), "seed": point.seed}).update(fields)
    storage.write_text(self.path, json.dumps({"spec": self.spec, "points": self.points}, indent=1, sort_keys=True))


def train_command(train_argv: Sequence[str], out, point: Point) -> list[str]:
  folder = storage.run_path(out) / point.name
  where = folder.as_posix() if storage.is_bucket(folder) else str(folder)
  return ["train", *train_argv, *point.bindings(), f"--gin.MODEL_DIR='{where}'"]


def _cores(jobs: int) -> list[str | None]:
  """Each local job's share of this process's cores, as $REMIXER_T5_CPUS (None where there are too few)."""
  try:
    cores = sorted(os.sched_getaffinity(0))
  except AttributeError:
    return [None] * jobs
  if len(cores) < jobs:
    return [None] * jobs
  share = len(cores) // jobs
  return [",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(jobs)]


def _child_env(group: str, cpus: str | None) -> dict[str, str]:
  env = dict(os.environ)
  env.setdefault("WANDB_RUN_GROUP", group)
  if cpus:
    env["REMIXER_T5_CPUS"] = cpus
  return env


def run_point(argv: Sequence[str], env: dict[str, str], log_path: str) -> int:
  """`python -m remixer_t5 <argv>` with its output in `log_path`; its exit code (submitit runs this too)."""
  with open(log_path, "a") as log:
    return subprocess.run(
      [sys.executable, "-m", "remixer_t5", *argv], env=env, stdout=log, stderr=subprocess.STDOUT
    ).returncode


class Progress:
  """One line per event, with the sweep's ETA from the finished points' mean duration."""

  def __init__(self, total: int, jobs: int):
    self.total, self.jobs, self.t0, self.durations = total, max(jobs, 1), time.time(), []

  def say(self, event: str, done: int, running: int) -> None:
    left = self.total - done
    eta = ""
    if self.durations and left:
      eta = f"; ETA {format_duration(sum(self.durations) / len(self.durations) * left / self.jobs)}"
    print(
      f"[sweep] {event} ({done}/{self.total} done, {running} running{eta}; elapsed "
      f"{format_duration(time.time() - self.t0)})",
      flush=True,
    )


def run_points(todo: Sequence[Point], args, train_argv, manifest: Manifest, progress: Progress, done: int) -> int:
  """Trains `todo`; returns how many are done afterwards (failed points are recorded and said, not retried)."""
  out, group = storage.run_path(args.out), storage.run_path(args.out).name
  logs = storage.Mirror(out / "logs")
  if args.executor != "local":
    return _run_submitit(todo, args, train_argv, manifest, progress, done, logs, group)
  free = _cores(args.jobs)
  running: dict[Any, tuple] = {}  # process -> (point, start time, its cores, its log file)
  queue = list(todo)
  try:
    while queue or running:
      while queue and free:
        point, cpus = queue.pop(0), free.pop(0)
        log_file = open(logs.local / f"{point.name}.log", "a")
        proc = subprocess.Popen(
          [sys.executable, "-m", "remixer_t5", *train_command(train_argv, out, point)],
          env=_child_env(group, cpus),
          stdout=log_file,
          stderr=subprocess.STDOUT,
        )
        running[proc] = (point, time.time(), cpus, log_file)
        manifest.set(point, state="running")
        progress.say(f"started {point.name}", done, len(running))
      time.sleep(0.2)
      for proc in [p for p in running if p.poll() is not None]:
        point, started, cpus, log_file = running.pop(proc)
        log_file.close()
        free.append(cpus)
        done += _finish(point, proc.returncode, time.time() - started, manifest, progress, logs)
        progress.say(
          f"{'finished' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} {point.name}",
          done,
          len(running),
        )
  finally:
    for proc in running:  # interrupted: the points stop as a train does on SIGTERM (saving), to resume later
      proc.terminate()
    for proc in running:
      proc.wait(timeout=600)
    logs.close()
  return done


def _finish(point: Point, code: int, seconds: float, manifest: Manifest, progress: Progress, logs) -> int:
  logs.sync()
  manifest.set(point, state="done" if code == 0 else "failed", exit=code, seconds=round(seconds, 1))
  if code == 0:
    progress.durations.append(seconds)
  return int(code == 0)


def _run_submitit(todo, args, train_argv, manifest, progress, done, logs, group) -> int:
  import submitit  # the slurm extra; only these executors need it

  out = storage.run_path(args.out)
  kind = "slurm" if args.executor == "slurm" else "local"
  executor = submitit.AutoExecutor(folder=str(logs.local / "submitit"), cluster=kind)
  params = dict(item.split("=", 1) for item in args.slurm)
  params = {k: int(v) if v.isdigit() else v for k, v in params.items()}
  if kind == "slurm":
    executor.update_parameters(slurm_array_parallelism=args.jobs, **params)
  elif params:
    executor.update_parameters(**params)
  env = _child_env(group, None)
  with executor.batch():
    jobs = [
      (p, executor.submit(run_point, train_command(train_argv, out, p), env, str(logs.local / f"{p.name}.log")))
      for p in todo
    ]
  started = time.time()
  for point, _ in jobs:
    manifest.set(point, state="running")
  progress.say(f"submitted {len(jobs)} points to {args.executor}", done, len(jobs))
  for point, job in jobs:
    code = job.result()
    done += _finish(point, code, time.time() - started, manifest, progress, logs)
    progress.say(f"{'finished' if code == 0 else f'FAILED (exit {code})'} {point.name}", done, 0)
  logs.close()
  return done


def _best_values(grid, tune: str, metric: str, mode: str, first: list[Point], out) -> dict[tuple, str]:
  """Per combination of the other grid names: the value of `tune` whose stage-1 point is best by `metric`."""
  chosen: dict[tuple, tuple[float, str]] = {}
  for point in first:
    value = study.point_metrics(storage.run_path(out) / point.name).get(metric)
    if value is None:
      continue
    others = tuple((k, v) for k, v in point.values if k != tune)
    current = chosen.get(others)
    if current is None or (value < current[0] if mode == "min" else value > current[0]):
      chosen[others] = (value, dict(point.values)[tune])
  return {others: v for others, (_, v) in chosen.items()}


def main(args: argparse.Namespace) -> int:
  """The sweep of `args` over its gin flags (`args.gin`, each point's train's): runs what is not done, then
  summarises."""
  common.load_gin(args, required=True)  # a config that does not parse stops here, not in every point
  files, bindings, paths = args.gin
  train_argv = (
    [f"--gin_file={f}" for f in files]
    + [f"--gin.{b}" for b in bindings]
    + ([f"--gin_search_paths={','.join(paths)}"] if paths else [])
  )
  grid, seeds = parse_grid(args.grid), parse_seeds(args.seeds)
  if args.jobs < 1:
    raise ValueError(f"--jobs {args.jobs}: expected a positive number of processes")
  if bool(args.tune) != bool(args.select):
    raise ValueError("--tune NAME and --select METRIC:min|max go together (HyperMixer's two stages)")
  metric = mode = None
  if args.select:
    metric, mode = best.parse(args.select, what="--select")
  if args.tune and args.tune.removeprefix("--gin.") not in {n for n, _ in grid}:
    raise ValueError(f"--tune {args.tune}: expected one of the --grid names ({', '.join(n for n, _ in grid)})")
  tune = args.tune.removeprefix("--gin.") if args.tune else None
  out = storage.run_path(args.out)
  storage.check_bucket(out, "--out")
  spec = {
    "train": list(train_argv),
    "grid": [[n, v] for n, v in grid],
    "seeds": seeds,
    "tune": tune,
    "select": args.select,
  }
  stage1 = points(grid, seeds[:1]) if tune else points(grid, seeds)
  if args.print_commands:
    for point in stage1:
      print("remixer-t5 " + " ".join(shlex.quote(a) for a in train_command(train_argv, out, point)))
    if tune:
      print(f"# then, at the best {tune} of each model by {args.select}: the seeds {seeds[1:]}")
    return 0
  manifest = Manifest(out, spec)
  models = len(points([(n, v) for n, v in grid if n != tune], seeds[:1]))  # combinations of the other names
  total = len(stage1) + (models * (len(seeds) - 1) if tune else 0)
  progress = Progress(total, args.jobs if args.executor == "local" else len(stage1))
  done = sum(manifest.state(p) == "done" for p in stage1)
  todo = [p for p in stage1 if manifest.state(p) != "done"]
  if len(todo) < len(stage1):
    progress.say(f"{len(stage1) - len(todo)} points already done: skipped", done, 0)
  done = run_points(todo, args, train_argv, manifest, progress, done)
  final = stage1
  if tune:
    failed = [p.name for p in stage1 if manifest.state(p) != "done"]
    if failed:
      raise RuntimeError(f"stage 1 did not finish ({', '.join(failed)}); see {out / 'logs'}; rerun the command")
    chosen = _best_values(grid, tune, metric, mode, stage1, out)
    for others, value in chosen.items():
      progress.say(f"best {tune} for {dict(others) or 'the model'}: {value} by {args.select}", done, 0)
    final = [
      Point(
        tuple((k, chosen[tuple((o, w) for o, w in p.values if o != tune)] if k == tune else v) for k, v in p.values),
        p.seed,
      )
      for p in points([(n, v[:1] if n == tune else v) for n, v in grid], seeds)
    ]
    stage2 = [p for p in final if manifest.state(p) != "done"]
    done = run_points(stage2, args, train_argv, manifest, progress, done)
  failed = [p.name for p in final if manifest.state(p) != "done"]
  if failed:
    print(
      f"[sweep] {len(failed)} points failed ({', '.join(failed)}); their logs are in {out / 'logs'}; the same "
      "command resumes them",
      flush=True,
    )
    return 1
  rows = []
  for p in final:
    rows.append({**dict(p.values), "seed": p.seed, **study.point_metrics(out / p.name)})
  _, paths = study.report(rows, [n for n, _ in grid], out, title=f"sweep {out.name}")
  print(f"[sweep] {len(final)} points done; the summary is in {', '.join(str(p) for p in paths)}", flush=True)
  return 0
