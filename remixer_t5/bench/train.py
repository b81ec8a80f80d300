"""`remixer-t5 bench train`: the time of one training step of a gin-configured model, optionally beside
Hugging Face transformers' PyTorch T5 on the same shapes.

Our step is exactly the trainer's (`programs.build`: loss + z-loss, gradient, the run's optimizer update,
jitted with the state donated) on random tokens of the run's batch size and feature lengths, unpacked,
every token real. Dropout is whatever the gin config binds (use `--gin.DROPOUT_RATE=0.0` for a like-for-like
comparison).

The reference (`--reference hf`, needs the `.[hf]` extra) is `T5ForConditionalGeneration` built from the same
sizes (`hf.config_to_hf`; T5.1.1 models only) with transformers' Adafactor at T5's settings (no momentum,
parameter scaling on, a fixed learning rate), float32, on the same random tokens: forward with labels, backward,
optimizer step, zero_grad.

Timing: `rounds` alternating rounds (ours, then the reference), each `warmup` untimed steps then the median of
`steps` timed steps (`block_until_ready` on ours; PyTorch's CPU step is synchronous). The reported step time is
the median over rounds of the per-round medians, and the ratio is ours / reference in the same run.

Where the reference runs (`hf_process`): `own` (default) is a child process of its own (spawned, driven round by
round over a pipe), so neither side's heap, allocator or thread pools can disturb the other's timings. `shared`
runs both in this process. The reference's process usage (busy cores, system time, faults) and its PyTorch
settings are measured in the process it runs in.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from remixer_t5 import gin_utils
from remixer_t5.bench import env as bench_env
from remixer_t5.commands import common
from remixer_t5.interop import hf
from remixer_t5.training import mfu, partitioning, programs, run_config

REFERENCES = (None, "hf")
HF_PROCESSES = ("own", "shared")


def random_batch(vocab_size: int, batch_size: int, lengths: Mapping[str, int], seed: int = 0) -> dict[str, np.ndarray]:
  """Random unpacked tokens (all real, ids 2..vocab-1) with the decoder input shifted right from the targets."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, vocab_size, size=(batch_size, lengths["inputs"]), dtype=np.int32)
  targets = rng.integers(2, vocab_size, size=(batch_size, lengths["targets"]), dtype=np.int32)
  decoder_inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
  return {"encoder_input_tokens": inputs, "decoder_input_tokens": decoder_inputs, "decoder_target_tokens": targets}


def time_calls(call: Callable[[], Any], steps: int, warmup: int) -> tuple[list[float], Any]:
  """`warmup` untimed calls, then the wall time of each of `steps` calls; and the last call's result."""
  out = None
  for _ in range(warmup):
    out = call()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    out = call()
    times.append(time.perf_counter() - t0)
  return times, out


def jit_seconds(fn: Callable, args, repeats: int, warmup: int) -> float:
  """The median wall time of `jax.jit(fn)(*args)`, waited for, over `repeats` calls after its compiling call
  and `warmup` more."""
  compiled = jax.jit(fn)
  times, _ = time_calls(lambda: jax.block_until_ready(compiled(*args)), repeats, 1 + warmup)
  return statistics.median(times)


def ours(model, tx, batch: Mapping[str, np.ndarray], seed: int = 0) -> Callable[[], Any]:
  """A zero-argument callable that runs one of the trainer's jitted train steps (programs.build, on this process's
  first device) and returns its loss sum, waited for."""
  lengths = {"inputs": batch["encoder_input_tokens"].shape[1], "targets": batch["decoder_target_tokens"].shape[1]}
  part = partitioning.partitioner("1x1", jax.devices()[:1], rules="data")
  prog = programs.build(model, tx, lengths, part)
  device_batch = {k: jax.device_put(v, prog.batch_sharding) for k, v in batch.items()}
  holder = {"state": prog.init_state(seed)}
  step_fn = prog.compile(prog.train_step, holder["state"], device_batch)

  def run():
    holder["state"], metrics = step_fn(holder["state"], device_batch)
    return jax.block_until_ready(metrics["loss_sum"])

  return run


def hf_reference(
  config, batch: Mapping[str, np.ndarray], learning_rate: float = 1e-2, seed: int = 0, flush_denormal: bool = True
) -> Callable[[], Any]:
  """transformers' T5ForConditionalGeneration train step on the same shapes (float32, dropout as `config`: our
  T5Config, or its HF form from `hf.config_to_hf`, as the reference's own process receives it). `flush_denormal`:
  PyTorch flushes subnormal floats to zero, as XLA:CPU does (bench_env), set before its first operation."""
  try:
    import torch
    import transformers
    from transformers.optimization import Adafactor
  except ImportError as e:  # pragma: no cover - depends on the optional extra
    raise RuntimeError("--reference hf needs PyTorch and transformers: pip install -e '.[hf]'") from e
  bench_env.set_torch_flush_denormal(flush_denormal)
  torch.manual_seed(seed)
  hf_config = transformers.T5Config(**{k: v for k, v in _hf_values(config).items() if k != "architectures"})
  model = transformers.T5ForConditionalGeneration(hf_config).train()
  opt = Adafactor(
    model.parameters(),
    lr=learning_rate,
    scale_parameter=True,
    relative_step=False,
    warmup_init=False,
    beta1=None,
    decay_rate=-0.8,
    clip_threshold=1.0,
  )
  inputs = torch.from_numpy(batch["encoder_input_tokens"].astype(np.int64))
  decoder_inputs = torch.from_numpy(batch["decoder_input_tokens"].astype(np.int64))
  labels = torch.from_numpy(batch["decoder_target_tokens"].astype(np.int64))

  def run():
    out = model(input_ids=inputs, decoder_input_ids=decoder_inputs, labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

  return run


def _hf_values(config) -> dict:
  """The HF config's values: `config` itself when already in that form (what the reference's process gets)."""
  return config if isinstance(config, dict) else hf.config_to_hf(config)


def timed_round(run: Callable[[], Any], warmup: int, steps: int) -> tuple[list[float], float, float, int]:
  """`warmup` untimed calls, then `steps` timed ones: (their times, CPU s, system s, minor faults over them)."""
  time_calls(run, 0, warmup)
  r0 = resource.getrusage(resource.RUSAGE_SELF)
  times, _ = time_calls(run, steps, 0)
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  return (
    times,
    r1.ru_utime + r1.ru_stime - (r0.ru_utime + r0.ru_stime),
    r1.ru_stime - r0.ru_stime,
    r1.ru_minflt - r0.ru_minflt,
  )


def _hf_child(conn, hf_config: dict, batch: Mapping[str, np.ndarray], seed: int, flush_denormal: bool) -> None:
  """The reference's own process: builds it, reports PyTorch's settings, then times one round per request."""
  try:
    run = hf_reference(hf_config, batch, seed=seed, flush_denormal=flush_denormal)
    conn.send(("ready", bench_env.torch_environment()))
    while (request := conn.recv()) is not None:
      conn.send(("round", timed_round(run, *request)))
  except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
    conn.send(("error", f"{type(e).__name__}: {e}"))
  finally:
    conn.close()


class _ChildReference:
  """The HF reference in a spawned process of its own (module docstring), driven round by round."""

  def __init__(self, config, batch: Mapping[str, np.ndarray], seed: int, flush_denormal: bool):
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no heap or thread inherited
    self.conn, child_conn = ctx.Pipe()
    args = (child_conn, _hf_values(config), dict(batch), seed, flush_denormal)
    self.process = ctx.Process(target=_hf_child, args=args, daemon=True, name="hf-reference")
    self.process.start()
    child_conn.close()
    self.environment = self._receive("ready")

  def _receive(self, kind: str):
    # Poll, so that a child that dies (killed, out of memory) is an error, not a wait for ever.
    while not self.conn.poll(1.0) and self.process.is_alive():
      pass
    try:
      got, value = self.conn.recv()
    except EOFError:
      self.process.join(5)
      raise RuntimeError(
        f"the HF reference's process ended without a result (exit code {self.process.exitcode})"
      ) from None
    if got == "error":
      self.process.join(5)
      raise RuntimeError(f"the HF reference failed in its own process: {value}")
    assert got == kind, (got, kind)
    return value

  def round(self, warmup: int, steps: int):
    try:
      self.conn.send((warmup, steps))
    except (BrokenPipeError, OSError):
      self.process.join(5)
      raise RuntimeError(f"the HF reference's process is gone (exit code {self.process.exitcode})") from None
    return self._receive("round")

  def close(self) -> None:
    try:
      self.conn.send(None)
    except (BrokenPipeError, OSError):
      pass
    self.process.join(30)
    if self.process.is_alive():
      self.process.kill()
      self.process.join()


def bench_train(
  model,
  tx,
  *,
  batch_size: int,
  feature_lengths: Mapping[str, int],
  steps: int = 20,
  warmup: int = 3,
  rounds: int = 3,
  reference: str | None = None,
  seed: int = 0,
  hf_flush_denormal: bool = True,
  hf_process: str = "own",
  log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
  """Median step times of our train step (and the reference's), alternated over `rounds`.
  `hf_flush_denormal`: see hf_reference; `hf_process`: where the reference runs (module docstring)."""
  if reference not in REFERENCES:
    raise ValueError(f"unknown --reference {reference!r}; expected one of {', '.join(map(str, REFERENCES))}")
  if hf_process not in HF_PROCESSES:
    raise ValueError(
      f"--hf_process={hf_process!r}: expected 'own' (the reference in a process of its own, the "
      "default) or 'shared' (in this one)"
    )
  if steps < 1 or rounds < 1 or warmup < 0:
    raise ValueError(f"steps={steps}, rounds={rounds}, warmup={warmup}: expected steps, rounds >= 1, warmup >= 0")
  cfg = model.module.config
  batch = random_batch(cfg.vocab_size, batch_size, feature_lengths, seed)
  child = None
  runners: dict[str, Callable[[int, int], tuple]] = {}
  if reference == "hf" and hf_process == "own":
    child = _ChildReference(cfg, batch, seed, hf_flush_denormal)
    runners["hf"] = child.round
  elif reference == "hf":
    # The reference first: its subnormal mode must be set before any PyTorch operation starts its threads.
    hf_run = hf_reference(cfg, batch, seed=seed, flush_denormal=hf_flush_denormal)
    runners["hf"] = lambda w, n: timed_round(hf_run, w, n)
  medians: dict[str, list[float]] = {"ours": [], **{name: [] for name in runners}}
  usage = {name: [0.0, 0.0, 0, 0.0] for name in medians}  # cpu s, system s, minor faults, wall s (timed steps)
  try:  # from here on the reference's process is ended whatever fails, ours included
    ours_run = ours(model, tx, batch, seed)
    runners = {"ours": lambda w, n: timed_round(ours_run, w, n), **runners}
    for r in range(rounds):
      for name, run_round in runners.items():
        times, cpu, system, faults = run_round(warmup if r == 0 else 1, steps)
        for i, d in enumerate((cpu, system, faults, sum(times))):
          usage[name][i] += d
        medians[name].append(statistics.median(times))
        log(
          f"round {r + 1}/{rounds} {name}: median {medians[name][-1]:.3f} s/step "
          f"(min {min(times):.3f}, max {max(times):.3f})"
        )
  finally:
    if child is not None:
      child.close()
  tokens = batch_size * (feature_lengths["inputs"] + feature_lengths["targets"])
  row: dict[str, Any] = {
    "batch_size": batch_size,
    "inputs_length": feature_lengths["inputs"],
    "targets_length": feature_lengths["targets"],
    "steps": steps,
    "rounds": rounds,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
  }
  for name, per_round in medians.items():
    s = statistics.median(per_round)
    cpu, system, faults, wall = usage[name]  # what decides a CPU step besides the kernels
    row.update(
      {
        f"{name}_s_per_step": s,
        f"{name}_tokens_per_s": tokens / s,
        f"{name}_round_medians": per_round,
        f"{name}_cores_busy": cpu / wall if wall > 0 else None,
        f"{name}_system_s_per_step": system / (steps * rounds),
        f"{name}_minor_faults_per_step": faults / (steps * rounds),
      }
    )
  if "hf" in medians:
    row["ratio_ours_to_hf"] = row["ours_s_per_step"] / row["hf_s_per_step"]
    row["hf_process"] = hf_process
    if child is not None:
      row.update(child.environment)  # measured where the reference ran
  return row


def from_gin(batch_size: int | None = None, feature_lengths: Mapping[str, int] | None = None) -> dict[str, Any]:
  """bench_train's model, optax transformation (`tx`), batch size and feature lengths from the parsed gin config,
  as `train` reads them: the run config (run_config.from_gin) when a run file is loaded, else the MODEL macro,
  Adafactor and `batch_size`/`feature_lengths`, which also override the run's."""
  try:
    run = run_config.from_gin()
    training = run.training
    lengths, batch = feature_lengths or run.data.feature_lengths, batch_size or run.data.batch_size
  except ValueError:  # a model config alone
    training = run_config.Training(model=gin_utils.macro("MODEL")) if gin_utils.macro("MODEL") else None
    lengths, batch = feature_lengths, batch_size
  missing = [
    name
    for name, v in (
      ("MODEL", training),
      ("TASK_FEATURE_LENGTHS (or --lengths)", lengths),
      ("BATCH_SIZE (or --batch_size)", batch),
    )
    if v is None
  ]
  if missing:
    raise ValueError(
      f"bench train needs {', '.join(missing)} from the gin config (e.g. "
      "--gin_file=models/t5_1_1/small.gin --gin_file=runs/pretrain.gin)"
    )
  lengths = dict(lengths)
  if set(lengths) < {"inputs", "targets"} or any(int(v) < 2 for v in lengths.values()):
    raise ValueError(f"feature lengths {lengths}: expected {{'inputs': N, 'targets': M}} with N, M >= 2")
  if int(batch) < 1:
    raise ValueError(f"batch size {batch}: expected a positive integer")
  tx = programs.make_tx(training.model, training.optimizer, training.learning_rate)
  return {
    "model": training.model,
    "tx": tx,
    "batch_size": int(batch),
    "feature_lengths": {"inputs": int(lengths["inputs"]), "targets": int(lengths["targets"])},
  }


def against(
  commit: str, what: str, argv: Sequence[str], rounds: int = 3, log: Callable[[str], None] = print
) -> dict[str, Any]:
  """`bench WHAT ARGV` (train or decode) of this tree against `commit`'s, on the same host: the commit checked out
  in a temporary git worktree, every measurement a fresh process (`--rounds=1 --json`) running its own tree's
  code with this interpreter, the two trees alternating `rounds` times so that both see the same drift in the
  machine's speed. Returns, for each timing of the row (`ours_s_per_step`; decode's `ours_<mode>_s_per_batch`),
  both trees' per-round seconds, their medians and here / base."""
  here = Path(__file__).resolve().parents[2]
  git = lambda *a: subprocess.run(["git", "-C", str(here), *a], capture_output=True, text=True, check=True).stdout
  try:
    base = git("rev-parse", "--short", f"{commit}^{{commit}}").strip()
  except subprocess.CalledProcessError as e:
    raise ValueError(f"--against {commit}: not a commit of {here} ({e.stderr.strip()})") from None
  times: dict[str, dict[str, list[float]]] = {}
  with tempfile.TemporaryDirectory(prefix="remixer_t5-against-") as tmp:
    tree = Path(tmp) / base
    git("worktree", "add", "--quiet", "--detach", str(tree), base)
    try:
      for r in range(rounds):
        for side, root in (("base", tree), ("here", here)):
          proc = subprocess.run(
            [sys.executable, "-m", "remixer_t5.cli", "bench", what, *argv, "--rounds=1", "--json"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
          )
          if proc.returncode:
            raise RuntimeError(f"bench {what} at {side} ({root}) exited {proc.returncode}: {proc.stderr[-1500:]}")
          row = json.loads(proc.stdout.strip().splitlines()[-1])
          for key in (k for k in row if re.fullmatch(r"ours_((greedy|beam)_)?s_per_(step|batch)", k)):
            times.setdefault(key, {"base": [], "here": []})[side].append(row[key])
          log(
            f"round {r + 1}/{rounds}: {side} " + ", ".join(f"{k} {v[side][-1] * 1e3:.1f} ms" for k, v in times.items())
          )
    finally:
      git("worktree", "remove", "--force", str(tree))
  dirty = git("status", "--porcelain", "--untracked-files=no").strip()
  out: dict[str, Any] = {
    "bench": what,
    "against": base,
    "rounds": rounds,
    "here": git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else ""),
  }
  for key, sides in times.items():
    medians = {side: statistics.median(t) for side, t in sides.items()}
    out[key] = {
      "base": medians["base"],
      "here": medians["here"],
      "here_over_base": medians["here"] / medians["base"],
      "base_rounds": sides["base"],
      "here_rounds": sides["here"],
    }
  return out


def add_mfu(row: dict[str, Any], model, peak: float | None = None) -> dict[str, Any]:
  """Adds model FLOPs per step (mfu.model_flops_per_step: forward + backward, no optimizer) and, where the
  device's peak is known (never for a CPU unless `peak` is given), MFU of our step and the reference's."""
  shapes = programs.batch_shapes(
    {"inputs": row["inputs_length"], "targets": row["targets_length"]}, row["batch_size"], pack=False
  )
  flops = mfu.model_flops_per_step(model, shapes)
  peak = mfu.peak_flops_per_device(override=peak)
  row["model_flops_per_step"] = flops
  row["peak_flops_per_device"] = peak
  for name in ("ours", "hf"):
    if f"{name}_s_per_step" in row:
      row[f"{name}_model_flops_per_s"] = flops / row[f"{name}_s_per_step"]
      row[f"{name}_mfu"] = mfu.mfu(flops / row["devices"], 1.0 / row[f"{name}_s_per_step"], peak)
  return row


def format_row(row: Mapping[str, Any]) -> str:
  lines = [
    f"batch {row['batch_size']} x {row['inputs_length']}/{row['targets_length']} on "
    f"{row['backend']} ({row['devices']} device(s)), median of {row['steps']} steps x {row['rounds']} rounds"
  ]
  for name, label in (("ours", "ours (jitted trainer step)"), ("hf", "HF transformers (PyTorch)")):
    if f"{name}_s_per_step" in row:
      m = row.get(f"{name}_mfu")
      lines.append(
        f"  {label}: {row[f'{name}_s_per_step']:.4f} s/step, {row[f'{name}_tokens_per_s']:,.0f} "
        f"tokens/s, {row.get(f'{name}_model_flops_per_s', 0) / 1e9:,.1f} GFLOP/s"
        + (f", MFU {m:.1%}" if m is not None else ", MFU n/a (no peak known for this device)")
      )
  if "ratio_ours_to_hf" in row:
    lines.append(f"  ours / HF: {row['ratio_ours_to_hf']:.3f}")
  return "\n".join(lines)


def add_comparison_arguments(p: argparse.ArgumentParser, steps: int, what: str) -> None:
  """The timing and comparison flags bench train and bench decode share."""
  p.add_argument("--steps", type=int, default=steps, help=f"timed {what} per round, median reported (default {steps})")
  p.add_argument("--rounds", type=int, default=3, help="rounds, alternating with --reference or --against (default 3)")
  p.add_argument(
    "--against",
    metavar="COMMIT",
    help="time this tree against COMMIT on the same host, each in fresh "
    "processes of its own tree's code, the two alternating --rounds times (medians, here / base)",
  )
  p.add_argument(
    "--reference",
    choices=("hf", "none"),
    default="none",
    help="'hf' also times transformers' "
    "PyTorch T5 (train step; decode: generate on the same weights, T5.1.1 only) on the same shapes "
    "(pip install -e '.[hf]'); 'none' (default) times ours only",
  )
  p.add_argument(
    "--hf_denormals",
    "--hf-denormals",
    choices=("flush", "keep"),
    help="with --reference hf: 'flush' (default) runs PyTorch with subnormal floats flushed to zero, "
    "as XLA:CPU always does; 'keep' leaves PyTorch's default (on Intel CPUs its train step then runs "
    "several times slower once subnormals appear)",
  )
  p.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--lengths", help="INPUTS,TARGETS (default: TASK_FEATURE_LENGTHS)")
  p.add_argument("--batch_size", "--batch-size", type=int, help="override BATCH_SIZE")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
  add_comparison_arguments(p, 20, "steps")
  p.add_argument(
    "--hf_process",
    "--hf-process",
    choices=HF_PROCESSES,
    help="with --reference hf: 'own' (default) runs the reference in a process of its own, so the two "
    "share no heap or threads; 'shared' runs it in this one",
  )
  p.add_argument(
    "--peak_flops", "--peak-flops", type=float, help="peak FLOP/s per device for MFU (default: known accelerators only)"
  )


def reference_of(args: argparse.Namespace) -> tuple[str | None, bool]:
  """(--reference: None or 'hf'; whether the HF reference's PyTorch flushes subnormal floats), checked before the
  model is built."""
  reference = None if args.reference == "none" else args.reference
  for flag, value in (("--hf_denormals", args.hf_denormals), ("--hf_process", getattr(args, "hf_process", None))):
    if value is not None and reference != "hf":
      raise ValueError(f"{flag}={value} sets the HF reference; it needs --reference hf")
  return reference, args.hf_denormals != "keep"


def main(args: argparse.Namespace) -> int:
  common.load_gin(args, required=True)
  if args.against:
    return main_against(args)
  reference, flush = reference_of(args)
  setup = from_gin(args.batch_size, common.parse_lengths(args.lengths))
  load_start = bench_env.loadavg()
  row = bench_train(
    **setup,
    steps=args.steps,
    warmup=args.warmup,
    rounds=args.rounds,
    reference=reference,
    hf_flush_denormal=flush,
    hf_process=args.hf_process or "own",
    log=common.stderr,
  )
  # PyTorch's settings come from the process the reference ran in: the child's, already in the row, when its own
  row.update(
    bench_env.environment(with_torch=reference == "hf" and args.hf_process == "shared"),
    load_average_start=load_start,
    load_average_end=bench_env.loadavg(),
  )
  add_mfu(row, setup["model"], args.peak_flops)
  print(json.dumps(row) if args.json else format_row(row), flush=True)
  return 0


def main_against(args: argparse.Namespace) -> int:
  """`bench train|decode --against COMMIT`: the same measurement at COMMIT and here, alternating."""
  if args.reference != "none":
    raise ValueError("--against compares this tree with another commit; it takes no --reference")
  what = args.command.split()[-1]
  argv, tokens = [], iter(args.argv)
  for token in tokens:  # the command line as given, less the command and what `against` sets itself
    if token in ("--against", "--rounds"):
      next(tokens, None)  # and its value
    elif token not in ("bench", what, "--json") and not token.startswith(("--against=", "--rounds=")):
      argv.append(token)
  row = against(args.against, what, argv, rounds=args.rounds, log=common.stderr)
  row.update(bench_env.environment(with_torch=False), load_average_end=bench_env.loadavg())
  timings = "; ".join(
    f"{k}: {v['base'] * 1e3:.1f} ms at {row['against']}, {v['here'] * 1e3:.1f} ms here, here / "
    f"base {v['here_over_base']:.3f}"
    for k, v in row.items()
    if isinstance(v, dict) and "base" in v
  )
  print(
    json.dumps(row)
    if args.json
    else f"bench {what} (medians of {row['rounds']} alternating rounds, "
    f"{row['cpu_model']}, load {row['load_average_end']}): {timings}",
    flush=True,
  )
  return 0
