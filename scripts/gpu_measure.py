"""On a real GPU: measure what `remixer-t5 compile --topology h100/h200` predicts without one.

For each configuration below this compiles the trainer's own train step (`programs.build`, the step `train`
runs and `remixer-t5 compile` compiles ahead of time) for the GPU in hand, reports XLA's buffer assignment of the
real compile beside the deviceless prediction, then runs it on random tokens and times it: the measured step
time, tokens/s and MFU (model FLOPs, mfu.py, against the GPU's bf16 dense peak), the allocator's peak memory,
and the loss of each step (finite and falling). Stages:

- `attention`: bench/attention.py, the fused attention alone at T5.1.1-base's encoder and decoder shapes
  (forward, forward + backward, candidate tilings) beside the XLA form and JAX's Pallas `mha` without bias;
- `parity`: the tiny T5.1.1 (float32, matmul precision 'highest') evaluated and trained one step on the GPU and
  on the host CPU from the same parameters and batch: loss, gradient norm and the updated parameters must agree.
- one stage per base model at the pretraining settings (runs/pretrain.gin: batch 128, 512/114, Adafactor,
  bfloat16 activations, mesh 1x1 with the data rules: the `h100`/`h200` rows of the GPU cost table);
- `kernels`: `remixer-t5 bench kernels` on this GPU: the COGS steps with the Pallas kernels (attention,
  HyperMixing's causal form) against plain XLA, unpacked and packed rows;
- `<model>_xla`: the same model with the plain XLA attention (`T5Config.attention_impl='xla'`), to set beside the
  default (`auto`: the Pallas flash attention of kernels/gpu/ on GPUs); `parity` runs the fused path on the GPU
  against the XLA form on the host;
- `t5_1_1_base_fused`, `t5_1_1_base_bf16_logits`: T5Config's step-layout options (`fuse_projections`,
  `logits_in_activation_dtype`), each kept on only if it pays here;
- `cogs_quick`: `remixer-t5 repro cogs --quick` on this GPU, its time and scores beside the CPU's;
- `deviceless_<model>`: `remixer-t5 compile --topology <this GPU> --json` in a child with JAX_PLATFORMS=cpu, on
  the same machine, for the prediction of the same cell (needs the CUDA plugin; reported, never fatal).

It runs with whatever jax/flax the GPU machine has (not the project's pins: the versions are recorded) and
needs gin-config beside them. Each stage runs in its own process with a time limit, so a failure or an
out-of-memory costs that row only; rows go to OUT/gpu_measure.jsonl as they finish and a summary is printed.

With `--profile` each model's two traced steps leave a perfetto trace and the optimised HLO (kernel names are
its fusions' names) in --out, and the row gets the device's busy time a step and its top kernels.

  PYTHONPATH=. COMMIT=<sha> python scripts/gpu_measure.py --out DIR [--stages parity,t5_1_1_base,...]
      [--deadline 480] [--profile] [--model-timeout 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (model gin, extra gin bindings, label)
MODELS = {
  "t5_1_1_base": ("models/t5_1_1/base.gin", [], "T5.1.1-base"),
  "remixer_sbase": ("models/remixer/sbase.gin", [], "Remixer_SBase"),
  "remixer_base": ("models/remixer/base.gin", [], "Remixer_Base"),
  "hypermixer_base_mb4": (
    "models/hypermixer/base.gin",
    ["run_config.Training.num_microbatches=4"],
    "HyperMixer-base, 4 microbatches",
  ),
  "hypermixer_base": ("models/hypermixer/base.gin", [], "HyperMixer-base"),
  "remixer_sbase_mb2": (
    "models/remixer/sbase.gin",
    ["run_config.Training.num_microbatches=2"],
    "Remixer_SBase, 2 microbatches",
  ),
  "remixer_base_mb2": (
    "models/remixer/base.gin",
    ["run_config.Training.num_microbatches=2"],
    "Remixer_Base, 2 microbatches",
  ),
  "amlp_base": ("models/amlp/base.gin", [], "aMLP-base (its tiny attention through the attention operation)"),
  "t5_1_1_base_fused": (
    "models/t5_1_1/base.gin",
    ["network.T5Config.fuse_projections=True"],
    "T5.1.1-base, fused projections",
  ),
  "t5_1_1_base_bf16_logits": (
    "models/t5_1_1/base.gin",
    ["network.T5Config.logits_in_activation_dtype=True"],
    "T5.1.1-base, bfloat16 logits product",
  ),
  "t5_1_1_small": ("models/t5_1_1/small.gin", [], "T5.1.1-small"),
  "t5_1_1_tiny": ("models/t5_1_1/tiny.gin", ["BATCH_SIZE=8"], "T5.1.1-tiny, batch 8 (a CPU check of this script)"),
}
# Each attention model again with the plain XLA attention (T5Config.attention_impl='xla'), beside its default
# ('auto': the Pallas flash attention on GPUs): `<stage>_xla`.
XLA_ATTENTION = "network.T5Config.attention_impl='xla'"
MODELS.update(
  {
    f"{k}_xla": (gin, [*b, XLA_ATTENTION], f"{label}, XLA attention")
    for k, (gin, b, label) in list(MODELS.items())
    if "hypermixer" not in k
  }
)
# In the order a short GPU slot needs them: the attention micro-benchmark, T5.1.1-base fused beside XLA, the
# Remixer_Base (one command of ~6 minutes with --profile --deadline 330); then the causal HyperMixing kernel
# against its arithmetic alone, T5Config's step-layout options (each kept only if it pays here), then the rest.
DEFAULT_STAGES = (
  "attention",
  "t5_1_1_base",
  "t5_1_1_base_xla",
  "remixer_base",
  "hypermixing",
  "t5_1_1_base_fused",
  "t5_1_1_base_bf16_logits",
  "parity",
  "remixer_sbase",
  "remixer_sbase_xla",
  "hypermixer_base",
  "kernels",
  "cogs_quick",
  "deviceless_t5_1_1_base",
)
TIMEOUTS = {
  "parity": 120,
  "attention": 150,
  "hypermixing": 120,
  "cogs_quick": 420,
  "init_rng": 120,
  "kernels": 300,
  "deviceless": 240,
}
MODEL_TIMEOUT = 200


def versions() -> dict:
  import importlib.metadata as md

  out = {}
  for name in (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "gin-config",
    "numpy",
    "jax-cuda13-plugin",
    "jax-cuda12-plugin",
  ):
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      pass
  return out


def _gpu_name() -> str:
  try:
    return subprocess.run(
      ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      timeout=30,
    ).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return "unknown"


def _parse(model_gin: str, bindings: list[str]):
  """The run (run_config.Run) of `model_gin` with runs/pretrain.gin, bfloat16 activations and `bindings`."""
  from remixer_t5 import gin_utils
  from remixer_t5.training import run_config

  gin_utils.parse_gin(
    [model_gin, "runs/pretrain.gin"], ["ACTIVATION_DTYPE='bfloat16'", *bindings], macro_defaults={"MODEL_DIR": "None"}
  )
  return run_config.from_gin()


def _program(run, device, init_rng: str = "auto"):
  """The run's programs (programs.build: the trainer's) on `device` alone, data rules."""
  from remixer_t5.training import partitioning, programs

  part = partitioning.partitioner("1x1", [device], rules="data")
  return programs.from_run(run.training, run.data.feature_lengths, part, init_rng=init_rng)


def _random_batch(shapes: dict, vocab_size: int, seed: int = 0) -> dict:
  """bench_train's random tokens, every position real, with the packed layout's features (one segment a row)
  and loss weights where `shapes` (programs.batch_shapes) has them."""
  import numpy as np

  from remixer_t5.bench import train as bench_train

  b = shapes["encoder_input_tokens"].shape[0]
  lengths = {"inputs": shapes["encoder_input_tokens"].shape[1], "targets": shapes["decoder_target_tokens"].shape[1]}
  out = bench_train.random_batch(vocab_size, b, lengths, seed)
  for k, s in shapes.items():
    if k.endswith("_positions"):
      out[k] = np.broadcast_to(np.arange(s.shape[1], dtype=np.int32), s.shape).copy()
    elif k not in out:  # segment ids and loss weights
      out[k] = np.ones(s.shape, np.int32)
  return out


def _device_events(trace_path: str) -> list[dict]:
  """The complete events on the device's streams of a perfetto trace (the host's threads left out)."""
  import gzip

  with gzip.open(trace_path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {
    (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  procs = {
    e.get("pid"): e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  return [
    e
    for e in events
    if e.get("ph") == "X"
    and "/device:" in procs.get(e.get("pid"), "")
    and "Stream" in names.get((e.get("pid"), e.get("tid")), "Stream")
  ]


def top_ops(trace_path: str, per: int = 1, n: int = 30, key: str = "name") -> list[tuple[str, float]]:
  """The `n` names with the most time in a perfetto trace's complete events on the device's streams
  (milliseconds per step: the sum over the trace / `per` steps), the host's threads left out. `key="hlo_op"`
  groups by the HLO instruction an event's args name instead (the kernels of one fusion together)."""
  import collections

  total: dict[str, float] = collections.defaultdict(float)
  for e in _device_events(trace_path):
    name = e.get("name", "?") if key == "name" else str(e.get("args", {}).get(key, e.get("name", "?")))
    total[name] += float(e.get("dur", 0)) / 1e3 / per
  return sorted(total.items(), key=lambda kv: -kv[1])[:n]


def device_time(trace_path: str, per: int = 1) -> dict:
  """Per step: the number of device events (kernels and copies), their summed time and the device's busy time
  (the union of their intervals: streams that overlap count once), in milliseconds; and `span_ms`, the whole
  trace's span from the first event's start to the last one's end (all `per` steps, not divided). Busy far
  under the measured step means the device waits (for the host, a copy)."""
  spans = sorted(
    (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in _device_events(trace_path) if "ts" in e
  )
  if not spans:
    return {}
  busy, end = 0.0, spans[0][0]
  for a, b in spans:
    if b > end:
      busy += b - max(a, end)
      end = b
  return {
    "kernels_per_step": len(spans) / per,
    "kernel_ms_per_step": sum(b - a for a, b in spans) / 1e3 / per,
    "busy_ms_per_step": busy / 1e3 / per,
    "span_ms": (spans[-1][1] - spans[0][0]) / 1e3,
  }


def _progress(t0: float, what: str) -> None:
  """A stage's phases on stderr with their times (a stage that runs out of time shows where it was)."""
  print(f"[{time.time() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def stage_model(name: str, steps: int, warmup: int, profile_dir: str | None = None) -> dict:
  import jax
  import numpy as np

  from remixer_t5 import aot_compile
  from remixer_t5.training import mfu, profiling, programs

  model_gin, bindings, label = MODELS[name]
  run = _parse(model_gin, bindings)
  model = run.training.model
  devices = jax.devices()
  prog = _program(run, devices[0])
  lengths, batch_size = dict(run.data.feature_lengths), run.data.batch_size
  pack = programs.packing(model, run.data.pack)
  shapes = programs.batch_shapes(lengths, batch_size, pack)
  row = {
    "stage": name,
    "label": label,
    "batch_size": batch_size,
    "feature_lengths": lengths,
    "pack": pack,
    "num_microbatches": run.training.num_microbatches,
    "device_kind": devices[0].device_kind,
  }
  t0 = start = time.time()
  _progress(start, f"{name}: compiling the train step")
  compiled = prog.compile(prog.train_step, prog.state, prog.batch(batch_size, pack))
  row["compile_seconds"] = round(time.time() - t0, 1)
  _progress(start, "compiled; counting model FLOPs")
  row["memory"] = aot_compile.memory(compiled)
  row["xla_flops_per_device"] = mfu.compiled_flops(compiled)
  row["loops"] = mfu.compiled_loops(compiled)
  try:
    flops, model_loops = mfu.model_flops_and_loops(model, shapes)
  except Exception as e:  # noqa: BLE001 - the timing still counts without an MFU
    flops, model_loops, row["model_flops_error"] = None, None, f"{type(e).__name__}: {e}"
  row["model_flops_per_step"], row["model_flops_loops"] = flops, model_loops
  # the state's initialiser (Program.init, as the trainer runs it): its compile and its run timed apart
  _progress(start, "compiling the initialiser")
  t0 = time.time()
  key = jax.random.PRNGKey(0)
  init_compiled = prog.lower(prog.init, key).compile()
  row["init_compile_seconds"] = round(time.time() - t0, 1)
  t0 = time.time()
  state = jax.block_until_ready(init_compiled(key))
  row["init_run_seconds"] = round(time.time() - t0, 1)
  _progress(start, "initialised; stepping")
  batch = jax.device_put(_random_batch(shapes, model.module.config.vocab_size), prog.batch_sharding)
  losses, times = [], []
  for i in range(warmup + steps):
    t = time.perf_counter()
    state, metrics = compiled(state, batch)
    loss = float(metrics["loss_sum"]) / max(float(metrics["weight_sum"]), 1.0)  # waits for the step
    if i >= warmup:
      times.append(time.perf_counter() - t)
    losses.append(loss)
  t = time.perf_counter()  # back to back, as the trainer dispatches between its log steps
  for _ in range(steps):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  pipelined = (time.perf_counter() - t) / steps
  _progress(start, "timed")
  if profile_dir:  # a trace of 2 steps: its perfetto file beside the rows, and the top kernels in the row
    import glob
    import gzip
    import shutil

    with profiling.trace(None, perfetto=True) as tmp:  # the trainer's `--profile_steps` path, steps annotated
      for i in range(2):
        with profiling.annotate(i + 1):
          state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
    traces = glob.glob(f"{tmp}/**/*perfetto_trace.json.gz", recursive=True)
    if traces:
      shutil.copy(traces[0], Path(profile_dir) / f"{name}.perfetto_trace.json.gz")
      try:
        row["device_time"] = device_time(traces[0], per=2)
        row["top_ops"] = top_ops(traces[0], per=2)
        row["top_hlo_ops"] = top_ops(traces[0], per=2, key="hlo_op")
      except Exception as e:  # noqa: BLE001 - the trace is there to read by hand
        row["top_ops_error"] = f"{type(e).__name__}: {e}"
    else:
      row["top_ops_error"] = f"no perfetto trace under {tmp}: {sorted(glob.glob(f'{tmp}/**', recursive=True))[:10]}"
    with gzip.open(
      Path(profile_dir) / f"{name}.hlo.txt.gz", "wt", compresslevel=6
    ) as f:  # the kernels' fusions, to read by hand
      f.write(compiled.as_text())
  tokens = batch_size * (lengths["inputs"] + lengths["targets"])
  peak = mfu.peak_flops_per_device(devices[0])
  stats = devices[0].memory_stats() or {}
  row.update(
    step_seconds_median=statistics.median(times),
    step_seconds_min=min(times),
    step_seconds_pipelined=pipelined,
    tokens_per_s=tokens / pipelined,
    mfu=mfu.mfu(flops, 1.0 / pipelined, peak) if flops else None,
    peak_flops_per_device=peak,
    losses=[round(x, 4) for x in losses],
    losses_finite=bool(np.all(np.isfinite(losses))),
    peak_bytes_in_use=stats.get("peak_bytes_in_use"),
    bytes_limit=stats.get("bytes_limit"),
  )
  return row


def stage_parity() -> dict:
  import jax
  import numpy as np

  from remixer_t5 import gin_utils
  from remixer_t5.training import optim, partitioning, programs

  jax.config.update("jax_default_matmul_precision", "highest")
  gin_utils.parse_gin(["models/t5_1_1/tiny.gin"], ["DROPOUT_RATE=0.0"])
  model = gin_utils.macro("MODEL")
  lengths = {"inputs": 64, "targets": 32}
  batch = _random_batch(programs.batch_shapes(lengths, 8, pack=False), model.module.config.vocab_size)
  tx = optim.adafactor(learning_rate=1e-2)
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
  out, host_state = {}, None
  for dev in (cpu, gpu):  # the trainer's programs on each device, from the host's initial state
    prog = programs.build(model, tx, lengths, partitioning.partitioner("1x1", [dev], rules="data"))
    host_state = jax.device_get(prog.init_state(0)) if host_state is None else host_state
    state, b = jax.device_put(host_state, prog.shardings), jax.device_put(batch, prog.batch_sharding)
    metrics = prog.eval_step(state.params, b)
    new_state, train_metrics = prog.train_step(state, b)
    out[dev.platform] = (jax.device_get(metrics), jax.device_get(train_metrics), jax.device_get(new_state.params))
  (em_c, tm_c, p_c), (em_g, tm_g, p_g) = out["cpu"], out[gpu.platform]
  diffs = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a, b: float(np.max(np.abs(a - b))), p_c, p_g))
  scale = max(float(np.max(np.abs(x))) for x in jax.tree_util.tree_leaves(p_c))
  row = {
    "stage": "parity",
    "device_kind": gpu.device_kind,
    "loss_cpu": float(em_c["loss_sum"]),
    "loss_gpu": float(em_g["loss_sum"]),
    "grad_norm_cpu": float(tm_c["grad_norm"]),
    "grad_norm_gpu": float(tm_g["grad_norm"]),
    "max_param_diff_after_step": max(diffs),
    "max_param": scale,
  }
  row["loss_rel_diff"] = abs(row["loss_cpu"] - row["loss_gpu"]) / abs(row["loss_cpu"])
  row["grad_norm_rel_diff"] = abs(row["grad_norm_cpu"] - row["grad_norm_gpu"]) / abs(row["grad_norm_cpu"])
  row["ok"] = row["loss_rel_diff"] < 1e-4 and row["grad_norm_rel_diff"] < 1e-3 and max(diffs) < 1e-4 * scale
  return row


def stage_kernels(steps: int, warmup: int, timeout: float) -> dict:
  """`remixer-t5 bench kernels` on this GPU: each COGS step with every implementation field `auto` (the Pallas
  kernels) against plain XLA, variants compiled in one process and timed in alternating rounds."""
  workloads = os.environ.get("GPU_MEASURE_KERNELS", "cogs:t5_1_1,cogs:remixer,cogs:hypermixer,cogs:hypermixer:packed")
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "remixer_t5.cli",
      "bench",
      "kernels",
      "--workloads",
      workloads,
      "--rounds",
      "2",
      "--steps",
      str(steps),
      "--warmup",
      str(warmup),
      "--json",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  if proc.returncode:
    raise RuntimeError(f"bench kernels exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
  return {
    "stage": "kernels",
    "rows": [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")],
    "summary": [line for line in proc.stderr.splitlines() if line.startswith("# ")],
  }


def stage_attention(steps: int, warmup: int) -> dict:
  """bench/attention.py: the fused attention's forward and forward + backward at T5.1.1-base's encoder and
  decoder shapes, at each candidate tiling, beside the XLA form and JAX's Pallas `mha` (no bias: the ceiling).
  On a CPU, its interpreter dry run at tiny shapes."""
  import jax

  from remixer_t5.bench import attention as bench_attention

  dry = jax.devices()[0].platform != "gpu"
  rows = bench_attention.run(dry=dry, repeats=steps, warmup=warmup, log=lambda s: print(s, file=sys.stderr))
  return {"stage": "attention", "dry": dry, "rows": rows}


def stage_hypermixing(steps: int, warmup: int) -> dict:
  """bench/hypermixing.py: the causal HyperMixing kernel at HyperMixer-base's decoder shape, at three tiles,
  against the same arithmetic with no per-position memory traffic (the bound any kernel of the design meets).
  On a CPU, its interpreter dry run at a tiny shape."""
  import jax

  from remixer_t5.bench import hypermixing as bench_hypermixing

  dry = jax.devices()[0].platform != "gpu"
  rows = bench_hypermixing.run(dry=dry, repeats=steps, warmup=warmup, log=lambda s: print(s, file=sys.stderr))
  return {"stage": "hypermixing", "dry": dry, "rows": rows}


def stage_init_rng(model_gin: str = "models/t5_1_1/tiny.gin") -> dict:
  """The builder's `init_rng` forms on this device: the state's initialiser (`Program.init`, one device, data
  rules) lowered with jax's threefry kernel ('kernel') and with XLA's inlined threefry ('inline'), both compiled
  and run here. The kernel computes the same threefry2x32 function, so every value of the two states must be
  bit-identical; the host CPU's initialiser (inlined threefry, the CPU's own float transforms) is compared too,
  each leaf's largest difference within 1e-5 of its largest |value|. The tiny model: the inlined form of a base
  model takes XLA:GPU minutes to compile."""
  import jax
  import numpy as np

  run = _parse(model_gin, [])
  dev, cpu = jax.devices()[0], jax.devices("cpu")[0]
  row = {"stage": "init_rng", "model": model_gin, "device_kind": dev.device_kind}
  states = {}
  for form, device, init_rng in (("kernel", dev, "kernel"), ("inlined", dev, "inline"), ("host", cpu, "inline")):
    prog = _program(run, device, init_rng)
    key = jax.device_put(jax.random.PRNGKey(0), device)
    t0 = time.time()
    lowered = prog.lower(prog.init, key)
    text = lowered.as_text()
    compiled = lowered.compile()
    row[f"{form}_compile_seconds"] = round(time.time() - t0, 2)
    # the kernel's custom call (cu_threefry2x32_ffi on CUDA, hip_... on ROCm)
    row[f"{form}_threefry_kernel_calls"] = len(re.findall(r"custom_call @\w*threefry2x32", text))
    t0 = time.time()
    states[form] = jax.device_get(jax.block_until_ready(compiled(key)))
    row[f"{form}_run_seconds"] = round(time.time() - t0, 2)
  trees = {k: jax.tree_util.tree_structure(v) for k, v in states.items()}
  if len(set(trees.values())) != 1:
    raise ValueError(f"the three initialisers returned different trees: {trees}")
  leaves = {k: jax.tree_util.tree_leaves(v) for k, v in states.items()}
  same = lambda a, b: a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
  differ = [i for i, (a, b) in enumerate(zip(leaves["kernel"], leaves["inlined"])) if not same(a, b)]
  floats = [
    (a.astype(np.float64), b.astype(np.float64))
    for a, b in zip(leaves["kernel"], leaves["host"])
    if np.issubdtype(a.dtype, np.floating) and np.size(a)
  ]
  row["leaves"] = len(leaves["kernel"])
  row["kernel_vs_inlined_leaves_differing"] = len(differ)
  row["host_max_abs_diff"] = max(float(np.max(np.abs(a - b))) for a, b in floats)

  def rel(a, b):  # a leaf's largest difference against its own largest |value| (an all-zero leaf: against 1)
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (scale or 1.0)

  row["host_max_rel_diff"] = max(rel(a, b) for a, b in floats)
  row["max_abs_value"] = max(float(np.max(np.abs(b))) for _, b in floats)
  # on a GPU the check means something only if the kernel form called the kernel and the inlined form did not
  row["kernel_used"] = row["kernel_threefry_kernel_calls"] > 0 and not row["inlined_threefry_kernel_calls"]
  row["ok"] = not differ and row["host_max_rel_diff"] <= 1e-5 and (row["kernel_used"] or dev.platform != "gpu")
  return row


def stage_deviceless(name: str, topology: str, timeout: int) -> dict:
  model_gin, bindings, label = MODELS[name]
  cmd = [
    sys.executable,
    "-m",
    "remixer_t5.cli",
    "compile",
    f"--gin_file={model_gin}",
    "--gin_file=runs/pretrain.gin",
    "--gin.ACTIVATION_DTYPE='bfloat16'",
    *[f"--gin.{b}" for b in bindings],
    f"--topology={topology}",
    "--mesh=1x1",
    "--rules=data",
    "--json",
  ]
  t0 = time.time()
  proc = subprocess.run(
    cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"}
  )
  row = {
    "stage": f"deviceless_{name}",
    "topology": topology,
    "wall_seconds": round(time.time() - t0, 1),
    "returncode": proc.returncode,
  }
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if lines:
    row["report"] = json.loads(lines[-1])
  else:
    row["error"] = proc.stderr.strip()[-1500:]
  return row


def stage_cogs_quick(timeout: float) -> dict:
  """`remixer-t5 repro cogs --quick` on this GPU (T5.1.1 and the Remixer, seed 0, 1,800 steps): its wall time and
  scores, to set beside the CPU's (docs/reproductions.md). Needs the COGS release under $REMIXER_T5_DATA_DIR."""
  out = Path(os.environ.get("GPU_MEASURE_OUT", "/tmp")) / "cogs_quick"
  t0 = time.time()
  proc = subprocess.run(
    [sys.executable, "-m", "remixer_t5.cli", "repro", "cogs", "--quick", "--json", "--out", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  if proc.returncode:
    raise RuntimeError(f"repro cogs --quick exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
  return {"stage": "cogs_quick", "wall_seconds": round(time.time() - t0, 1), "rows": rows[-12:]}


def run_one(stage: str, steps: int, warmup: int, topology: str) -> dict:
  if stage == "parity":
    return stage_parity()
  if stage == "init_rng":
    return stage_init_rng()
  if stage == "attention":
    return stage_attention(steps, warmup)
  if stage == "hypermixing":
    return stage_hypermixing(steps, warmup)
  if stage == "kernels":
    return stage_kernels(steps, warmup, TIMEOUTS["kernels"] - 10)
  if stage.startswith("deviceless_"):
    return stage_deviceless(stage[len("deviceless_") :], topology, TIMEOUTS["deviceless"] - 10)
  if stage == "cogs_quick":
    return stage_cogs_quick(TIMEOUTS["cogs_quick"] - 10)
  if stage in MODELS:
    return stage_model(stage, steps, warmup, os.environ.get("GPU_MEASURE_PROFILE"))
  raise ValueError(
    f"unknown stage {stage!r}: expected parity, attention, hypermixing, init_rng, kernels, "
    f"cogs_quick, deviceless_<model> or one of {sorted(MODELS)}"
  )


def summary(row: dict) -> str:
  s = row["stage"]
  if "error" in row:
    return f"{s}: ERROR {row['error'][-600:]}" + "".join(f"\n    {line}" for line in row.get("progress", []))
  if s == "parity":
    return (
      f"parity ({row['device_kind']} vs host CPU, tiny T5.1.1 f32): loss rel diff {row['loss_rel_diff']:.2e}, "
      f"grad norm rel diff {row['grad_norm_rel_diff']:.2e}, max param diff after a step "
      f"{row['max_param_diff_after_step']:.2e} (max |param| {row['max_param']:.2f}): "
      f"{'OK' if row['ok'] else 'MISMATCH'}"
    )
  if s == "init_rng":
    return (
      f"init_rng ({row['device_kind']}, {row['model']}): kernel vs inlined threefry, "
      f"{row['kernel_vs_inlined_leaves_differing']} of {row['leaves']} state leaves differ (threefry kernel "
      f"calls lowered: {row['kernel_threefry_kernel_calls']} and {row['inlined_threefry_kernel_calls']}); "
      f"compile {row['kernel_compile_seconds']} / {row['inlined_compile_seconds']} s, run "
      f"{row['kernel_run_seconds']} / {row['inlined_run_seconds']} s; host CPU's initialiser max |diff| "
      f"{row['host_max_abs_diff']:.2e}, relative to each leaf {row['host_max_rel_diff']:.2e}: "
      f"{'OK' if row['ok'] else 'MISMATCH'}"
    )
  if s == "attention":
    cell = lambda r: (
      r.get("error", "")[:100]
      or (
        f"fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms ({r['fwd_bwd_tflops']:.1f} TFLOP/s"
        + (f", {100 * r['of_mha']:.0f}% of mha" if "of_mha" in r else "")
        + ")"
        + (f", max diff vs xla {r['max_diff_vs_xla']:.1e}" if "max_diff_vs_xla" in r else "")
      )
    )
    return (
      "attention"
      + (" (CPU interpreter dry run)" if row["dry"] else "")
      + ":"
      + "".join(
        f"\n    {r['shape']} best: forward {r['forward']}, gradient {r['gradient']}"
        if r["form"] == "best"
        else f"\n    {r['shape']} {r['form']}: {cell(r)}"
        for r in row["rows"]
      )
    )
  if s == "hypermixing":
    cell = lambda r: (
      r.get("error", "")[:100]
      or (
        f"fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms, {r['gelu_per_s'] / 1e9:.0f} G GELU/s, "
        f"x{r['dims'][5]} layers {r['decoder_ms']:.0f} ms"
        + (f", {r['of_arithmetic']:.2f}x its arithmetic" if "of_arithmetic" in r else "")
      )
    )
    return (
      "hypermixing"
      + (" (CPU interpreter dry run)" if row["dry"] else "")
      + ":"
      + "".join(f"\n    {r['form']}: {cell(r)}" for r in row["rows"])
    )
  if s == "kernels":
    return "kernels (bench kernels: default against xla):" + "".join(f"\n    {line}" for line in row["summary"])
  if s == "cogs_quick":
    scores = [
      f"{r.get('model')} {r.get('split') or r.get('category')} {r.get('exact_match')}"
      for r in row["rows"]
      if r.get("split") in ("dev", "test")
    ]
    return f"cogs_quick: {row['wall_seconds']} s; " + ", ".join(scores)
  if s.startswith("deviceless_"):
    step = (row.get("report") or {}).get("steps", {}).get("train", {})
    mem = step.get("memory", {})
    return (
      f"{s} ({row['topology']}, {row['wall_seconds']} s): total {mem.get('total_bytes', 0) / 2**30:.2f} GiB, "
      f"roofline {1e3 * step.get('roofline_seconds', 0):.1f} ms, est. MFU {step.get('est_mfu')}"
    )
  m = row["memory"]
  return (
    f"{row['label']} on {row['device_kind']}: compiled in {row['compile_seconds']} s; XLA buffers "
    f"{m['total_bytes'] / 2**30:.2f} GiB (temp {m['temp_bytes'] / 2**30:.2f}), allocator peak "
    f"{(row['peak_bytes_in_use'] or 0) / 2**30:.2f} GiB of {(row['bytes_limit'] or 0) / 2**30:.1f}; step "
    f"{1e3 * row['step_seconds_median']:.1f} ms (waited), {1e3 * row['step_seconds_pipelined']:.1f} ms "
    f"(back to back), {row['tokens_per_s']:,.0f} tokens/s, MFU "
    f"{100 * (row['mfu'] or 0):.1f}%; losses {row['losses'][0]} -> {row['losses'][-1]}; init compiled in "
    f"{row['init_compile_seconds']} s, ran in {row['init_run_seconds']} s"
    + (
      f"\n    device per step: {row['device_time']['kernels_per_step']:.0f} kernels, "
      f"{row['device_time']['kernel_ms_per_step']:.1f} ms of kernels, busy "
      f"{row['device_time']['busy_ms_per_step']:.1f} ms"
      if row.get("device_time")
      else ""
    )
    + "".join(f"\n    {ms:9.2f} ms/step  {op[:110]}" for op, ms in row.get("top_ops", [])[:15])
    + "".join(f"\n    {ms:9.2f} ms/step  hlo {op[:106]}" for op, ms in row.get("top_hlo_ops", [])[:15])
  )


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--stages", default=",".join(DEFAULT_STAGES))
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--deadline", type=float, default=480, help="seconds: start no stage after this")
  ap.add_argument("--topology", default=None, help="deviceless target (default: from nvidia-smi's name)")
  ap.add_argument(
    "--profile",
    action="store_true",
    help="also trace 2 steps of each model: top kernels in its row, the trace in --out",
  )
  ap.add_argument("--model-timeout", type=float, default=MODEL_TIMEOUT, help="seconds a model stage may take")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.one:  # the child: one stage, its row as the last line of stdout
    try:
      row = run_one(args.one, args.steps, args.warmup, args.topology)
    except Exception as e:  # noqa: BLE001 - reported as the row
      import traceback

      row = {"stage": args.one, "error": f"{type(e).__name__}: {e}"[:3000], "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(row, default=str), flush=True)
    return 0
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  os.environ["GPU_MEASURE_OUT"] = str(out)
  if args.profile:
    os.environ["GPU_MEASURE_PROFILE"] = str(out)
  gpu = _gpu_name()
  topology = args.topology or ("h200" if "H200" in gpu else "h100" if "H100" in gpu else "a100")
  head = {
    "stage": "environment",
    "gpu": gpu,
    "python": sys.version.split()[0],
    "versions": versions(),
    # $COMMIT first: a copied working tree may carry a stale .git
    "commit": os.environ.get("COMMIT")
    or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75 (default)"),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
  }
  print(json.dumps(head), flush=True)
  jsonl = out / "gpu_measure.jsonl"
  with jsonl.open("a") as f:
    f.write(json.dumps(head) + "\n")
  start = time.time()
  for stage in [s for s in args.stages.split(",") if s]:
    limit = TIMEOUTS.get(stage, TIMEOUTS["deviceless"] if stage.startswith("deviceless_") else args.model_timeout)
    left = args.deadline - (time.time() - start)
    if left < 30:
      print(f"{stage}: skipped, {left:.0f} s left of the deadline", flush=True)
      continue
    t0 = time.time()
    cmd = [
      sys.executable,
      __file__,
      "--out",
      args.out,
      "--one",
      stage,
      "--steps",
      str(args.steps),
      "--warmup",
      str(args.warmup),
      "--topology",
      topology,
    ]
    try:
      proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(limit, left))
      lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
      row = json.loads(lines[-1]) if lines else {"stage": stage, "error": proc.stderr.strip()[-3000:]}
    except subprocess.TimeoutExpired as e:  # its phases so far (stage_model's progress lines) in the row
      err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
      row = {
        "stage": stage,
        "error": f"did not finish in {min(limit, left):.0f} s",
        "progress": [line for line in err.splitlines() if line.startswith("[")][-20:],
      }
    row["wall_seconds_stage"] = round(time.time() - t0, 1)
    with jsonl.open("a") as f:
      f.write(json.dumps(row, default=str) + "\n")
    print(summary(row), flush=True)
    if "trace" in row:
      print(row["trace"], flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
