"""The seam between the model's plain-JAX operations and each platform's faster kernels.

Model code (`layers.py`, `mixers/`) writes every operation in plain JAX: the paper's equation, which XLA compiles
on every platform and which is the reference each kernel is tested against. Where a platform has a faster form
of the same function, the operation takes a named implementation from an explicit config field, bindable in gin.
Each such operation is one `Operation` below (`OPERATIONS`): its kernels by name, what `auto` picks per platform
and the field that names the choice; the config's valid names (`choices`), the check of a field's value and the
docs' table (`table()`, tested against docs/configuring.md) all come from it. The reference stays in the model
file, beside the paper's equation, and is handed to `Operation.choose`: kernels import nothing of the model.

An implementation named explicitly that cannot take the given inputs (no kernel of that name for this form of
the operation, a dtype or a platform it does not take) computes the reference and says so once in the log
(`hand_back`); under `auto` that choice is silent, as `auto` means "the fastest form available".

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

import dataclasses
import importlib
import logging
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from remixer_t5 import flop_count

log = logging.getLogger(__name__)


def load(name: str) -> Callable:
  """A kernel by its 'module:function' name under remixer_t5/kernels/ (imported on first use)."""
  module, function = name.split(":")
  return getattr(importlib.import_module(f"remixer_t5.kernels.{module}"), function)


@dataclasses.dataclass(frozen=True)
class Operation:
  """One operation with faster forms than its plain-JAX reference.

  `kernels`: implementation name -> 'module:function' of a kernel under kernels/, called as
  `kernel(*args, reference=reference, **static)`. `auto`: platform ('cpu', 'cuda', 'rocm', 'tpu') ->
  implementation name. `field`: the config field that names the choice; `what` and `auto_note` feed the docs."""

  name: str
  field: str
  what: str
  kernels: Mapping[str, str]
  auto: Mapping[str, str]
  auto_note: str = ""

  def choose(self, impl: str, reference: Callable, **static) -> Callable:
    """The function computing the operation with implementation `impl` ('auto', 'xla' or a kernel's name)."""
    check(self.field, impl)
    if impl == "xla" or flop_count.counting():
      return reference
    if impl != "auto":
      if impl not in self.kernels:
        return _Reference(reference, self, impl).handed_back(f"{self.name} has no {impl!r} kernel")
      return self._kernel(impl, _Reference(reference, self, impl), static)
    names = {platform: name for platform, name in self.auto.items() if name in self.kernels}
    target = target_device().platform
    if target in ("cpu", "tpu"):
      return self._kernel(names[target], reference, static) if target in names else reference
    # A GPU: CUDA or ROCm, which the device does not say and lowering does. Any other platform: the reference.
    names = {p: n for p, n in names.items() if p in ("cuda", "rocm")} if target == "gpu" else {}
    if not names:
      return reference
    branches = {platform: self._kernel(name, reference, static) for platform, name in names.items()}
    return lambda *args: _platform_dependent(args, reference, branches)

  def _kernel(self, name: str, reference: Callable, static: Mapping) -> Callable:
    fn = load(self.kernels[name])
    return lambda *args: fn(*args, reference=reference, **static)

  def row(self) -> str:
    """This operation's row of the docs' table."""
    names = ", ".join(f"`{n}`" for n in ("xla", *self.kernels))
    return f"| {self.what} | `{self.field}` | {names} | {self.auto_note} |"


class _Reference:
  """The reference handed to a kernel an implementation was named for explicitly: called as the reference (a
  kernel may build on it), and `hand_back` logs once that the kernel did not take these inputs."""

  def __init__(self, fn: Callable, op: Operation, impl: str):
    self.fn, self.op, self.impl = fn, op, impl

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def handed_back(self, reason: str) -> Callable:
    key = (self.op.name, self.impl, reason)
    if key not in _SAID:
      _SAID.add(key)
      log.warning(
        "%s=%r: %s; computing the plain-JAX reference (%s='xla') there", self.op.field, self.impl, reason, self.op.field
      )
    return self.fn


_SAID: set[tuple[str, str, str]] = set()  # what `hand_back` has logged (a message, not a program's input)


def hand_back(reference: Callable, reason: str, *args, **kwargs):
  """A kernel that cannot take these inputs computes `reference(*args)`; said once where the kernel was named
  explicitly (under `auto`, or called directly with a plain function, silently)."""
  fn = reference.handed_back(reason) if isinstance(reference, _Reference) else reference
  return fn(*args, **kwargs)


ATTENTION = Operation(
  "attention",
  "network.T5Config.attention_impl",
  "attention (every softmax attention: T5.1.1's three, the Remixer's attention part, aMLP's tiny attention)",
  {"cpu": "cpu.attention:seam", "pallas_gpu": "gpu.flash_attention:seam", "pallas_tpu": "tpu.flash_attention:seam"},
  {"cpu": "cpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"},
  "`cpu` (the reference with a CPU-shaped bias gradient) on CPUs; `pallas_gpu` on CUDA GPUs; `pallas_tpu` on TPU "
  "v4 and later (v2/v3: `xla`, as with attention dropout)",
)
HYPERMIXING_CAUSAL = Operation(
  "HyperMixing's causal form",
  "hypermixer.HyperMixing.impl",
  "HyperMixing's causal form",
  {"cpu": "cpu.hypermixing:causal", "pallas_gpu": "gpu.hypermixing:causal"},
  {"cpu": "cpu", "cuda": "pallas_gpu"},
  "`cpu` (C++ loops) on CPUs, `pallas_gpu` on CUDA GPUs",
)
HYPERMIXING_PACKED = Operation(
  "HyperMixing's packed form",
  "hypermixer.HyperMixing.impl",
  "HyperMixing's packed (non-causal, several examples a row) form",
  {"cpu": "cpu.hypermixing:segmented"},
  {"cpu": "cpu"},
  "`cpu` (C++ loops) on CPUs, else `xla`",
)
DROPOUT_MASK = Operation(
  "dropout's keep mask",
  "network.T5Config.dropout_impl",
  "dropout's keep mask (the same bits as `jax.random.bernoulli`)",
  {"cpu": "cpu.threefry:keep_mask"},
  {"cpu": "cpu"},
  "`cpu` (an unrolled hash, large masks computed once) on CPUs, else `xla`",
)
OPERATIONS = (ATTENTION, HYPERMIXING_CAUSAL, HYPERMIXING_PACKED, DROPOUT_MASK)


def choices(field: str) -> tuple[str, ...]:
  """The implementation names a config field takes: 'auto', 'xla' and every kernel of its operations."""
  names = [n for op in OPERATIONS if op.field == field for n in op.kernels]
  if not names:
    raise KeyError(f"no operation is chosen by {field!r}; known fields: {sorted({op.field for op in OPERATIONS})}")
  return ("auto", "xla", *dict.fromkeys(names))


def check(field: str, impl: str) -> None:
  """ValueError naming the field and the choices for an unknown implementation name."""
  if impl not in choices(field):
    raise ValueError(f"{field}={impl!r}: expected one of {choices(field)}")


def table() -> str:
  """The docs' table of operations, their fields, implementations and what `auto` picks."""
  return "\n".join(
    ["| operation | field | implementations | `auto` picks |", "|---|---|---|---|", *(op.row() for op in OPERATIONS)]
  )


def check_attention_shapes(query, key, value, bias) -> None:
  """ValueError naming the shapes when attention kernels' operands are not [b, q, h, d], [b, k, h, d] twice and
  a bias None, [1, h, q, k] or [b, h, q, k]."""
  b, nq, h, d = query.shape
  nk = key.shape[1]
  if key.shape != (b, nk, h, d) or value.shape != key.shape:
    raise ValueError(
      f"flash attention: query {query.shape}, key {key.shape} and value {value.shape} must be "
      f"[b, q, h, d], [b, k, h, d], [b, k, h, d]"
    )
  if bias is not None and (bias.ndim != 4 or bias.shape[0] not in (1, b) or bias.shape[1:] != (h, nq, nk)):
    raise ValueError(f"flash attention: bias {bias.shape} must be [1, {h}, {nq}, {nk}] or [{b}, {h}, {nq}, {nk}]")


def pad_axis(a, axis: int, size: int, value=0):
  """`a` padded at the end of `axis` to `size` with `value` (kernels' operands padded to whole blocks)."""
  pad = size - a.shape[axis]
  return a if not pad else jnp.pad(a, [(0, pad if i == axis else 0) for i in range(a.ndim)], constant_values=value)


def target_device():
  """A device of the platform being compiled for (`.platform` 'cpu', 'gpu' or 'tpu', `.device_kind`): one of the
  mesh traced under, else JAX's first default device."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return jax.devices()[0] if device is None else device


def _platform_dependent(args, reference, branches):
  """Every branch's output in the reference's dtypes (lax.platform_dependent wants them alike; a float32 kernel
  beside a bfloat16 reference is cast back)."""
  like = jax.eval_shape(reference, *args)
  cast = lambda fn: lambda *a: jax.tree_util.tree_map(lambda y, o: y.astype(o.dtype), fn(*a), like)
  return jax.lax.platform_dependent(*args, default=reference, **{p: cast(f) for p, f in branches.items()})
