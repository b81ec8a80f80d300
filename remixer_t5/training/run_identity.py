"""What a run is: the identity MODEL_DIR records on its first `train` and every later `train` into it must match.

A run's identity is what its checkpoints and its input position mean (`identity`):
- the model: its class, every T5Config field, and each module of the network with its settings (which mixer in
  which slot, the Remixer's composition, a fixed-length mixer's L, ...: recorded while the initialiser is traced,
  so a setting counts exactly when a module reads it), and the shapes of its parameters;
- the optimizer: its factory and the shapes of the whole train state (parameters and optimizer state);
- the data: the task or mixture, the feature lengths, the vocabulary (its size and a digest of its model),
  the global batch, the seed, packing and shuffling, and one's own training files with a content fingerprint.

Settings that do not change what the parameters or the input position mean may change between launches
(`RESUMABLE`: steps, periods, learning-rate values, evaluation, the activation dtype, dropout, remat, kernel
implementations, microbatches, the mesh); docs/cli.md lists them. The identity is kept in
`MODEL_DIR/run_signature.json` as flat keys (`config.emb_dim`, `modules`, ...); a key an older run did not record
is not compared.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Mapping

import flax.linen as nn
import jax
import numpy as np

from remixer_t5 import storage

SIGNATURE_FILE = "run_signature.json"

# Fields (of T5Config and of every module) that may change on resume: how the same function is computed, and
# (`resumable`) every dropout rate.
RESUMABLE = frozenset(
  {
    "dropout_rate",
    "dtype",
    "remat_policy",
    "attention_impl",
    "dropout_impl",
    "impl",
    "fuse_projections",
    "logits_in_activation_dtype",
    "deterministic",
    "decode",
    "parent",
    "name",
  }
)


def resumable(field: str) -> bool:
  """Whether a setting may change between launches: RESUMABLE, and every dropout rate (regularisation)."""
  return field in RESUMABLE or "dropout" in field


class IncompatibleModelDirError(ValueError):
  """MODEL_DIR holds another run: the message names the settings that differ."""

  exit_code = 2


def identity(run, vocab, abstract_state, model_lengths: Mapping[str, int]) -> dict[str, Any]:
  """The run's identity as JSON-able flat keys (see the module docstring)."""
  model, data, training = run.training.model, run.data, run.training
  out: dict[str, Any] = {"model": type(model.module).__name__}
  config = getattr(model.module, "config", None)
  if dataclasses.is_dataclass(config):
    out.update({f"config.{k}": _plain(v) for k, v in dataclasses.asdict(config).items() if not resumable(k)})
  out["modules"] = modules(model, model_lengths)
  out["params"] = tree_shapes(abstract_state.params)
  out["optimizer"] = _callable_name(training.optimizer)
  out["state_digest"] = _digest(tree_shapes(abstract_state))
  out.update(
    task=data.task,
    feature_lengths=dict(data.feature_lengths),
    vocab_size=vocab.vocab_size,
    vocabulary=vocabulary_digest(vocab),
    batch_size=int(data.batch_size),
    random_seed=int(training.random_seed),
    pack=bool(data.pack),
    shuffle=bool(data.shuffle),
  )
  files = training_files(data.task)
  if files:
    out["train_files"] = files
  return json.loads(json.dumps(out, default=str))


def modules(model, lengths: Mapping[str, int]) -> dict[str, str]:
  """Each module of the network by its path: its class and settings (fields other than RESUMABLE), as the
  initialiser meets them (traced under jax.eval_shape: nothing is computed or allocated)."""
  seen: dict[str, str] = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    path = "/".join(module.scope.path) if module.scope is not None else ""
    if path not in seen and "Dropout" not in type(module).__name__:  # regularisation: resumable
      seen[path] = describe(module)
    return next_fun(*args, **kwargs)

  shapes = {
    "encoder_input_tokens": (1, lengths["inputs"]),
    "decoder_input_tokens": (1, lengths["targets"]),
    "decoder_target_tokens": (1, lengths["targets"]),
  }
  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init_variables(jax.random.PRNGKey(0), shapes))
  return dict(sorted(seen.items()))


def describe(module: nn.Module) -> str:
  """'Class(field=value, ...)' for a module's settings: plain values as they are, the T5Config as its
  class name (its fields are recorded once, as config.*), other modules, factories and functions by name."""
  fields = []
  for f in dataclasses.fields(module):
    if resumable(f.name) or not f.init:
      continue
    fields.append(f"{f.name}={_setting(getattr(module, f.name, None))}")
  return f"{type(module).__name__}({', '.join(fields)})"


def _setting(value) -> str:
  if value is None or isinstance(value, (bool, int, float, str)):
    return repr(value)
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(_setting(v) for v in value) + ")"
  if isinstance(value, Mapping):
    return "{" + ", ".join(f"{k!r}: {_setting(v)}" for k, v in sorted(value.items(), key=str)) + "}"
  if isinstance(value, nn.Module):
    return describe(value)
  if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config instance
    return type(value).__name__
  return _callable_name(value)


def _callable_name(value) -> str:
  """A factory, class, function or partial by name (gin's wrappers and functools.partial unwrapped)."""
  if isinstance(value, functools.partial):
    args = [_setting(a) for a in value.args] + [f"{k}={_setting(v)}" for k, v in sorted(value.keywords.items())]
    return f"{_callable_name(value.func)}({', '.join(args)})"
  inner = getattr(value, "__wrapped__", None)
  if inner is not None and inner is not value:
    return _callable_name(inner)
  name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
  return name if name else type(value).__name__


def _plain(value):
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def tree_shapes(tree, dtypes: bool = True) -> dict[str, Any]:
  """'a/b/c' -> 'float32[2, 3]' (or the shape alone, `dtypes=False`) for each array of a tree, whichever
  container holds it (a TrainState, or the dicts of a checkpoint's saved metadata)."""
  name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
  return {
    "/".join(name(k) for k in path): f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}" if dtypes else tuple(leaf.shape)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    if hasattr(leaf, "shape")
  }


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def vocabulary_digest(vocab) -> str:
  """A digest of what maps text to ids: a SentencePiece model's bytes, else the vocabulary's class and size."""
  model = getattr(vocab, "sp_model", None)
  if isinstance(model, bytes):
    return f"sentencepiece:{hashlib.sha256(model).hexdigest()[:16]}"
  return f"{type(vocab).__name__}:{vocab.vocab_size}"


def training_files(task_name: str) -> dict[str, str]:
  """One's own training files (tasks read through a file source: `--train_file`), each with its content
  fingerprint (storage.fingerprint); {} for registered datasets."""
  import seqio
  from remixer_t5.tasks.lookup import get_task

  task = get_task(task_name)
  tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
  out = {}
  for t in tasks:
    source = t.source
    if "train" in getattr(source, "split_files", {}) and hasattr(source, "files"):
      out.update({path: storage.fingerprint(path) for path in source.files("train")})
  return out


def check(model_dir: storage.Path, ident: Mapping[str, Any]) -> bool:
  """Refuses (IncompatibleModelDirError, nothing written) when MODEL_DIR records another run; True when it
  records none yet (the caller writes it with `write` once it holds the run's lock)."""
  path = model_dir / SIGNATURE_FILE
  if not path.exists():
    return True
  try:
    old = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise IncompatibleModelDirError(
      f"{path} is not valid JSON ({e}); it is not a run this version wrote or it was damaged: use a new MODEL_DIR"
    ) from None
  ident = json.loads(json.dumps(dict(ident), default=str))
  diffs = differences(old, ident)
  if diffs:
    shown = diffs[:8] + ([f"... and {len(diffs) - 8} more"] if len(diffs) > 8 else [])
    raise IncompatibleModelDirError(
      f"MODEL_DIR {model_dir} holds another run; refusing to train into it (nothing in it was changed). "
      f"Different: {'; '.join(shown)}. Use a new MODEL_DIR, or the run's own settings (its config.gin)"
    )
  return False


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """The settings that differ, 'name: recorded -> now', per module path and parameter for those two."""
  diffs = []
  for key in sorted(set(old) & set(new)):
    a, b = old[key], new[key]
    if a == b:
      continue
    if isinstance(a, dict) and isinstance(b, dict) and key != "feature_lengths":
      by_change: dict[tuple[str, str], list[str]] = {}  # one line per change, naming where it happens
      for sub in sorted(set(a) | set(b)):
        if a.get(sub) != b.get(sub):
          by_change.setdefault((_short(a.get(sub, "absent")), _short(b.get(sub, "absent"))), []).append(sub)
      for (was, now), where in by_change.items():
        at = ", ".join(where[:2]) + (f" and {len(where) - 2} more" if len(where) > 2 else "")
        diffs.append(f"{key} at {at}: {was} -> {now}")
    else:
      diffs.append(f"{key}: {_short(a)} -> {_short(b)}")
  return diffs


def _short(value, limit: int = 120) -> str:
  text = value if isinstance(value, str) else json.dumps(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def write(model_dir: storage.Path, ident: Mapping[str, Any]) -> None:
  storage.write_text(model_dir / SIGNATURE_FILE, json.dumps(ident, indent=2, sort_keys=True))
