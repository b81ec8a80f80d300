"""One writer per run: the lock `MODEL_DIR/LOCK` that `train` holds for as long as it runs.

The lock is a small JSON object naming its holder (host, process, its start, the launch's command) with a lease
the holder renews in a background thread. Taking it is an atomic create: locally `O_CREAT | O_EXCL`; in a
bucket an upload with the precondition `ifGenerationMatch=0` (GCS creates the object only if none exists), so of
two launches exactly one gets it and the other is refused in one line naming the holder.

A lock whose holder is gone is taken over by the next launch: on the holder's own host when its process no
longer exists (the process id and its start time are recorded, so a reused id does not count), anywhere when its
lease has not been renewed for `lease_s` seconds ($REMIXER_T5_LOCK_LEASE, default 120). Taking over replaces
exactly the stale object (a local rename; a bucket delete preconditioned on the stale object's generation) before
the atomic create, so two launches taking over the same stale lock still leave one holder.

A holder that finds its lock replaced or cannot renew it within its lease has lost it (`lost`): the trainer then
stops without writing more. A run of many processes holds one lock, taken by process 0.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from urllib.parse import quote

from remixer_t5 import storage

LOCK_FILE = "LOCK"
LEASE_ENV = "REMIXER_T5_LOCK_LEASE"
DEFAULT_LEASE_S = 120.0


class RunLockedError(storage.StorageError):
  """MODEL_DIR is held by a live `train`."""

  exit_code = 2


class RunLockLostError(storage.StorageError):
  """This run's lock was taken over or could not be renewed: another writer may be in MODEL_DIR."""


def lease_seconds() -> float:
  return storage.env_seconds(LEASE_ENV, DEFAULT_LEASE_S)


def _process_start(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None where unknown."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(pid: int, start: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process: it exists
    pass
  return start is None or _process_start(pid) in (None, start)


class _LocalFile:
  def __init__(self, path):
    self.path = str(path)

  def create(self, data: bytes) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return True

  def read(self):
    """(bytes, version) or None; the version identifies this object for `remove` and `replace`."""
    try:
      with open(self.path, "rb") as f:
        data = f.read()
      return data, os.stat(self.path).st_ino
    except FileNotFoundError:
      return None

  def replace(self, data: bytes, version) -> bool:
    current = self.read()
    if current is None or current[1] != version:
      return False
    tmp = f"{self.path}.renew-{os.getpid()}"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, self.path)
    return True

  def remove(self, version) -> bool:
    current = self.read()
    if current is None or current[1] != version:
      return False
    aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
    try:
      os.rename(self.path, aside)  # one of several removers gets it
    except FileNotFoundError:
      return False
    os.unlink(aside)
    return True


class _BucketFile:
  """The lock object through the GCS JSON API's preconditions (gcsfs's client)."""

  def __init__(self, path):
    import gcsfs

    self.path = storage.run_path(path).as_posix()
    self.fs = gcsfs.GCSFileSystem()
    self.bucket, self.key, _ = self.fs.split_path(self.path)

  def _call(self, method, url, **kwargs):
    from fsspec.asyn import sync

    return sync(self.fs.loop, self.fs._call, method, url, **kwargs)

  def _conditional(self, method: str, url: str, **kwargs) -> bool:
    """A request with a generation precondition: False when the precondition (or the object) is not there."""
    try:
      self._call(method, url, **kwargs)
    except FileNotFoundError:
      return False
    except Exception as e:  # noqa: BLE001 - gcsfs raises its HttpError (or a FileExistsError) for 412
      if _precondition_failed(e):
        return False
      raise
    finally:
      self.fs.invalidate_cache(self.path)
    return True

  def _upload(self, data: bytes, generation: str) -> bool:
    body = (
      b'--==lock==\nContent-Type: application/json; charset=UTF-8\n\n'
      + json.dumps({"name": self.key}).encode()
      + b'\n--==lock==\nContent-Type: application/json\n\n'
      + data
      + b'\n--==lock==--'
    )
    return self._conditional(
      "POST",
      f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
      uploadType="multipart",
      headers={"Content-Type": 'multipart/related; boundary="==lock=="'},
      data=body,
      json_out=True,
      ifGenerationMatch=generation,
    )

  def create(self, data: bytes) -> bool:
    return self._upload(data, "0")

  def _object_url(self) -> str:
    return f"{self.fs._location}/storage/v1/b/{quote(self.bucket)}/o/{quote(self.key, safe='')}"

  def read(self):
    try:
      info = self._call("GET", self._object_url(), json_out=True)
      data = self._call("GET", self._object_url(), alt="media", ifGenerationMatch=info["generation"])
    except FileNotFoundError:
      return None
    except Exception as e:  # noqa: BLE001
      if _precondition_failed(e):  # replaced between the two requests: read it again
        return self.read()
      raise
    if isinstance(data, tuple):  # gcsfs's _call returns (headers, contents) for a media read
      data = data[1]
    return bytes(data), str(info["generation"])

  def replace(self, data: bytes, version) -> bool:
    return self._upload(data, str(version))

  def remove(self, version) -> bool:
    return self._conditional("DELETE", self._object_url(), ifGenerationMatch=str(version))


def _precondition_failed(e: Exception) -> bool:
  return (
    getattr(e, "code", None) == 412
    or isinstance(e, FileExistsError)
    or "412" in str(e)[:200]
    or ("precondition" in str(e).lower())
  )


class RunLock:
  """The held lock: `release()` at the end; `lost` (a reason) once it is no longer this run's."""

  def __init__(self, model_dir, lease_s: float | None = None):
    self.model_dir = storage.run_path(model_dir)
    self.path = self.model_dir / LOCK_FILE
    self.file = _BucketFile(self.path) if storage.is_bucket(self.path) else _LocalFile(self.path)
    self.lease_s = lease_seconds() if lease_s is None else lease_s
    self.token = uuid.uuid4().hex
    self.version = None
    self.lost: str | None = None
    self._renewed = 0.0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _record(self) -> bytes:
    now = time.time()
    if not hasattr(self, "_since"):
      self._since = now
    return json.dumps(
      {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "since": self._since,
        "renewed": now,
        "lease_s": self.lease_s,
        "token": self.token,
        "command": " ".join(sys.argv)[:300],
      },
      indent=1,
    ).encode()

  def acquire(self) -> "RunLock":
    """Takes the lock, taking over a stale one; RunLockedError naming a live holder."""
    if not storage.is_bucket(self.model_dir):
      os.makedirs(str(self.model_dir), exist_ok=True)
    for _ in range(5):
      if self.file.create(self._record()):
        held = self.file.read()
        if held is None or json.loads(held[0]).get("token") != self.token:
          continue
        self.version, self._renewed = held[1], time.time()
        self._start_renewing()
        return self
      current = self.file.read()
      if current is None:
        continue  # released meanwhile: try again
      try:
        holder = json.loads(current[0])
      except (json.JSONDecodeError, UnicodeDecodeError):
        holder = {}  # an empty or torn lock (its writer died while writing): stale once old enough
      reason = stale(holder)
      if reason is None:
        raise RunLockedError(
          f"MODEL_DIR {self.model_dir} is in use by {describe(holder)}; refusing a second "
          f"writer (wait for it to end, stop it, or use another MODEL_DIR)"
        )
      if self.file.remove(current[1]):
        print(f"taking over MODEL_DIR {self.model_dir} from {describe(holder)}: {reason}", flush=True)
    raise RunLockedError(
      f"MODEL_DIR {self.model_dir}: could not take its lock ({self.path}) after 5 tries; "
      "another launch is taking it at the same time"
    )

  def _start_renewing(self) -> None:
    self._thread = threading.Thread(target=self._renew_loop, name="remixer_t5-run-lock", daemon=True)
    self._thread.start()

  def _renew_loop(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      self.renew()

  def renew(self) -> None:
    if self.lost:
      return
    try:
      current = self.file.read()
      if current is None or json.loads(current[0]).get("token") != self.token:
        self.lost = f"its lock {self.path} was " + (
          "removed" if current is None else f"taken by {describe(json.loads(current[0]))}"
        )
        return
      if self.file.replace(self._record(), current[1]):
        held = self.file.read()
        if held is not None:
          self.version, self._renewed = held[1], time.time()
        return
    except Exception as e:  # noqa: BLE001 - a storage hiccup: retried at the next renewal, within the lease
      if time.time() - self._renewed > self.lease_s:
        self.lost = f"its lock {self.path} could not be renewed for {self.lease_s:.0f}s ({type(e).__name__}: {e})"
      return
    if time.time() - self._renewed > self.lease_s:
      self.lost = f"its lock {self.path} could not be renewed for {self.lease_s:.0f}s"

  def check(self) -> None:
    """RunLockLostError once the lock is no longer this run's."""
    if self.lost:
      raise RunLockLostError(
        f"stopped: {self.lost}; another writer may be in MODEL_DIR {self.model_dir}, so "
        "this run writes nothing more there"
      )

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    if self.lost or self.version is None:
      return
    try:
      current = self.file.read()
      if current is not None and json.loads(current[0]).get("token") == self.token:
        self.file.remove(current[1])
    except Exception as e:  # noqa: BLE001 - a lock left behind is taken over by the next launch
      print(
        f"could not remove the lock {self.path} ({type(e).__name__}: {e}); the next launch takes it over "
        "once its lease runs out",
        file=sys.stderr,
        flush=True,
      )
    self.version = None


def stale(holder: dict) -> str | None:
  """Why a holder's lock may be taken over, or None while it holds."""
  renewed, lease = float(holder.get("renewed") or 0), float(holder.get("lease_s") or DEFAULT_LEASE_S)
  if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
    if not _alive(holder["pid"], holder.get("pid_start")):
      return f"its process {holder['pid']} on this host has ended"
    return None
  age = time.time() - renewed
  if age > lease:
    return f"its lease was last renewed {age:.0f}s ago (lease {lease:.0f}s)"
  return None


def describe(holder: dict) -> str:
  if not holder:
    return "an unreadable lock"
  since = holder.get("since")
  when = (
    datetime.datetime.fromtimestamp(since, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    if isinstance(since, (int, float))
    else "?"
  )
  return f"process {holder.get('pid', '?')} on {holder.get('host', '?')} (since {when})"


def acquire(model_dir) -> RunLock:
  return RunLock(model_dir).acquire()
