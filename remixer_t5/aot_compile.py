"""`remixer-t5 compile`: compile a run's steps for a TPU slice or a GPU host on a machine without one (docs/scaling.md).

As MaxText's `train_compile.py` does: libtpu describes a slice's topology
(`jax.experimental.topologies.get_topology_desc`), a mesh is built from its devices with the run's own
partitioning, and the step that `train` runs (`programs.from_run`: the same jitted function, state shapes and
shardings) is lowered from shapes and compiled by XLA's TPU compiler. Nothing runs.

Per device the report gives XLA's buffer assignment (total = arguments + outputs - aliased (the donated state)
+ temporaries + code) against the usable HBM, FLOPs, and XLA's cost model (`optimal_seconds`, a roofline, not a
measured step) with the steps/s and MFU it implies. MFU counts model FLOPs (mfu.model_flops_per_step), HFU
XLA's compiled FLOPs. XLA counts a while loop's body once, so a step with loops gets no time estimate, MFU or
HFU, and a model that loops in its own mixers gets its model FLOPs marked as a lower bound.

GPUs go through XLA's CUDA compiler (the `gpu-compile` extra, in its own venv) with a target config from
remixer_t5/gpu_targets/ in place of libtpu's topology. XLA:GPU compiles a program that does not fit, so `fits`
compares XLA's buffers with JAX's share of device memory; XLA's HLO cost analysis counts no FLOPs for cuBLAS
calls (the report says so); the step time is a roofline, max(FLOPs / bf16 peak, bytes / memory bandwidth).

The compile path imports no TensorFlow or seqio (tests/test_compile.py checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import re
import sys
import time
from importlib import resources
from typing import Any, Callable, Mapping, Sequence

import jax
from jax._src.lib import _jax
from jax.experimental import topologies

from remixer_t5 import quiet
from remixer_t5.training import mfu, partitioning, programs, run_config

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation as libtpu's topology names it.

  `count`: what N in the accelerator name 'vX-N' counts ('cores': N/2 chips on v2, v3, v4, v5p; 'chips' on
  v5e, v6e). `devices_per_chip`: JAX devices per chip (2 on v2/v3: one per TensorCore; 1 with megacore).
  `hbm_gib`: usable HBM per JAX device as XLA's TPU compiler states it for a program too big ("exceeds
  available HBM (15.48G)"). `layouts`: chips -> libtpu topology ('4x4' = 16 chips)."""

  name: str
  count: str
  devices_per_chip: int
  chip_config: str
  hbm_gib: float
  layouts: Mapping[int, str]


_2D = {4: "2x2", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16", 512: "16x32", 1024: "32x32"}
_3D = {
  4: "2x2x1",
  8: "2x2x2",
  16: "2x2x4",
  32: "2x4x4",
  64: "4x4x4",
  128: "4x4x8",
  256: "4x8x8",
  512: "8x8x8",
  1024: "8x8x16",
  2048: "8x16x16",
}
_LITE = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}

GENERATIONS: dict[str, Generation] = {
  "v2": Generation("v2", "cores", 2, "default", 7.48, {k: v for k, v in _2D.items() if k <= 256}),
  "v3": Generation("v3", "cores", 2, "default", 15.48, _2D),
  "v4": Generation("v4", "cores", 1, "megacore", 30.75, _3D),
  "v5p": Generation("v5p", "cores", 1, "megacore", 95.74, _3D),
  "v5e": Generation("v5e", "chips", 1, "default", 15.75, _LITE),
  "v6e": Generation("v6e", "chips", 1, "default", 31.25, _LITE),
}


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """A slice as Cloud TPU names it ('v3-32') and the libtpu topology that describes it ('v3:4x4')."""

  name: str
  generation: Generation
  chips: int
  topology: str
  platform = "tpu"

  @property
  def num_devices(self) -> int:
    return self.chips * self.generation.devices_per_chip

  @property
  def hbm_bytes(self) -> int:
    return int(self.generation.hbm_gib * GIB)

  @property
  def host_bounds(self) -> tuple[int, int, int]:
    """Chips per host: 4 (2x2) on every multi-host slice; single-host v5e/v6e slices hold up to 8."""
    if self.generation.count == "chips" and self.chips <= 8:
      return {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}[self.chips]
    return (2, 2, 1)


def accelerator_names() -> list[str]:
  """Every accelerator name `accelerator` knows, e.g. 'v3-8', ..., 'v3-2048', 'v4-8', ..., 'v5e-256'."""
  return [f"{g.name}-{c * (2 if g.count == 'cores' else 1)}" for g in GENERATIONS.values() for c in g.layouts]


def accelerator(name: str) -> Accelerator | GpuAccelerator:
  """'v3-32' -> the v3:4x4 topology (16 chips, 32 cores; v2/v3/v4/v5p names count cores, v5e/v6e chips);
  'h100x8' -> 8 H100s of one process (GpuAccelerator)."""
  gpu = _gpu_accelerator(name)
  if gpu is not None:
    return gpu
  m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", name.lower())
  gen = GENERATIONS.get(m.group(1)) if m else None
  if gen is None:
    raise ValueError(
      f"unknown accelerator {name!r}; expected a TPU slice such as v3-32 or GPUs such as h100x8: "
      f"one of {', '.join(accelerator_names() + gpu_names())}"
    )
  n = int(m.group(2))
  chips = n // 2 if gen.count == "cores" else n
  if chips not in gen.layouts or (gen.count == "cores" and n % 2):
    known = [x for x in accelerator_names() if x.startswith(gen.name + "-")]
    raise ValueError(f"no {gen.name} slice named {name!r}; {gen.name} slices known here: {', '.join(known)}")
  return Accelerator(f"{gen.name}-{n}", gen, chips, f"{gen.name}:{gen.layouts[chips]}")


# --- GPUs -----------------------------------------------------------------------------------------------
# Each GPU's target config for XLA's CUDA compiler (remixer_t5/gpu_targets/): H100 SXM 80 GB, H200 141 GB,
# A100 SXM 80 GB.
GPU_MODELS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "a100": "a100_sxm_80.txtpb"}
GPU_COUNTS = (1, 2, 4, 8)  # GPUs of one process (one host); more hosts are more processes
CUDA_PLUGINS = ("xla_cuda12", "xla_cuda13")  # jax-cuda12-plugin (the gpu-compile extra's pin), jax-cuda13-plugin
JAX_MEM_FRACTION = 0.75  # JAX's default share of GPU memory for its allocator ($XLA_PYTHON_CLIENT_MEM_FRACTION)


def _target_field(text: str, name: str) -> float:
  m = re.search(rf"\b{name}:\s*([\d.e+]+)", text)
  if not m:
    raise ValueError(f"GPU target config has no {name}")
  return float(m.group(1))


@dataclasses.dataclass(frozen=True)
class GpuAccelerator:
  """`gpus` GPUs of one kind in one process: XLA topology '1x1x<gpus>' (slices x hosts x devices per host)."""

  name: str
  model: str  # a key of GPU_MODELS
  gpus: int
  platform = "cuda"

  @property
  def num_devices(self) -> int:
    return self.gpus

  @property
  def topology(self) -> str:
    return f"1x1x{self.gpus}"

  @functools.cached_property
  def target_config(self) -> str:
    return (resources.files("remixer_t5") / "gpu_targets" / GPU_MODELS[self.model]).read_text()

  @property
  def device_memory_bytes(self) -> int:
    return int(_target_field(self.target_config, "device_memory_size"))

  @property
  def memory_bandwidth(self) -> float:
    return _target_field(self.target_config, "memory_bandwidth")

  @staticmethod
  def mem_fraction() -> float:
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
    try:
      return float(text) if text else JAX_MEM_FRACTION
    except ValueError:
      raise ValueError(f"$XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a number") from None

  @property
  def hbm_bytes(self) -> int:
    """What JAX's allocator gets of each GPU: device memory x the memory fraction."""
    return int(self.device_memory_bytes * self.mem_fraction())


def gpu_names() -> list[str]:
  return [f"{m}x{n}" if n > 1 else m for m in GPU_MODELS for n in GPU_COUNTS]


def _gpu_accelerator(name: str) -> GpuAccelerator | None:
  m = re.fullmatch(r"\s*([a-z]\d+)(?:\s*x\s*(\d+))?\s*", name.lower())
  if not m or m.group(1) not in GPU_MODELS:
    return None
  n = int(m.group(2) or 1)
  if n not in GPU_COUNTS:
    raise ValueError(
      f"{name!r}: {n} GPUs; one process drives {', '.join(map(str, GPU_COUNTS))} GPUs here "
      f"(one host), e.g. {m.group(1)}x8"
    )
  return GpuAccelerator(f"{m.group(1)}x{n}" if n > 1 else m.group(1), m.group(1), n)


class CompilerMissing(RuntimeError):
  """The optional compiler for the requested topology (libtpu, or the CUDA plugin) is not installed."""


def gpu_topology_devices(acc: GpuAccelerator) -> list:
  """The GPUs of `acc`, from XLA's CUDA compiler and the target config (no GPU, driver or CUDA runtime)."""
  try:
    found = any(importlib.util.find_spec(f"jax_plugins.{name}") is not None for name in CUDA_PLUGINS)
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    found = False
  if not found:
    raise CompilerMissing(
      "compiling for a GPU needs XLA's CUDA compiler plugin, which is not installed: `make "
      "gpu-compile-env` (a venv beside .venv with pip install -e '.[gpu-compile]': "
      "jax-cuda12-plugin/pjrt 0.10.2 and nvidia-cuda-nvcc-cu12 for ptxas), then run "
      ".venv-gpu/bin/remixer-t5 compile ...; no GPU is needed"
    )
  try:
    with quiet.hidden_unless_verbose():  # the plugin's start prints "Could not find cuda drivers" from C++
      topo = topologies.get_topology_desc(platform="cuda", target_config=acc.target_config, topology=acc.topology)
  except NotImplementedError as e:  # the plugin did not register: JAX started CUDA (and failed) first
    raise CompilerMissing(
      f"the CUDA plugin is installed but did not start ({e}); run with JAX_PLATFORMS=cpu "
      "(the host compiles; nothing runs on a GPU)"
    ) from e
  devices = list(topo.devices)
  if len(devices) != acc.num_devices:
    raise RuntimeError(f"XLA described {len(devices)} GPUs for {acc.name} ({acc.topology}); expected {acc.num_devices}")
  return devices


def _gpu_cost(compiled) -> dict[str, Any]:
  """XLA's HLO cost analysis of the optimised per-device module (the GPU executable has none of its own)."""
  module = compiled.runtime_executable().hlo_modules()[0]
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  out = {
    "xla_flops_per_device": max(0.0, float(cost.get("flops", 0.0))),
    "bytes_accessed_per_device": max(0.0, float(cost.get("bytes accessed", 0.0))),
    "optimal_seconds": 0.0,
  }
  text = compiled.as_text()
  library = sorted(
    {t for t in re.findall(r'custom_call_target="([^"]+)"', text) if "cublas" in t.lower() or "cudnn" in t.lower()}
  )
  kernels = text.count('custom_call_target="__gpu$xla.gpu.triton"')  # Pallas kernels (kernels/gpu/)
  if kernels:
    out["kernel_calls"] = kernels
  if library:
    out["flops_note"] = (
      f"XLA's count misses the FLOPs of {len(library)} library call kind(s) ({', '.join(library)}): a lower bound"
    )
  return out


def topology_devices(acc: Accelerator, num_slices: int = 1) -> list:
  """The devices of `num_slices` slices of `acc`, from libtpu's topology description (no hardware)."""
  if importlib.util.find_spec("libtpu") is None:
    raise CompilerMissing(
      "compiling for a TPU needs libtpu (XLA's TPU compiler), which is not installed: "
      "pip install -e '.[tpu]' (jax[tpu]==0.10.2 with libtpu==0.0.42.1); no TPU is needed"
    )
  if num_slices < 1:
    raise ValueError(f"--num_slices must be >= 1, got {num_slices}")
  # libtpu reads these at start-up; set, it neither warns nor looks for a TPU's metadata server.
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", acc.name)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_WORKER_ID", "0")
  # Nothing runs on a TPU here, so other processes that loaded libtpu (tests in parallel) are no conflict.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  topo = topologies.get_topology_desc(
    platform="tpu",
    topology_name=acc.topology,
    chip_config_name=acc.generation.chip_config,
    chips_per_host_bounds=acc.host_bounds,
    num_slices=num_slices,
  )
  devices = list(topo.devices)
  if len(devices) != acc.num_devices * num_slices:
    raise RuntimeError(
      f"libtpu described {len(devices)} devices for {num_slices} x {acc.name} "
      f"({acc.topology}); expected {acc.num_devices * num_slices}"
    )
  return devices


# --- compiling ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def without_persistent_cache():
  """Nothing of a deviceless compile goes into JAX's persistent compilation cache ($JAX_COMPILATION_CACHE_DIR): its
  executable cannot be read back without a runtime client ("PjRtCompiler must be constructed with a Client"), and a
  cache hit would report a read as the compile time. JAX decides once per process whether the cache is used, so the
  switch is the minimum compile time an entry needs to be written."""
  was = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e30)
  try:
    yield
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", was)


def memory(compiled) -> dict[str, int]:
  """XLA's buffer assignment of a compiled program, per device (total = arguments + outputs - aliased +
  temporaries + code)."""
  m = compiled.memory_analysis()
  fields = {
    "argument_bytes": m.argument_size_in_bytes,
    "output_bytes": m.output_size_in_bytes,
    "alias_bytes": m.alias_size_in_bytes,
    "temp_bytes": m.temp_size_in_bytes,
    "code_bytes": m.generated_code_size_in_bytes,
  }
  fields = {k: int(v) for k, v in fields.items()}
  fields["total_bytes"] = (
    fields["argument_bytes"]
    + fields["output_bytes"]
    - fields["alias_bytes"]
    + fields["temp_bytes"]
    + fields["code_bytes"]
  )
  peak = getattr(m, "peak_memory_in_bytes", None)
  if peak:
    fields["peak_bytes"] = int(peak)
  return fields


def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  return {
    "xla_flops_per_device": float(cost.get("flops", 0.0)),
    "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)),
    "optimal_seconds": float(cost.get("optimal_seconds", 0.0)),
  }


_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _oom_numbers(message: str) -> tuple[float, float] | None:
  """(needed, available) bytes from XLA's RESOURCE_EXHAUSTED message, or None if it names neither."""
  for pattern in (rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)", rf"Used {_SIZE} of {_SIZE} hbm"):
    m = re.search(pattern, message)
    if m:
      a, ua, b, ub = m.groups()
      return float(a) * _UNITS[ua], float(b) * _UNITS[ub]
  return None


# How far either way a deviceless GPU memory prediction (no autotuning; cuBLAS for the GEMMs Triton could not
# tile) can be from the real GPU compile of the same step (docs/benchmarks.md, "GPU, compiled without a GPU").
GPU_PREDICTION_MARGIN = 0.07


def _hint(acc: Accelerator | GpuAccelerator, rules: str, model) -> str:
  cfg = getattr(model.module, "config", None)
  tips = []
  if rules != "fsdp":
    tips.append("fsdp rules (--gin_file=partitioning/fsdp.gin: parameters and optimizer state split over 'data')")
  if cfg is not None and getattr(cfg, "remat_policy", "none") != "full":
    tips.append("rematerialisation (--gin.network.T5Config.remat_policy=\"'full'\")")
  tips.append("gradient accumulation (--gin.run_config.Training.num_microbatches=4)")
  if isinstance(acc, GpuAccelerator):
    more = [n for n in GPU_COUNTS if n > acc.gpus]
    if more:
      tips.append(f"more GPUs (--topology {acc.model}x{more[-1]})")
    if acc.mem_fraction() < 0.9:
      tips.append(f"a larger share of each GPU for JAX (XLA_PYTHON_CLIENT_MEM_FRACTION=.95; now {acc.mem_fraction()})")
  elif bigger := [c for c in sorted(acc.generation.layouts) if c > acc.chips]:
    per_chip = 2 if acc.generation.count == "cores" else 1
    tips.append(
      f"a bigger slice (--topology {acc.generation.name}-{bigger[0] * per_chip}; "
      "a mesh preset fixes the device count, so pick one for that slice)"
    )
  return "try " + "; ".join(tips)


def compile_run(
  run,
  topology: str,
  *,
  num_slices: int = 1,
  mesh: Any = None,
  rules: str | None = None,
  steps: Sequence[str] = ("train",),
  log: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
  """Compile `steps` ('train', 'eval', 'decode') of `run` (a run_config.Run) for `topology`.

  `mesh`/`rules` override the run's mesh (a preset or 'DxM') and rule set. Returns the report (see the module
  docstring): {'topology', 'devices', 'mesh', 'rules', 'fits', 'steps': {name: {...}}, ...}; a step that does
  not fit has 'fits': False and 'needs_bytes' (from XLA's RESOURCE_EXHAUSTED message)."""
  acc = accelerator(topology)
  if jax.config.jax_platforms is None:
    jax.config.update("jax_platforms", "cpu")  # the host compiles; never look for a TPU or GPU runtime
  gpu = isinstance(acc, GpuAccelerator)
  if gpu and num_slices != 1:
    raise ValueError(f"--num_slices is for TPU slices; {acc.name} is one process's GPUs")
  devices = gpu_topology_devices(acc) if gpu else topology_devices(acc, num_slices)
  training, data = run.training, run.data
  part = partitioning.partitioner(mesh if mesh is not None else training.mesh, devices, rules=rules)
  part.check_batch_size(data.batch_size)
  prog = programs.from_run(training, data.feature_lengths, part)
  pack = programs.packing(training.model, data.pack)
  report = _report_header(acc, devices, num_slices, part, run, pack)
  for name in steps:
    log(
      f"compiling the {name} step for {acc.name} x{num_slices} ({len(devices)} devices, mesh "
      f"{dict(part.mesh.shape)}, rules {part.kind}) ..."
    )
    report["steps"][name] = _compile_step(name, prog, acc, data.batch_size, pack, report["peak_flops_per_device"], log)
  report["fits"] = all(r["fits"] for r in report["steps"].values())
  if not report["fits"]:
    report["hint"] = _hint(acc, part.kind, training.model)
    if isinstance(acc, GpuAccelerator) and all(
      r["fits"] or ("needs_bytes" in r and r["needs_bytes"] <= (1 + GPU_PREDICTION_MARGIN) * r["available_bytes"])
      for r in report["steps"].values()
    ):
      report["hint"] += (
        f" (a near miss: within {GPU_PREDICTION_MARGIN:.0%} of the limit the deviceless GPU "
        "prediction can be wrong either way: docs/benchmarks.md, 'GPU, compiled without a GPU')"
      )
  return report


def _report_header(acc, devices, num_slices: int, part, run, pack: bool) -> dict[str, Any]:
  """The report's description of the target, the mesh and the run; its 'steps' still empty."""
  model, data = run.training.model, run.data
  cfg = getattr(model.module, "config", None)
  report: dict[str, Any] = {
    "topology": acc.name,
    "platform": acc.platform,
    "xla_topology": acc.topology,
    "num_slices": num_slices,
    "devices": len(devices),
    "device_kind": devices[0].device_kind,
    "mesh": dict(part.mesh.shape),
    "rules": part.kind,
    "hbm_bytes_per_device": acc.hbm_bytes,
    "peak_flops_per_device": mfu.peak_flops_per_device(devices[0], override=run.training.peak_flops_per_device),
    "batch_size": data.batch_size,
    "feature_lengths": dict(data.feature_lengths),
    "pack": pack,
    "num_microbatches": run.training.num_microbatches,
    "model": type(model.module).__name__,
    "dtype": getattr(cfg, "dtype", None),
    "remat_policy": getattr(cfg, "remat_policy", None),
    "scan_layers": getattr(cfg, "scan_layers", None),
    "steps": {},
  }
  if isinstance(acc, GpuAccelerator):
    report.update(
      device_memory_bytes=acc.device_memory_bytes,
      mem_fraction=acc.mem_fraction(),
      memory_bandwidth=acc.memory_bandwidth,
    )
  else:
    report["libtpu_topology"] = acc.topology
  return report


def _compile_step(name: str, prog, acc, batch_size: int, pack: bool, peak, log) -> dict[str, Any]:
  """One step of `prog` compiled for `acc`: its row (memory, XLA's costs, the estimates they imply)."""
  batch = prog.batch(batch_size, pack)
  if name == "train":
    row = _compiled_row(prog, acc, peak, log, prog.train_step, prog.state, batch)
    return _with_model_flops(row, prog, acc, batch_size, pack, peak)
  if name == "eval":
    return _compiled_row(prog, acc, peak, log, prog.eval_step, prog.state.params, batch)
  if name == "decode":
    return _compiled_row(
      prog,
      acc,
      peak,
      log,
      programs.jit_decode(prog.model),
      prog.state.params,
      batch["encoder_input_tokens"],
      prog.feature_lengths["targets"],
      name="decode",
    )
  raise ValueError(f"unknown step {name!r}; expected train, eval or decode")


def _compile(prog, acc, log, fn, *args):
  """(compiled, the XLA options it needed): without a GPU to autotune on, XLA:GPU's Triton GEMM emitter finds no
  tiling for some dots (base models' attention output projection: "Couldn't find output tile sizes"); cuBLAS
  takes them instead. A missing CUDA toolkit is named."""
  gpu = isinstance(acc, GpuAccelerator)
  try:
    with without_persistent_cache():
      try:
        return prog.compile(fn, *args), None
      except Exception as e:  # noqa: BLE001 - XLA raises its own error types
        if not (gpu and "find output tile sizes" in str(e)):
          raise
        options = {"xla_gpu_enable_triton_gemm": False}
        log(f"  XLA's Triton GEMM emitter found no tiling without a GPU to autotune on; compiling with {options}")
        return prog.compile(fn, *args, compiler_options=options), options
  except Exception as e:  # noqa: BLE001
    if gpu and "libdevice not found" in str(e):
      raise CompilerMissing(
        "XLA's CUDA compiler found no CUDA toolkit (ptxas, libdevice): pip install "
        "nvidia-cuda-nvcc-cu12 (in the gpu-compile extra) or point "
        "--xla_gpu_cuda_data_dir in $XLA_FLAGS at a CUDA install"
      ) from e
    raise


def _compiled_row(prog, acc, peak, log, fn, *args, name: str = "") -> dict[str, Any]:
  """The row of one compiled step: memory against the device's, XLA's FLOPs and bytes, and a step-time estimate
  where XLA's counts make one (no loops, no kernels it cannot see); `fits` False with the numbers of XLA's
  RESOURCE_EXHAUSTED error when it does not compile into memory."""
  gpu = isinstance(acc, GpuAccelerator)
  t0 = time.time()
  try:
    compiled, options = _compile(prog, acc, log, fn, *args)
  except Exception as e:  # noqa: BLE001
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    row = {"fits": False, "compile_seconds": time.time() - t0, "xla_error": str(e).strip().splitlines()[0][:500]}
    numbers = _oom_numbers(str(e))
    if numbers:
      row["needs_bytes"], row["available_bytes"] = numbers
    return row
  row = {"fits": True, "compile_seconds": time.time() - t0, "memory": memory(compiled)}
  row.update(_gpu_cost(compiled) if gpu else _cost(compiled))
  if options:
    row["xla_options"] = options
  row["needs_bytes"], row["available_bytes"] = row["memory"]["total_bytes"], acc.hbm_bytes
  row["fits"] = row["needs_bytes"] <= acc.hbm_bytes
  loops = mfu.compiled_loops(compiled)
  if loops:
    row["loops"] = loops
  _estimate(row, acc, prog, loops, name, peak)
  return row


def _estimate(row: dict, acc, prog, loops, name: str, peak) -> None:
  """A step time from XLA's cost model (TPU) or a roofline (GPU), or the note why there is none. XLA's cost
  model counts a while loop's body once: a scanned stack's step time (the decode loop's, a microbatch loop's, a
  mixer's chunked scan's) would be a fraction of the real one (and its MFU could pass 100%)."""
  cfg = getattr(prog.model.module, "config", None)
  loop = (
    "the layers are scanned"
    if getattr(cfg, "scan_layers", False)
    else "decoding is a loop over target positions"
    if name == "decode"
    else f"the step runs {len(loops)} kind(s) of while loop ({'; '.join(loops[:3])}{'; ...' if len(loops) > 3 else ''})"
    if loops
    else None
  )
  kernels = (
    f"the step calls {row['kernel_calls']} Pallas (Triton) kernel(s), whose FLOPs and bytes XLA's "
    "cost analysis does not see"
    if row.get("kernel_calls")
    else None
  )
  if loop:
    row["estimate_note"] = f"{loop}: XLA's cost model counts the loop body once, so its time is not a step time" + (
      f"; and {kernels}" if kernels else ""
    )
  elif kernels:
    row["estimate_note"] = f"{kernels}, so no step time is implied"
  elif row["optimal_seconds"] > 0:
    row["est_steps_per_s"] = 1.0 / row["optimal_seconds"]
  elif isinstance(acc, GpuAccelerator) and peak and row["xla_flops_per_device"] > 0:
    # No cost-model time on GPUs: a roofline from XLA's FLOP and byte counts, bf16 peak and HBM bandwidth; the
    # train step puts model FLOPs in when XLA's count misses cuBLAS calls (flops_note).
    row["roofline_seconds"] = max(
      row["xla_flops_per_device"] / peak, row["bytes_accessed_per_device"] / acc.memory_bandwidth
    )
    row["est_steps_per_s"] = 1.0 / row["roofline_seconds"]


def _with_model_flops(row: dict, prog, acc, batch_size: int, pack: bool, peak) -> dict:
  """The train row with the model's FLOPs (mfu.py) and the MFU (and HFU) its estimated step time implies."""
  lengths, devices = prog.feature_lengths, prog.mesh.size
  t0 = time.time()
  model_flops, model_loops = mfu.model_flops_and_loops(prog.model, programs.batch_shapes(lengths, batch_size, pack))
  row.update(
    model_flops_per_step=model_flops,
    model_flops_per_device=model_flops / devices,
    model_flops_per_token=model_flops / (batch_size * (lengths["inputs"] + lengths["targets"])),
    model_flops_seconds=time.time() - t0,
  )
  if model_loops:
    row["model_flops_note"] = (
      f"a lower bound: the model itself loops ({model_loops} while loops in the "
      "lowered step, e.g. a mixer's chunked scan) and each loop body counts once"
    )
  if row.get("roofline_seconds") and row.get("flops_note"):  # XLA's FLOPs miss the cuBLAS GEMMs
    flops = max(row["xla_flops_per_device"], row["model_flops_per_device"])
    row["roofline_seconds"] = max(flops / peak, row["bytes_accessed_per_device"] / acc.memory_bandwidth)
    row["est_steps_per_s"] = 1.0 / row["roofline_seconds"]
    row["roofline_note"] = "FLOPs: the model's (XLA's count misses the cuBLAS GEMMs)"
  if row.get("est_steps_per_s") and peak and not model_loops:
    row["est_mfu"] = mfu.mfu(row["model_flops_per_device"], row["est_steps_per_s"], peak)
    if not row.get("flops_note"):  # XLA's count would be missing the GEMMs
      row["est_hfu"] = mfu.mfu(row["xla_flops_per_device"], row["est_steps_per_s"], peak)
  return row


# --- output ---------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
  return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def format_report(report: Mapping[str, Any]) -> str:
  where = (
    f"{report['topology']} (XLA topology {report['xla_topology']}: {report['devices']} x "
    f"{report['device_kind']}; JAX gets {report['mem_fraction']:.2f} of each GPU's "
    f"{_gib(report['device_memory_bytes'])})"
    if report.get("platform") == "cuda"
    else f"{report['num_slices']} x {report['topology']} ({report['libtpu_topology']}: {report['devices']} "
    f"devices, {report['device_kind']})"
  )
  lines = [
    f"{report['model']} on {where}, mesh {report['mesh']}, rules "
    f"{report['rules']}; batch {report['batch_size']}, lengths {report['feature_lengths']}, "
    f"activations {report['dtype']}, remat {report['remat_policy']}, scan {report['scan_layers']}"
  ]
  for name, r in report["steps"].items():
    lines.append(f"{name} step: compiled in {r['compile_seconds']:.1f} s")
    if "memory" in r:
      m = r["memory"]
      lines.append(
        f"  per device: arguments {_gib(m['argument_bytes'])}, outputs {_gib(m['output_bytes'])} "
        f"(aliased with arguments {_gib(m['alias_bytes'])}), temporaries {_gib(m['temp_bytes'])}, "
        f"code {_gib(m['code_bytes'])}; total {_gib(m['total_bytes'])} of {_gib(r['available_bytes'])} "
        f"HBM ({100 * m['total_bytes'] / r['available_bytes']:.0f}%)"
        + (f"; XLA's peak of live buffers {_gib(m['peak_bytes'])}" if m.get("peak_bytes") else "")
      )
    if not r["fits"]:
      lines.append(
        f"  DOES NOT FIT: needs {_gib(r['needs_bytes'])} per device, {_gib(r['available_bytes'])} available"
        if "needs_bytes" in r
        else f"  DOES NOT FIT: {r.get('xla_error', '')}"
      )
      continue
    if "model_flops_per_step" in r:
      lines.append(
        f"  model FLOPs: {r['model_flops_per_step']:.3e} per step, {r['model_flops_per_device']:.3e} "
        f"per device, {r['model_flops_per_token']:.3e} per token (fwd+bwd, unscanned, no remat)"
        + (f"; {r['model_flops_note']}" if r.get("model_flops_note") else "")
      )
    lines.append(
      f"  XLA: {r['xla_flops_per_device']:.3e} FLOPs and {r['bytes_accessed_per_device'] / 1e9:.1f} GB "
      "accessed per device (compiled; a loop body counts once)"
      + (f"; {r['flops_note']}" if r.get("flops_note") else "")
    )
    if r.get("est_steps_per_s"):
      util = (
        ""
        if r.get("est_mfu") is None
        else f", MFU {100 * r['est_mfu']:.1f}%"
        + ("" if r.get("est_hfu") is None else f" (HFU {100 * r['est_hfu']:.1f}%)")
      )
      if r.get("roofline_seconds"):
        lines.append(
          f"  roofline step time {r['roofline_seconds'] * 1e3:.1f} ms (XLA's FLOPs / bf16 peak, bytes / "
          f"HBM bandwidth) -> {r['est_steps_per_s']:.2f} steps/s{util} (a bound, not a measurement)"
        )
      else:
        lines.append(
          f"  XLA's estimated step time {r['optimal_seconds'] * 1e3:.1f} ms -> "
          f"{r['est_steps_per_s']:.2f} steps/s{util} (cost model, not a measurement)"
        )
    elif r.get("estimate_note"):
      lines.append(f"  no estimated step time: {r['estimate_note']}")
  if not report["fits"]:
    lines.append(f"does not fit: {report['hint']}")
  return "\n".join(lines)


def main(
  topology: str,
  *,
  num_slices: int = 1,
  mesh: str | None = None,
  rules: str | None = None,
  steps: Sequence[str] = ("train",),
  as_json: bool = False,
) -> int:
  """`remixer-t5 compile` after gin is parsed: 0 when every step fits, 1 when one does not."""
  report = compile_run(
    run_config.from_gin(),
    topology,
    num_slices=num_slices,
    mesh=mesh,
    rules=rules,
    steps=steps,
    log=lambda m: print(m, file=sys.stderr, flush=True),
  )
  print(json.dumps(report) if as_json else format_report(report))
  if not report["fits"]:
    bad = next(r for r in report["steps"].values() if not r["fits"])
    needs = (
      f"needs {_gib(bad['needs_bytes'])} per device, {_gib(bad['available_bytes'])} available"
      if "needs_bytes" in bad
      else bad.get("xla_error", "out of memory")
    )
    print(f"remixer-t5 compile: does not fit on {topology}: {needs}; {report['hint']}", file=sys.stderr)
    return 1
  return 0
