"""t5x's checkpoints read as our params: an INIT_CHECKPOINT, or what `eval`, `infer` and `export-hf` read, may be
a t5x MODEL_DIR (checkpoints.restore_any_params). It needs orbax, tensorstore and flax, never t5x itself.

With the default mixers our tree is t5x's T5.1.1 tree (layers.py and network.py use t5x's names, shapes and
logical axes), so a t5x T5.1.1 checkpoint's `target` is our params as is, without renaming.

The two on-disk layouts t5x writes (t5x/checkpoints.py), one step each, in MODEL_DIR/checkpoint_<step>/:

- legacy (`checkpoints.Checkpointer`): a msgpack file `checkpoint` (flax.serialization) holding
  {'version': 3, 'optimizer': {'target': params, 'state': {'step', 'param_states'}}}. Each leaf is either the
  array itself or the JSON of a TensorStore zarr spec whose kvstore path ('target.encoder.layers_0....kernel',
  the '/'-joined name with dots) is relative to the step directory; its driver is 'file', or 'gcs' with a
  placeholder bucket when the checkpoint was written to gs:// (t5x then reads the copy beside the msgpack).
- orbax (`checkpoints.OrbaxCheckpointManagerInterface`): `state/` is an orbax PyTree item (OCDBT) of the
  train-state dict {'target': params, 'state': {...}}; `dataset/` may hold the input pipeline's state.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization, traverse_util

CHECKPOINT_FILE = "checkpoint"  # t5x's msgpack file in a legacy step directory
STATE_ITEM = "state"  # t5x's orbax item of the train state
_STEP_DIR = re.compile(r"checkpoint_(\d+)")  # t5x's default `get_checkpoint_prefix()` is 'checkpoint'
_ORBAX_METADATA = "_METADATA"  # t5x (checkpoint_utils.detect_checkpoint_type) tells orbax apart by this file


class T5xCheckpointError(ValueError):
  pass


def is_t5x_checkpoint(path: str | os.PathLike) -> bool:
  """True for a t5x MODEL_DIR (has checkpoint_<step>/), a step dir or its msgpack file; False for our layouts.

  Our own layouts never match: an import-hf output has a `checkpoint/` *directory*, a train MODEL_DIR has
  `checkpoints/<step>/`, a params checkpoint is an orbax directory (whatever these directories are named)."""
  p = Path(path)
  if p.is_file():
    return p.name == CHECKPOINT_FILE and not (p.parent / _ORBAX_METADATA).exists()
  if not p.is_dir():
    return False
  if (p / CHECKPOINT_FILE).is_file() and not (p / _ORBAX_METADATA).exists():
    return True  # a legacy step directory (t5x's own test for the msgpack-vs-orbax question)
  if _STEP_DIR.fullmatch(p.name) and (p / STATE_ITEM).is_dir():
    return True  # an orbax step directory
  return any(_STEP_DIR.fullmatch(c.name) and c.is_dir() for c in p.iterdir())


def find_t5x_checkpoint(path: str | os.PathLike, step: int | None = None) -> tuple[str, Path]:
  """('legacy', msgpack file) or ('orbax', state item dir) for a MODEL_DIR (latest or given step), a step
  directory or a msgpack file; a clear error naming what is missing otherwise."""
  p = Path(path).absolute()
  if not p.exists():
    raise FileNotFoundError(f"no t5x checkpoint at {p}")
  if p.is_file():
    if p.name != CHECKPOINT_FILE:
      raise T5xCheckpointError(
        f"{p} is not a t5x checkpoint: expected a step directory or its `{CHECKPOINT_FILE}` msgpack file"
      )
    return "legacy", p
  if not _STEP_DIR.fullmatch(p.name) and not (p / CHECKPOINT_FILE).is_file() and not (p / STATE_ITEM).is_dir():
    steps = sorted((int(m.group(1)), c) for c in p.iterdir() if c.is_dir() and (m := _STEP_DIR.fullmatch(c.name)))
    if not steps:
      raise T5xCheckpointError(
        f"{p} is not a t5x checkpoint: it has no checkpoint_<step>/ directories (a t5x MODEL_DIR), "
        f"no `{CHECKPOINT_FILE}` msgpack file (a legacy step directory) and no `{STATE_ITEM}/` orbax item "
        f"(an orbax step directory)"
      )
    if step is None:
      p = steps[-1][1]
    else:
      p = dict(steps).get(step)
      if p is None:
        raise T5xCheckpointError(f"{path} has no checkpoint_{step}/; its steps: {[s for s, _ in steps]}")
  if (p / STATE_ITEM).is_dir():
    if not (p / STATE_ITEM / _ORBAX_METADATA).exists():
      raise T5xCheckpointError(f"{p / STATE_ITEM} is not a finished orbax item: {_ORBAX_METADATA} is missing")
    return "orbax", p / STATE_ITEM
  if (p / CHECKPOINT_FILE).is_file():
    return "legacy", p / CHECKPOINT_FILE
  raise T5xCheckpointError(
    f"t5x step directory {p} has neither the `{CHECKPOINT_FILE}` msgpack file (legacy layout) nor a "
    f"`{STATE_ITEM}/` orbax item (orbax layout); contents: {sorted(c.name for c in p.iterdir())}"
  )


def load_t5x_params(path: str | os.PathLike, step: int | None = None) -> dict:
  """The parameters (`target`) of a t5x checkpoint as nested dicts of numpy arrays, in their stored dtypes.

  `path`: a t5x MODEL_DIR (its latest checkpoint_<step>/, or `step`), a step directory or a legacy msgpack
  file. The optimizer state is not read."""
  kind, where = find_t5x_checkpoint(path, step)
  return _load_legacy(where) if kind == "legacy" else _load_orbax(where)


def _load_legacy(msgpack_file: Path) -> dict:
  contents = serialization.msgpack_restore(msgpack_file.read_bytes())
  if not isinstance(contents, dict):
    raise T5xCheckpointError(f"{msgpack_file} does not hold a t5x state dict")
  # Version >= 1 wraps the optimizer state; version 0 (a plain flax optimizer checkpoint) is that state itself.
  optimizer = contents.get("optimizer", contents)
  if not isinstance(optimizer, dict) or "target" not in optimizer:
    raise T5xCheckpointError(
      f"{msgpack_file} has no 'optimizer/target' (the parameters); top-level keys: "
      f"{sorted(contents)}" + (f", optimizer keys: {sorted(optimizer)}" if isinstance(optimizer, dict) else "")
    )
  flat: dict[tuple[str, ...], Any] = {}
  specs: dict[tuple[str, ...], dict] = {}
  for keys, leaf in traverse_util.flatten_dict(optimizer["target"], is_leaf=lambda _, x: _is_ts_spec(x)).items():
    if _is_ts_spec(leaf):
      specs[keys] = _local_spec(leaf, msgpack_file.parent, "/".join(("target",) + keys), msgpack_file)
    else:
      flat[keys] = np.asarray(leaf)
  return traverse_util.unflatten_dict(flat | _read_tensorstore(specs))


def _is_ts_spec(x) -> bool:
  """A serialized `ts.Spec`, as t5x recognises them (a dict with a driver and a kvstore)."""
  return isinstance(x, dict) and "driver" in x and "kvstore" in x


def _local_spec(spec: dict, step_dir: Path, name: str, msgpack_file: Path) -> dict:
  """The spec with its relative path made absolute under `step_dir`; 'gcs'/'gfile' read the local copy."""
  spec = copy.deepcopy(spec)
  kvstore = spec["kvstore"] if isinstance(spec["kvstore"], dict) else {}
  # tensorstore >= 0.1.14 keeps the path in the kvstore, older t5x checkpoints beside it; tensorstore joins both.
  rel = os.path.join(kvstore.get("path", ""), spec.pop("path", ""))
  if not rel:
    raise T5xCheckpointError(f"{msgpack_file}: the TensorStore spec of {name} has no path: {spec}")
  array_dir = step_dir / rel
  if not array_dir.is_dir():
    raise T5xCheckpointError(
      f"{msgpack_file} stores {name} in TensorStore at {array_dir}, which is missing "
      f"(copy the whole checkpoint_<step>/ directory)"
    )
  spec["kvstore"] = {"driver": "file", "path": str(array_dir) + "/"}
  return spec


def _read_tensorstore(specs: dict[tuple[str, ...], dict]) -> dict[tuple[str, ...], np.ndarray]:
  if not specs:
    return {}
  opened = {k: ts.open(spec, open=True, read=True) for k, spec in specs.items()}  # all reads in flight at once
  reads = {k: f.result().read() for k, f in opened.items()}
  return {k: np.asarray(r.result()) for k, r in reads.items()}


def _load_orbax(state_dir: Path) -> dict:
  with ocp.PyTreeCheckpointer() as ckptr:
    metadata = ckptr.metadata(state_dir)
    tree = getattr(metadata, "item_metadata", metadata)  # a StepMetadata in recent orbax, the tree before
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "target" not in tree:
      keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
      raise T5xCheckpointError(f"orbax item {state_dir} has no 'target' (the parameters); its keys: {keys}")
    target = tree["target"]
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), target)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    # Only `target` is read: the optimizer state can be several times the size of the parameters.
    restored = ckptr.restore(
      state_dir,
      args=ocp.args.PyTreeRestore(
        item={"target": abstract}, restore_args={"target": restore_args}, partial_restore=True
      ),
    )
  return _plain(restored["target"])


def _plain(tree):
  if hasattr(tree, "items"):
    return {str(k): _plain(v) for k, v in tree.items()}
  return np.asarray(tree)
