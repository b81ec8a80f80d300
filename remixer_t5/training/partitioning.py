"""Device mesh, logical-axis rules and shardings: the only place that knows about mesh axes.

Parameters and activations carry logical names (layers.py). A rule set maps them onto a ('data', 'model')
mesh with flax/t5x semantics: rules are tried in order and a mesh axis is used at most once per array, so an
activation ('batch', 'length', 'embed') keeps 'data' for its batch even when 'embed' -> 'data' is a rule.

  kind        batch          vocab, heads, mlp, joined_kv   embed   t5x equivalent
  data        data x model   replicated                     -       pure data parallelism
  data_model  data           model                          -       standard_logical_axis_rules() (default)
  fsdp        data           model                          data    standard_logical_axis_rules(
                                                                      parameter_partitioning_dims=2)

Presets (`make_mesh(shape=NAME)`, `mesh_spec(preset=NAME)`, gin/partitioning/NAME.gin):

  preset      devices     (data, model)  rules       for
  cpu         all local   (N, 1)         data        tests, demos
  tpu_v3_8    8 cores     (8, 1)         fsdp        v3-8 (4 chips x 2 cores); base (large: tpu_v3_8_large.gin)
  tpu_v3_32   32 cores    (32, 1)        fsdp        the paper's 16 v3 chips; base to xl, batch 128
  tpu_v3_128  128 cores   (128, 1)       fsdp        v3-128 (64 chips); base and large
  tpu_v3_128_xl 128 cores (32, 4)        fsdp        v3-128 for xl-sized models
  gpu_8       8 GPUs      (8, 1)         fsdp        one 8-GPU host (ZeRO-3-like parameter sharding)

The TPU presets are the fastest setting that fits by XLA's estimate of the compiled pretraining step (docs/scaling.md,
"Meshes and presets"). A slice's global batch must be a multiple of its data axis (`check_batch_size`).

A dimension that its mesh axes do not divide is replicated instead (logged per parameter): jit refuses
uneven parameter shardings. A `Partitioner` (t5x's partitioner: a mesh and its rules, `partitioner(...)` from a
`MeshSpec`) is what a run passes where shardings are made; the module's functions take a mesh and rules alike,
the rules defaulting to DEFAULT_RULES. Nothing here keeps state between calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import optax
from flax import linen as nn
from flax.core import unfreeze
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

AXES = ("data", "model")
Rules = tuple[tuple[str, Any], ...]

# Logical axes that no rule set shards (t5x's replicated rules plus this repository's mixer axes).
_REPLICATED: Rules = (
  ("kv", None),
  ("relpos_buckets", None),
  ("abspos_buckets", None),  # learned absolute position embeddings (t5x's name; FNet)
  ("length", None),
  ("layers", None),  # the stacked-layers axis of scanned stacks (T5Config.scan_layers)
  ("mix_length", None),  # fixed-length position axes of token-mixing weights (MLP-Mixer, Remixer's H)
  ("mix_source", None),  # the source-position axis of an L x L mixing matrix (H, gMLP's W)
  ("mix_hidden", None),  # hidden width of token-mixing MLPs (HyperMixer, MLP-Mixer)
  ("projection", None),  # pNLP-Mixer projection features
)

RULE_SETS: dict[str, Rules] = {
  # Every device holds every parameter; the batch is split over all of them.
  "data": (
    ("batch", ("data", "model")),
    ("vocab", None),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("joined_kv", None),
  )
  + _REPLICATED,
  # t5x standard_logical_axis_rules(): 1-D parameter sharding (Megatron-style over 'model').
  "data_model": (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("joined_kv", "model"),
  )
  + _REPLICATED,
  # t5x standard_logical_axis_rules(parameter_partitioning_dims=2): parameters' embed axis also over 'data'.
  # ('embed', 'data') comes after ('batch', 'data'), so activations keep the batch on 'data'.
  "fsdp": (
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("joined_kv", "model"),
    ("embed", "data"),
  )
  + _REPLICATED,
}
DEFAULT_KIND = "data_model"
DEFAULT_RULES: Rules = RULE_SETS[DEFAULT_KIND]


@dataclasses.dataclass(frozen=True)
class Preset:
  shape: tuple[int, int] | None  # None: (all devices, 1)
  rules: str
  about: str


PRESETS: dict[str, Preset] = {
  "cpu": Preset(None, "data", "all local devices, data parallel"),
  "tpu_v3_8": Preset((8, 1), "fsdp", "TPU v3-8: 4 chips x 2 cores"),
  "tpu_v3_32": Preset((32, 1), "fsdp", "TPU v3-32: the paper's 16 chips = 32 cores"),
  "tpu_v3_128": Preset((128, 1), "fsdp", "TPU v3-128: 64 chips = 128 cores"),
  "tpu_v3_128_xl": Preset((32, 4), "fsdp", "TPU v3-128 for xl-sized models: 64 chips = 128 cores"),
  "gpu_8": Preset((8, 1), "fsdp", "one host with 8 GPUs"),
}


def logical_rules(kind: str = DEFAULT_KIND) -> Rules:
  """The rule set named `kind`: 'data', 'data_model' or 'fsdp' (see the module docstring)."""
  if kind not in RULE_SETS:
    raise ValueError(f"unknown partitioning rules {kind!r}; expected one of {', '.join(RULE_SETS)}")
  return RULE_SETS[kind]


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """The mesh and rules a run asks for (`partitioner` builds them); gin binds one at `run_config.Training.mesh`."""

  preset: str | None = None
  shape: tuple[int, int] | str | None = None  # (data, model) or 'DxM'
  num_partitions: int | None = None
  rules: str | Rules | None = None  # a kind name or a rule tuple; None: the preset's, else DEFAULT_KIND


def mesh_spec(
  preset: str | None = None,
  shape: tuple[int, int] | str | None = None,
  num_partitions: int | None = None,
  rules: str | Rules | None = None,
) -> MeshSpec:
  """gin: `run_config.Training.mesh = @partitioning.mesh_spec()`, `partitioning.mesh_spec.preset = 'gpu_8'`."""
  return MeshSpec(preset, shape, num_partitions, rules)


def _as_rules(rules: str | Sequence | None) -> Rules | None:
  if rules is None:
    return None
  if isinstance(rules, str):
    return logical_rules(rules)
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def _parse_shape(shape) -> tuple[int, int]:
  if isinstance(shape, str):
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", shape)
    if not m:
      raise ValueError(f"mesh {shape!r} is neither a preset ({', '.join(PRESETS)}) nor 'DATAxMODEL', e.g. '4x2'")
    return int(m.group(1)), int(m.group(2))
  shape = tuple(int(s) for s in shape)
  if len(shape) != 2:
    raise ValueError(f"mesh shape {shape} must be (data, model)")
  return shape


def mesh_plan(num_partitions: int = 1, shape=None, num_devices: int | None = None) -> tuple[tuple[int, int], Rules]:
  """((data, model), rules) for what `make_mesh` accepts, without devices.

  `shape`: None (all `num_devices`, `num_partitions` of them along 'model'), a (data, model) tuple, 'DxM', a
  preset name, or a `MeshSpec`. A preset whose size is not `num_devices` is an error; `num_devices=None`
  skips that check (abstract meshes) except where the shape depends on it."""
  rules = None
  if isinstance(shape, MeshSpec):
    spec = shape
    rules = _as_rules(spec.rules)
    if spec.preset is not None and (spec.shape is not None or spec.num_partitions is not None):
      raise ValueError(
        f"mesh_spec got preset={spec.preset!r} and also shape={spec.shape!r} / "
        f"num_partitions={spec.num_partitions!r}; give the preset or a shape"
      )
    shape = spec.preset if spec.preset is not None else spec.shape
    num_partitions = spec.num_partitions or num_partitions
  if isinstance(shape, str) and shape in PRESETS:
    if num_partitions != 1:
      raise ValueError(f"mesh preset {shape!r} fixes the mesh; num_partitions={num_partitions} conflicts with it")
    preset = PRESETS[shape]
    if preset.shape is None:
      plan = (num_devices or jax.device_count(), 1)
    else:
      plan = preset.shape
      if num_devices is not None and math.prod(plan) != num_devices:
        raise ValueError(
          f"mesh preset {shape!r} ({preset.about}) needs {math.prod(plan)} devices as "
          f"(data, model) = {plan}, but the mesh gets {num_devices} "
          f"(jax.device_count() = {jax.device_count()})"
        )
    return plan, rules or logical_rules(preset.rules)
  if shape is None:
    n = num_devices if num_devices is not None else jax.device_count()
    if num_partitions < 1 or n % num_partitions:
      raise ValueError(f"num_partitions={num_partitions} does not divide the {n} devices")
    return (n // num_partitions, num_partitions), rules or DEFAULT_RULES
  return _parse_shape(shape), rules or DEFAULT_RULES


def make_mesh(num_partitions: int = 1, shape=None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'model') mesh of `devices` (default all); `shape` as in `mesh_plan`."""
  devices = list(devices) if devices is not None else jax.devices()
  plan, _ = mesh_plan(num_partitions, shape, len(devices))
  if math.prod(plan) != len(devices):
    raise ValueError(f"mesh shape {plan} needs {math.prod(plan)} devices, have {len(devices)}")
  return Mesh(_device_grid(plan, devices), AXES, axis_types=(AxisType.Auto,) * 2)


def _device_grid(plan: tuple[int, int], devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices laid out as `plan`; across several TPU slices (multislice: devices carry `slice_index`) the 'data'
  axis spans the slices, so only the data-parallel gradient reduction crosses the slower data-centre network."""
  slices = sorted({getattr(d, "slice_index", None) or 0 for d in devices})
  if len(slices) > 1:
    n = len(slices)
    if plan[0] % n:
      raise ValueError(f"mesh (data, model) = {plan} over {n} slices: the data axis must be a multiple of {n}")
    return mesh_utils.create_hybrid_device_mesh((plan[0] // n, plan[1]), (n, 1), devices)
  return mesh_utils.create_device_mesh(plan, devices)


@dataclasses.dataclass(frozen=True)
class Partitioner:
  """A mesh and the logical-axis rules that place a run's arrays on it (t5x's partitioner). The trainer,
  `remixer-t5 compile`, `bench` and `info` each make one from the run's `MeshSpec` (`partitioner`) and pass it
  where shardings are made. `mesh` may be abstract (`info`: specs only)."""

  mesh: Mesh | AbstractMesh
  rules: Rules = DEFAULT_RULES

  @property
  def kind(self) -> str:
    return rules_kind(self.rules)

  def param_specs(self, params_axes, params=None):
    return param_specs(params_axes, self.mesh, self.rules, params=params)

  def param_shardings(self, params_axes, params=None):
    return param_shardings(params_axes, self.mesh, self.rules, params=params)

  def opt_state_shardings(self, abstract_opt, params, param_sh):
    return opt_state_shardings(abstract_opt, params, param_sh, self.mesh)

  def data_sharding(self) -> NamedSharding:
    return data_sharding(self.mesh, self.rules)

  def check_batch_size(self, batch_size: int) -> None:
    check_batch_size(batch_size, self.mesh, self.rules)

  def replicated(self) -> NamedSharding:
    return replicated(self.mesh)

  def activation_sharding(self):
    return activation_sharding(self.mesh, self.rules)


def partitioner(
  spec=None,
  devices: Sequence[jax.Device] | None = None,
  *,
  num_partitions: int = 1,
  rules: str | Rules | None = None,
  abstract: bool = False,
  num_devices: int | None = None,
) -> Partitioner:
  """The partitioner a `MeshSpec` (or a preset name, 'DxM', a (data, model) tuple, None) describes over `devices`
  (default all); `rules` overrides the spec's. `abstract`: an AbstractMesh instead, of `num_devices` where the
  spec leaves the size open (see `mesh_plan`)."""
  if abstract:
    plan, planned = mesh_plan(num_partitions, spec, num_devices)
    mesh = AbstractMesh(plan, AXES, axis_types=(AxisType.Auto,) * 2)
  else:
    devices = list(devices) if devices is not None else jax.devices()
    _, planned = mesh_plan(num_partitions, spec, len(devices))
    mesh = make_mesh(num_partitions, spec, devices)
  return Partitioner(mesh, _as_rules(rules) or planned)


def rules_kind(rules: Rules) -> str:
  """The name of a rule set, or 'custom'."""
  return next((k for k, v in RULE_SETS.items() if v == tuple(rules)), "custom")


# --- specs ---------------------------------------------------------------------------------------------
def _mesh_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def fit_spec(spec: P, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> tuple[P, list[str]]:
  """`spec` with every dimension its mesh axes do not divide replicated (trailing axes dropped first).

  Returns (spec, notes), one note per changed dimension, e.g. 'dim 0 (12) not divisible by data=8'."""
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  out, notes = [], []
  for i, (dim, entry) in enumerate(zip(shape, entries)):
    axes = keep = _mesh_axes(entry)
    while keep and dim % math.prod(axis_sizes[a] for a in keep):
      keep = keep[:-1]
    if keep != axes:
      sizes = "x".join(f"{a}={axis_sizes[a]}" for a in axes)
      notes.append(f"dim {i} ({dim}) not divisible by {sizes}" + (f", kept {keep}" if keep else ""))
    out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
  return P(*out), notes


def logical_axes(params_axes) -> Any:
  """The `params_axes` collection that `param_with_axes` records, as a params-shaped tree of logical P(...)."""
  return unfreeze(nn.partitioning.get_axis_names(params_axes))


def _is_spec(x) -> bool:
  return isinstance(x, P)


def param_specs(
  params_axes, mesh, rules: str | Rules | None = None, *, params=None
) -> tuple[Any, dict[str, list[str]]]:
  """(params-shaped tree of mesh PartitionSpecs, {param path: fallback notes}).

  With `params` (arrays or ShapeDtypeStructs) each spec is checked against the shape (`fit_spec`)."""
  rules = _as_rules(rules) or DEFAULT_RULES
  specs = jax.tree_util.tree_map(
    lambda s: nn.logical_to_mesh_axes(tuple(s), rules), logical_axes(params_axes), is_leaf=_is_spec
  )
  fallbacks: dict[str, list[str]] = {}
  if params is not None:
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    leaves = treedef.flatten_up_to(params)
    fitted = []
    for (path, spec), p in zip(flat, leaves):
      spec, notes = fit_spec(spec, p.shape, dict(mesh.shape))
      if notes:
        fallbacks[jax.tree_util.keystr(path)] = notes
      fitted.append(spec)
    specs = treedef.unflatten(fitted)
  return specs, fallbacks


def param_shardings(params_axes, mesh, rules: str | Rules | None = None, *, params=None):
  """NamedSharding per parameter of `params_axes` (`param_specs`). Pass `params` (abstract is enough) so that
  dimensions the mesh does not divide fall back to replication (each logged); without it the rules' specs stand."""
  specs, fallbacks = param_specs(params_axes, mesh, rules, params=params)
  for path, notes in fallbacks.items():
    log.warning("partitioning: %s replicated where its mesh axes do not divide it: %s", path, "; ".join(notes))
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _check_divisible(param_sh, params, mesh) -> None:
  bad = []
  for (path, sh), p in zip(jax.tree_util.tree_flatten_with_path(param_sh)[0], jax.tree_util.tree_leaves(params)):
    _, notes = fit_spec(sh.spec, p.shape, dict(mesh.shape))
    if notes:
      bad.append(f"{jax.tree_util.keystr(path)} {tuple(p.shape)} {sh.spec}: {'; '.join(notes)}")
  if bad:
    raise ValueError(
      "parameter shardings that the mesh does not divide (build them with "
      "partitioning.param_shardings(..., params=abstract_params) to replicate those "
      "dimensions instead):\n  " + "\n  ".join(bad)
    )


def opt_state_shardings(abstract_state, params, param_sh, mesh):
  """Optimizer-state shardings: leaves shaped like their parameter share its sharding, Adafactor's factored
  statistics (optax FactoredState: v_row = the parameter's mean over its largest axis, v_col over the next;
  per layer slice under optim.layerwise) take its spec without the reduced axis, and the rest (counts,
  placeholders) are replicated. Leaves another branch of optax.multi_transform owns (MaskedNode) stay masked."""
  _check_divisible(param_sh, params, mesh)
  replicated = NamedSharding(mesh, P())
  params_def = jax.tree_util.tree_structure(params)
  masked = lambda x: isinstance(x, optax.MaskedNode)

  def params_like(x) -> bool:
    return isinstance(x, (dict, Mapping)) and jax.tree_util.tree_structure(x, is_leaf=masked) == params_def

  def per_param(leaf, sh, param):
    return sh if getattr(leaf, "shape", None) == param.shape else replicated

  def factored(stat: str, leaf, sh, param):
    shape = tuple(param.shape)
    # Factored over the whole parameter, or per layer slice of a stacked one (optim.layerwise: axes + 1).
    for offset in (0, 1):
      if len(shape) - offset >= 2:
        d1, d0 = np.argsort(shape[offset:])[-2:]  # as optax.adafactor's _factored_dims: d0 the largest axis
        axis = int(d0 if stat == "v_row" else d1) + offset
        if tuple(leaf.shape) == shape[:axis] + shape[axis + 1 :]:
          spec = tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
          return NamedSharding(sh.mesh, P(*(spec[:axis] + spec[axis + 1 :])))
    return replicated  # the (1,) placeholder of an unfactored parameter

  def over_params(fn, tree):
    return jax.tree_util.tree_map(
      lambda l, s, p: l if masked(l) else fn(l, s, p), tree, param_sh, params, is_leaf=masked
    )

  def shard(node):
    if masked(node):
      return node
    if isinstance(node, optax.FactoredState) and all(params_like(t) for t in (node.v_row, node.v_col, node.v)):
      return optax.FactoredState(
        count=replicated,
        v=over_params(per_param, node.v),
        **{stat: over_params(functools.partial(factored, stat), getattr(node, stat)) for stat in ("v_row", "v_col")},
      )
    if params_like(node):
      return over_params(per_param, node)
    return replicated

  stop = lambda x: masked(x) or isinstance(x, optax.FactoredState) or params_like(x)
  return jax.tree_util.tree_map(shard, abstract_state, is_leaf=stop)


def data_sharding(mesh, rules: str | Rules | None = None) -> NamedSharding:
  """Batch-major arrays: split as the rules place 'batch' (over 'data', or every device for 'data' rules)."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch",), _as_rules(rules) or DEFAULT_RULES))


def batch_shards(mesh, rules: str | Rules | None = None) -> int:
  """How many ways the rules split the batch on `mesh` (the product of the mesh axes 'batch' maps to)."""
  return math.prod(dict(mesh.shape)[a] for a in _mesh_axes(data_sharding(mesh, rules).spec[0]))


def check_batch_size(batch_size: int, mesh, rules: str | Rules | None = None) -> None:
  """A global batch must split evenly over the batch's mesh axes; say so before jit does, in gin's words."""
  n = batch_shards(mesh, rules)
  if batch_size % n:
    raise ValueError(
      f"BATCH_SIZE={batch_size} does not split over the mesh {dict(mesh.shape)}: the "
      f"{rules_kind(_as_rules(rules) or DEFAULT_RULES)!r} rules place the batch on {n} devices, so the global "
      "batch must be "
      f"a multiple of {n}; use --gin.BATCH_SIZE={max(n, batch_size // n * n)} (or {-(-batch_size // n) * n}), "
      "or a mesh with fewer data shards (e.g. a 'model' axis: mesh_spec.shape='DxM')"
    )


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# --- activations ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: str | Rules | None = None):
  """Trace under `mesh` and its rules, so that the logical constraints layers.py places (flax's
  `with_logical_constraint`) pin activations as t5x does; outside it they are no-ops."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(_as_rules(rules) or DEFAULT_RULES):
    yield
