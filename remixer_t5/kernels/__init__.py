"""The seam between the model's plain-JAX operations and each platform's faster kernels.

Model code (`layers.py`, `mixers/`) writes every operation in plain JAX: the paper's equation, which XLA compiles
on every platform and which is the reference each kernel is tested against. Where a platform has a faster form
of the same function, the operation takes a named implementation from an explicit config field, bindable in gin:

| operation | field | implementations | `auto` picks |
|---|---|---|---|
| attention, softmax(q k^T + bias) v | `T5Config.attention_impl` | `xla`, `cpu`, `pallas_gpu`, `pallas_tpu` | `cpu` on CPUs, `pallas_gpu` on CUDA GPUs, `pallas_tpu` on TPUs (v4 and later; XLA's form on v2/v3) |
| HyperMixing's causal and packed forms | `HyperMixing.impl` | `xla`, `cpu`, `pallas_gpu` | `cpu` on CPUs, `pallas_gpu` (causal) on CUDA GPUs |
| dropout's keep mask | `T5Config.dropout_impl` | `xla`, `cpu` | `cpu` on CPUs, else `xla` |

`auto` picks by the platform the program is compiled for, read at trace time: traced under a mesh (as the trainer
and `remixer-t5 compile` trace every step), that of the mesh's devices; otherwise that of JAX's default backend,
where `jax.jit` places the program. A program compiled on a CPU host for a TPU slice or a GPU (under that
topology's mesh, as `remixer-t5 compile` builds it) gets that platform's choice, and the same gin files give the
same program from the CLI, from Python and under t5x. Nothing a command line sets changes the choice. (Lowering
for another platform without its mesh, `.lower(lowering_platforms=...)`, keeps the default backend's choice: bind
the field to name the implementation.) Only CUDA and ROCm, which a device does not tell apart, are left to
lowering (`jax.lax.platform_dependent`). Inside `flop_count.counting_model_flops()` every operation takes its XLA
form, whose FLOPs XLA's cost analysis can count (it counts a custom call as none).

Kernels live in `cpu/` (C++ through XLA's FFI), `gpu/` (Pallas, Triton) and `tpu/` (Pallas, Mosaic), are
imported only when a program uses them, and import nothing of the model; `sharding.py` runs a custom-call
kernel on each device's batch rows under a mesh.
"""
from __future__ import annotations

import importlib
from typing import Callable, Mapping

from remixer_t5 import flop_count


def load(name: str) -> Callable:
  """A kernel by its 'module:function' name under remixer_t5/kernels/ (imported on first use)."""
  module, function = name.split(":")
  return getattr(importlib.import_module(f"remixer_t5.kernels.{module}"), function)


def check_attention_shapes(query, key, value, bias) -> None:
  """ValueError naming the shapes when attention kernels' operands are not [b, q, h, d], [b, k, h, d] twice and
  a bias None, [1, h, q, k] or [b, h, q, k]."""
  b, nq, h, d = query.shape
  nk = key.shape[1]
  if key.shape != (b, nk, h, d) or value.shape != key.shape:
    raise ValueError(f"flash attention: query {query.shape}, key {key.shape} and value {value.shape} must be "
                     f"[b, q, h, d], [b, k, h, d], [b, k, h, d]")
  if bias is not None and (bias.ndim != 4 or bias.shape[0] not in (1, b) or bias.shape[1:] != (h, nq, nk)):
    raise ValueError(f"flash attention: bias {bias.shape} must be [1, {h}, {nq}, {nk}] or [{b}, {h}, {nq}, {nk}]")


def pad_axis(a, axis: int, size: int, value=0):
  """`a` padded at the end of `axis` to `size` with `value` (kernels' operands padded to whole blocks)."""
  import jax.numpy as jnp
  pad = size - a.shape[axis]
  return a if not pad else jnp.pad(a, [(0, pad if i == axis else 0) for i in range(a.ndim)], constant_values=value)


def check(field: str, impl: str, names: tuple[str, ...]) -> None:
  """ValueError naming the field and the choices for an unknown implementation name."""
  if impl not in ("auto", "xla", *names):
    raise ValueError(f"{field}={impl!r}: expected one of {('auto', 'xla', *names)}")


def choose(impl: str, reference: Callable, kernels: Mapping[str, str], auto: Mapping[str, str],
           **static) -> Callable:
  """The function computing an operation with implementation `impl`.

  reference: the plain-JAX form (`xla`). kernels: implementation name -> 'module:function' of a kernel called
  as `kernel(*args, reference=reference, **static)` (it may hand back to the reference for inputs it does not
  take, e.g. a dtype). auto: platform ('cpu', 'cuda', 'rocm', 'tpu') -> implementation name for `auto`. An
  implementation this operation has no kernel for computes the reference.
  """
  if impl == "xla" or flop_count.counting():
    return reference

  def kernel(name: str) -> Callable:
    if name not in kernels:
      return reference
    fn = load(kernels[name])
    return lambda *args: fn(*args, reference=reference, **static)

  if impl != "auto":
    return kernel(impl)
  names = {platform: name for platform, name in auto.items() if name in kernels}
  target = target_device().platform
  if target in ("cpu", "tpu"):
    return kernel(names[target]) if target in names else reference
  # A GPU: CUDA or ROCm, which the device does not say and lowering does. Any other platform: the reference.
  names = {p: n for p, n in names.items() if p in ("cuda", "rocm")} if target == "gpu" else {}
  if not names:
    return reference
  branches = {platform: kernel(name) for platform, name in names.items()}
  return lambda *args: _platform_dependent(args, reference, branches)


def target_device():
  """A device of the platform being compiled for (`.platform` 'cpu', 'gpu' or 'tpu', `.device_kind`): one of the
  mesh traced under, else JAX's first default device."""
  import jax
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return jax.devices()[0] if device is None else device


def _platform_dependent(args, reference, branches):
  """Every branch's output in the reference's dtypes (lax.platform_dependent wants them alike; a float32 kernel
  beside a bfloat16 reference is cast back)."""
  import jax
  like = jax.eval_shape(reference, *args)
  cast = lambda fn: lambda *a: jax.tree_util.tree_map(lambda y, o: y.astype(o.dtype), fn(*a), like)
  return jax.lax.platform_dependent(*args, default=reference, **{p: cast(f) for p, f in branches.items()})
