"""Orbax checkpoints of the train state, plus the run's model/data signature kept beside them.

A MODEL_DIR (a local folder or a gs:// bucket path; remixer_t5.storage) holds `checkpoints/<step>/` (orbax,
saved collectively; orbax finalises a step atomically, a local folder by renaming it into place, a bucket's by
its commit marker, so a killed save never becomes the latest step), `input_state/<step>/process-<i>-of-<n>/`
(each process's tf.data iterator state at that step, written before the orbax step). What the run is
(`run_signature.json`) is run_identity.py's; who writes it (`LOCK`) run_lock.py's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Collection, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from remixer_t5 import quiet, storage
from remixer_t5.storage import Path
from remixer_t5.training import t5x_checkpoints
from remixer_t5.training.run_identity import IncompatibleModelDirError, tree_shapes


class Checkpointer:
  """Periodic saves with keep-N and restore of the latest step (None when MODEL_DIR has no checkpoint)."""

  def __init__(self, model_dir: str | os.PathLike, keep: int | None = 3, keep_best: bool = False):
    """`keep`: the newest steps kept (None: all); `keep_best`: orbax keeps every step and the trainer's
    `prune` applies keep-N around the best step."""
    self.directory = storage.run_path(model_dir) / "checkpoints"
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=None if keep_best else keep, create=True, cleanup_tmp_directories=True
      ),
    )
    self.pending: int | None = None  # the step whose save runs in the background

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self):
    return self.manager.all_steps()

  def save(self, step: int, state: Any, extra: Mapping[str, Any] | None = None, force: bool = False) -> bool:
    args = {"state": ocp.args.StandardSave(state)}
    if extra is not None:
      args["extra"] = ocp.args.JsonSave(dict(extra))
    self.wait()  # the previous save first, within the storage timeout (orbax would wait without a bound)
    # orbax's synchronous part (the step's folders, the arrays copied to host) is bounded too
    saved = storage.bounded(
      lambda: self.manager.save(step, args=ocp.args.Composite(**args), force=force),
      f"the save of checkpoint {self.directory / str(step)}",
    )
    self.pending = step if saved else None
    return saved

  def prune(self, keep: int | None, protected: Collection[int] = ()) -> None:
    """Deletes the finished steps older than the newest `keep` (None: keeps all), except `protected` (the best
    step): keep-N for a manager made with `keep_best=True`."""
    if keep is None:
      return
    steps = sorted(self.all_steps())
    for step in steps[:-keep] if keep else steps:
      if step not in protected and step != self.pending:
        self.manager.delete(step)

  def check(self) -> None:
    """A background save that has failed stops the run here (StorageError naming the step and the cause); a
    call costs no wait while a save is running."""
    if self.pending is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Waits for the background save, at most $REMIXER_T5_STORAGE_TIMEOUT; StorageError naming its step and
    cause when it failed or did not finish."""
    if self.pending is None:
      return
    step, self.pending = self.pending, None
    try:
      storage.bounded(self.manager.wait_until_finished, f"the save of checkpoint {self.directory / str(step)}")
    except storage.StorageTimeout:
      raise
    except Exception as e:  # noqa: BLE001 - orbax's and tensorstore's errors: the cause in one line
      raise storage.StorageError(
        f"checkpoint {self.directory / str(step)} could not be written: {storage_cause(e)}"
      ) from e

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restore into the structure, dtypes and shardings of `abstract_state` (ShapeDtypeStructs)."""
    step = self.latest_step() if step is None else step
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    extra = {}
    if (self.directory / str(step) / "extra").exists():
      extra = self.manager.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
    return restored["state"], extra

  def restore_latest_good(self, abstract_state: Any, log=print) -> tuple[Any, dict, int] | None:
    """(state, extra, step) from the newest checkpoint that restores; None when there is none.

    A checkpoint that fails to restore (truncated or corrupt files, a partial copy) is reported, moved aside to
    `checkpoints/<step>.corrupt-<n>` (process 0) so later saves and restores skip it, and the previous one is
    tried. Unfinished saves (orbax's temporary directories) never count as checkpoints."""
    for step in sorted(self.all_steps(), reverse=True):
      self.check_fits(step, abstract_state)
      try:
        state, extra = self.restore(abstract_state, step)
      except Exception as e:  # noqa: BLE001 - any failure to read means this step is unusable
        why = quiet.one_line(str(e), limit=400)  # tensorstore's spec and other C++ reprs trimmed
        why = why if len(why) <= 400 else why[:399] + "…"
        log(
          f"checkpoint {self.directory / str(step)} cannot be restored ({type(e).__name__}"
          f"{': ' + why if why else ''}); moving it aside and trying the previous one"
        )
        self._quarantine(step)
        continue
      return state, extra, step
    return None

  def check_fits(self, step: int, abstract_state: Any) -> None:
    """Refuses (IncompatibleModelDirError) a checkpoint whose readable metadata records another state (other
    parameters, shapes or optimizer state): it belongs to another configuration and is never moved aside.
    Unreadable metadata passes here; the restore then finds the checkpoint unusable."""
    try:
      with ocp.StandardCheckpointer() as reader:
        tree = reader.metadata(self.directory / str(step) / "state").item_metadata.tree
      saved = tree_shapes(tree["params"], dtypes=False)
    except Exception:  # noqa: BLE001 - unreadable: judged by the restore
      return
    want = tree_shapes(abstract_state.params, dtypes=False)
    problems = (
      [f"missing {k}" for k in want if k not in saved]
      + [f"unexpected {k}" for k in saved if k not in want]
      + [f"{k}: {saved[k]} saved, {v} now" for k, v in want.items() if k in saved and saved[k] != v]
    )
    if problems:
      raise IncompatibleModelDirError(
        f"checkpoint {self.directory / str(step)} holds another model's state ({'; '.join(problems[:4])}"
        f"{f' and {len(problems) - 4} more' if len(problems) > 4 else ''}); refusing to restore or move it: "
        "use a new MODEL_DIR, or this run's own configuration"
      )

  def _quarantine(self, step: int) -> None:
    if jax.process_index() == 0:
      n = 0
      while (dst := self.directory / f"{step}.corrupt-{n}").exists():
        n += 1
      storage.move_aside(self.directory / str(step), dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
    self.manager.reload()

  def close(self):
    """Finishes the save in flight (bounded, as `wait`) and closes the manager."""
    try:
      self.wait()
    finally:
      if not storage.ABANDONED:
        storage.bounded(self.manager.close, f"closing the checkpoints of {self.directory}")


def storage_cause(e: BaseException) -> str:
  """The cause of a storage failure in words: a full disk, a missing permission, else the error's first line
  without the native library's source locations."""
  text = f"{type(e).__name__}: {e}"
  if "No space left on device" in text or "os_error_code='28'" in text:
    return "no space left on the device"
  if "Permission denied" in text or "PERMISSION_DENIED" in text:
    return "permission denied"
  first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
  return f"{type(e).__name__}: {quiet.one_line(first.split(' === Source Location')[0], limit=240)[:240]}"


# --- input position: one tf.data iterator checkpoint per process and step, beside the orbax steps -----------
INPUT_STATE_DIR = "input_state"


def _input_state_dir(model_dir: Path, step: int) -> Path:
  """This process's folder of `step`'s input states."""
  return model_dir / INPUT_STATE_DIR / str(step) / f"process-{jax.process_index():05d}-of-{jax.process_count():05d}"


def save_input_state(model_dir: Path, step: int, write) -> None:
  """This process's input-iterator state for `step`, `write(prefix)` (Batches.save, a tf.train.Checkpoint),
  whole or absent after a kill -9: locally into a temporary folder renamed into
  `MODEL_DIR/input_state/<step>/process-<i>-of-<n>/`; in a bucket written in a local folder, then uploaded file
  by file with `iterator.index` last (its presence is what `input_state_prefix` looks for).

  Call it BEFORE the orbax save of `step`: a finalised orbax step then always has its input states."""
  final = _input_state_dir(model_dir, step)
  if storage.is_bucket(final):
    with tempfile.TemporaryDirectory(prefix="remixer_t5-input-state-") as tmp:
      write(os.path.join(tmp, "iterator"))
      if final.exists():  # a save of this step by a run that was killed before orbax finalised it
        final.rmtree()
      storage.upload_tree(tmp, final, last=("iterator.index",))
    return
  tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
  if tmp.exists():
    shutil.rmtree(tmp)
  tmp.mkdir(parents=True)
  write(str(tmp / "iterator"))
  if final.exists():
    shutil.rmtree(final)
  tmp.rename(final)


def input_state_prefix(model_dir: Path, step: int) -> str | None:
  """The prefix to restore this process's input state of `step` from, or None when there is none (a run
  from before iterator checkpoints, a pipeline that cannot be checkpointed, another number of processes)."""
  folder = _input_state_dir(model_dir, step)
  return str(folder / "iterator") if (folder / "iterator.index").exists() else None


def local_input_state(prefix: str, staging: str) -> str:
  """A prefix tf.train.Checkpoint can read: `prefix` itself when local, else its files copied into `staging`."""
  if not storage.is_bucket(prefix):
    return prefix
  folder = storage.run_path(prefix).parent
  storage.download_tree(folder, staging)
  return os.path.join(staging, "iterator")


def prune_input_states(model_dir: Path, keep: Collection[int]) -> None:
  """Deletes this process's input states of steps older than the newest in `keep` that `keep` (the checkpoints
  kept) does not hold, and the temporary folders of saves that were killed."""
  root = model_dir / INPUT_STATE_DIR
  if not root.is_dir():
    return
  i, newest = jax.process_index(), max(keep)
  for step_dir in root.iterdir():
    if not step_dir.name.isdigit() or int(step_dir.name) >= newest or int(step_dir.name) in keep:
      continue
    for folder in step_dir.glob(f"*process-{i:05d}-of-*"):
      try:
        folder.rmtree()
      except OSError:
        pass
    if not storage.is_bucket(step_dir):  # a bucket has no empty folders to remove
      try:
        step_dir.rmdir()  # the last process out removes the step's folder
      except OSError:
        pass


def save_params(directory: str | os.PathLike, params: Any) -> None:
  """A params-only checkpoint (import-hf output, exports) that `restore_params` reads back."""
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(storage.run_path(directory), params, force=True)


def restore_params(directory: str | os.PathLike) -> Any:
  path = storage.run_path(directory)
  if not any((path / name).exists() for name in ("_METADATA", "_CHECKPOINT_METADATA")):  # orbax's own files
    raise FileNotFoundError(f"no checkpoint at {path}")
  with ocp.StandardCheckpointer() as ckptr:
    # Onto this process's first device whatever mesh saved it (a run of many hosts read on one machine).
    metadata = ckptr.metadata(path)
    if metadata is None or metadata.item_metadata is None:
      raise FileNotFoundError(f"no checkpoint at {path}")
    tree = metadata.item_metadata.tree
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    is_array = lambda m: hasattr(m, "shape") and hasattr(m, "dtype")
    target = jax.tree_util.tree_map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device) if is_array(m) else m, tree, is_leaf=is_array
    )
    return ckptr.restore(path, target)


def restore_any_params(path: str | os.PathLike) -> Any:
  """Params from an import-hf output, a train MODEL_DIR (latest step), a step dir, a params or t5x checkpoint."""
  path = storage.run_path(path)
  if t5x_checkpoints.is_t5x_checkpoint(path):  # a t5x MODEL_DIR or step directory (legacy msgpack or orbax layout)
    return t5x_checkpoints.load_t5x_params(path)
  if (path / "checkpoint").is_dir():
    return restore_params(path / "checkpoint")
  if (path / "checkpoints").is_dir():
    steps = Checkpointer(path).all_steps()
    if not steps:
      raise FileNotFoundError(f"no finished checkpoint in {path / 'checkpoints'}")
    path = path / "checkpoints" / str(max(steps))
  if (path / "state").is_dir():
    return restore_params(path / "state")["params"]
  try:
    return restore_params(path)
  except FileNotFoundError:
    raise FileNotFoundError(
      f"no checkpoint in {path}: expected a training run's MODEL_DIR (checkpoints/), an "
      "import-hf output, a t5x checkpoint or a params checkpoint"
    ) from None


def restore_init_params(path: str | os.PathLike, abstract_params: Any, fit=None, what: str = "INIT_CHECKPOINT") -> Any:
  """Params to start a finetune from: an import-hf output, a train MODEL_DIR (its latest step: params only,
  the optimizer state and step are left behind) or a params checkpoint, placed as ``abstract_params`` says
  (shapes, dtypes, shardings). `fit(params) -> params` first adapts the restored tree (the trainer passes
  `fixed_length.fit_params`: fixed-length mixers' matrices to this run's lengths). A tree that does not match
  the model raises ValueError naming the paths."""
  params = restore_any_params(path)
  if fit is not None:
    params = fit(params)
  want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract_params)}
  got = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
  problems = [f"missing {k}" for k in want if k not in got] + [f"unexpected {k}" for k in got if k not in want]
  problems += [
    f"{k}: shape {tuple(got[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
    for k, v in want.items()
    if k in got and tuple(got[k].shape) != tuple(v.shape)
  ]
  if problems:
    raise ValueError(
      f"{what} {path} does not fit this model: "
      + "; ".join(problems[:8])
      + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
    )
  return jax.tree_util.tree_map(
    lambda x, a: jax.device_put(np.asarray(x).astype(a.dtype), a.sharding), params, abstract_params
  )
