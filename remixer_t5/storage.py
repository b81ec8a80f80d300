"""Where a run's files live: local folders and `gs://` buckets, through one path type, `etils.epath.Path`.

Everything a run reads or writes under MODEL_DIR, INIT_CHECKPOINT and the commands that read a run goes through
`run_path`, so `gs://bucket/run` and `/home/me/run` work alike (pathlib would turn `gs://b/r` into a local
`gs:/b/r`). epath uses fsspec's `gcsfs` (EPATH_USE_TF=false, set here as a default), which honours
`STORAGE_EMULATOR_HOST`; what only TensorFlow writes goes through `Mirror`. Which client writes what, and how
writes stay whole on a bucket (no folder rename, no append): docs/scaling.md, "Which client writes what".
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import urllib.parse
import uuid
from pathlib import Path as LocalPath

import tensorstore as ts

os.environ.setdefault("EPATH_USE_TF", "false")  # epath reads it per call; TF's gfile ignores GCS emulators
from etils import epath  # noqa: E402

Path = epath.Path
# gcsfs asks the storage-control API whether a bucket is hierarchical and warns on every new filesystem when it
# cannot (emulators, plain buckets): it then falls back to the plain client, which is what a run needs.
logging.getLogger("gcsfs").addFilter(lambda record: not str(record.msg).startswith("Could not determine bucket type"))

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


class StorageError(RuntimeError):
  """A run folder that cannot be used (no bucket, no credentials, no answer): the message says what to do."""


def run_path(path: str | os.PathLike) -> Path:
  """`path` as the one path type: `gs://bucket/...` kept as it is, a local path made absolute (`~` expanded).

  Refuses other URL schemes and the single-slash `gs:/bucket` that pathlib makes of `gs://bucket`."""
  if isinstance(path, epath.Path):
    text = path.as_posix() if is_bucket(path) else str(path)
  else:
    text = os.fspath(path)
  match = _SCHEME.match(text)
  if match and len(match.group(1)) > 1:  # one letter: a Windows drive
    scheme = match.group(1)
    if scheme != "gs":
      raise ValueError(f"{text!r}: unsupported storage scheme {scheme!r}; expected a local path or gs://bucket/path")
    if not text.startswith("gs://") or not text[len("gs://") :].split("/")[0]:
      raise ValueError(f"{text!r} is not a bucket path; expected gs://bucket/path (two slashes, then the bucket)")
    return epath.Path(text.rstrip("/") if text.count("/") > 3 else text)
  return epath.Path(LocalPath(text).expanduser().absolute())


def is_bucket(path) -> bool:
  return str(path).startswith("gs://") or (isinstance(path, epath.Path) and path.as_posix().startswith("gs://"))


def write_text(path, text: str) -> None:
  write_bytes(path, text.encode())


def write_bytes(path, data: bytes) -> None:
  """Writes `path` whole or not at all: a local file through a temporary file renamed into place, an object in a
  bucket in one upload (an object appears only once its upload completes)."""
  path = run_path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if is_bucket(path):
    path.write_bytes(data)
    return
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  tmp.write_bytes(data)
  tmp.replace(path)


def append_text(path, text: str) -> None:
  """Appends to a log file: in place locally; in a bucket (objects cannot grow) the object is rewritten whole,
  so that a reader always sees every complete line written so far."""
  path = run_path(path)
  if not is_bucket(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
      f.write(text)
    return
  old = path.read_bytes() if path.exists() else b""
  path.write_bytes(old + text.encode())


def remove_tree(path) -> None:
  path = run_path(path)
  if path.is_dir():
    path.rmtree()
  elif path.exists():
    path.unlink()


def move_aside(src, dst) -> None:
  """Renames a folder; in a bucket (no folder rename) its objects are copied, then the source deleted."""
  src, dst = run_path(src), run_path(dst)
  if not is_bucket(src):
    src.rename(dst)
    return
  _copy_tree(src, dst)
  src.rmtree()


def _files(folder: Path) -> list[Path]:
  """Every file under `folder` (epath refuses recursive globs on buckets)."""
  out = []
  for p in folder.iterdir():
    out += _files(p) if p.is_dir() else [p]
  return out


def _copy_tree(src: Path, dst: Path, last: tuple[str, ...] = ()) -> None:
  files = sorted(_files(src), key=lambda p: (p.name in last, str(p)))
  for p in files:
    target = dst / p.relative_to(src).as_posix()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(p.read_bytes())


def upload_tree(local: str | os.PathLike, remote, last: tuple[str, ...] = ()) -> None:
  """Copies a local folder's files to `remote` (any path), the files named in `last` after all others (a
  reader that waits for them then sees a complete folder)."""
  _copy_tree(epath.Path(local), run_path(remote), last)


def download_tree(remote, local: str | os.PathLike) -> None:
  _copy_tree(run_path(remote), epath.Path(local))


class Mirror:
  """A local folder standing in for `target` for writers that only TensorFlow's file system can drive (TensorBoard,
  seqio's loggers, tf.train.Checkpoint). Local targets are used directly; for a bucket the writers write into a staging
  folder and `sync()` copies every file that changed since the last sync (each object rewritten whole: new lines of a
  log, a new event file). `pull(*patterns)` first brings the target's existing files that the writers append to."""

  def __init__(self, target):
    self.target = run_path(target)
    self.remote = is_bucket(self.target)
    if self.remote:
      self.local = LocalPath(tempfile.mkdtemp(prefix="remixer_t5-mirror-"))
    else:
      self.local = LocalPath(str(self.target))
      self.local.mkdir(parents=True, exist_ok=True)
    self._synced: dict[str, tuple[int, int]] = {}

  def pull(self, *patterns: str) -> None:
    if not self.remote or not self.target.exists():
      return
    for pattern in patterns:
      for p in self.target.glob(pattern):
        if p.is_file():
          dst = self.local / p.relative_to(self.target).as_posix()
          dst.parent.mkdir(parents=True, exist_ok=True)
          dst.write_bytes(p.read_bytes())
          self._synced[str(dst)] = _stamp(dst)

  def sync(self) -> None:
    if not self.remote:
      return
    for p in sorted(self.local.rglob("*")):
      if not p.is_file() or self._synced.get(str(p)) == _stamp(p):
        continue
      stamp = _stamp(p)
      target = self.target / p.relative_to(self.local).as_posix()
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(p.read_bytes())
      self._synced[str(p)] = stamp

  def close(self) -> None:
    self.sync()
    if self.remote:
      shutil.rmtree(self.local, ignore_errors=True)


def _stamp(p: LocalPath) -> tuple[int, int]:
  st = p.stat()
  return st.st_size, st.st_mtime_ns


class BadPathError(ValueError):
  """A bucket path that Cloud Storage or its clients cannot hold as given."""

  exit_code = 2


_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*[a-z0-9]$")
# Characters GCS allows in object names but URLs and tensorstore's gs:// paths read as syntax: an array written
# through tensorstore would land outside the run's folder ('?' and '#' end the path there).
_OBJECT_SPECIAL = {"?": "a query", "#": "a fragment", "[": "a wildcard", "]": "a wildcard", "*": "a wildcard"}


def check_names(path, what: str = "MODEL_DIR") -> None:
  """Refuses (BadPathError, one line) a gs:// path whose bucket breaks Cloud Storage's bucket-naming rules or
  whose object names hold characters that a client reads as URL syntax or a wildcard. Local paths pass."""
  path = run_path(path)
  if not is_bucket(path):
    return
  bucket, _, name = path.as_posix()[len("gs://") :].partition("/")
  parts = bucket.split(".")
  problem = None
  if not _BUCKET_NAME.match(bucket) or len(bucket) < 3:
    problem = (
      "3 to 63 characters of lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
    )
  elif len(bucket) > (222 if len(parts) > 1 else 63) or any(len(p) > 63 or not p for p in parts):
    problem = "at most 63 characters (222 with dots, 63 between dots)"
  elif re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket):
    problem = "not an IP address"
  elif bucket.startswith("goog") or "google" in bucket or "g00gle" in bucket:
    problem = "not starting with 'goog' nor containing 'google'"
  if problem:
    raise BadPathError(f"{what} {path}: {bucket!r} is not a valid bucket name; Cloud Storage expects {problem}")
  for char, reads_as in _OBJECT_SPECIAL.items():
    if char in name:
      raise BadPathError(
        f"{what} {path}: the object path holds {char!r}, which storage clients read as "
        f"{reads_as}; expected letters, digits and -_./ (rename the folder)"
      )
  if any(ord(c) < 32 or ord(c) == 127 for c in name) or any(p in (".", "..") for p in name.split("/")):
    raise BadPathError(f"{what} {path}: control characters and '.'/'..' parts are not valid in object names")
  if len(name.encode()) > 900:
    raise BadPathError(
      f"{what} {path}: the object path is {len(name.encode())} bytes; Cloud Storage allows "
      "1,024 for a whole object name, and a run adds its own below it"
    )


def check_bucket(path, what: str = "MODEL_DIR") -> None:
  """For a `gs://` path: a valid bucket and object name (check_names), that the server answers, the credentials
  are accepted and the bucket exists, as one StorageError naming the path and what to do (before a run
  compiles anything). Local paths pass."""
  path = run_path(path)
  if not is_bucket(path):
    return
  check_names(path, what)
  bucket = path.as_posix()[len("gs://") :].split("/")[0]
  emulator = os.environ.get("STORAGE_EMULATOR_HOST")
  where = f"the GCS emulator at {emulator} (STORAGE_EMULATOR_HOST)" if emulator else "Cloud Storage"
  endpoint = urllib.parse.urlsplit(emulator if emulator else "https://storage.googleapis.com")
  try:  # one connection attempt first: the client retries an unreachable server with backoff for a minute
    socket.create_connection(
      (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)), timeout=10
    ).close()
  except OSError as e:
    raise StorageError(
      f"{what} {path}: {where} did not answer for gs://{bucket} ({type(e).__name__}: {e}); "
      "check the network (or that the emulator is running) and retry"
    ) from None
  try:
    import gcsfs

    fs = gcsfs.GCSFileSystem(retries=1) if emulator else gcsfs.GCSFileSystem()
    fs.info(bucket)
  except FileNotFoundError:
    raise StorageError(
      f"{what} {path}: bucket gs://{bucket} does not exist on {where}; create it "
      f"(gcloud storage buckets create gs://{bucket}) or fix the name"
    ) from None
  except ImportError as e:
    raise StorageError(f"{what} {path}: the GCS client is missing ({e}); pip install -e . installs gcsfs") from None
  except Exception as e:  # noqa: BLE001 - the client's errors have many types; each becomes one line
    name, text = type(e).__name__, str(e).splitlines()[0][:200] if str(e) else ""
    if "credential" in f"{name} {text}".lower() or "Unauthorized" in text or "401" in text or "403" in text:
      raise StorageError(
        f"{what} {path}: no usable credentials for gs://{bucket} ({name}: {text}); on a TPU VM "
        "the VM's service account needs storage access; elsewhere run `gcloud auth "
        "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
      ) from None
    raise StorageError(
      f"{what} {path}: {where} did not answer for gs://{bucket} ({name}: {text}); check the "
      "network (or that the emulator is running) and retry"
    ) from None


_LOCAL_COPIES: dict[str, str] = {}  # bucket path -> its local copy, made once per process, removed at exit


def local_copy(path) -> str:
  """A local file with `path`'s bytes, for readers that take local files only (gin's parser, tf.data's
  TextLineDataset): `path` itself when local, else a copy (same name, streamed, in a temporary folder removed at
  exit) made the first time this process asks for it."""
  path = run_path(path)
  if not is_bucket(path):
    return str(path)
  key = path.as_posix()
  if key not in _LOCAL_COPIES:
    if not path.is_file():
      raise FileNotFoundError(f"{path} does not exist")
    root = tempfile.mkdtemp(prefix="remixer_t5-copy-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    local = os.path.join(root, path.name)
    with path.open("rb") as src, open(local + ".part", "wb") as dst:
      shutil.copyfileobj(src, dst, 8 << 20)
    os.replace(local + ".part", local)
    _LOCAL_COPIES[key] = local
  return _LOCAL_COPIES[key]


def glob(pattern: str | os.PathLike) -> list[str]:
  """The paths matching `pattern` (local or gs://; `*`, `?` and `[...]` in any part after the bucket), sorted;
  a pattern without those characters matches itself when it exists."""
  path = run_path(pattern)
  text = path.as_posix() if is_bucket(path) else str(path)
  parts = text.split("/")
  first = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
  if first is None:
    return [text] if path.exists() else []
  root = run_path("/".join(parts[:first]) or "/")
  found = root.glob("/".join(parts[first:]))
  return sorted(p.as_posix() if is_bucket(p) else str(p) for p in found)


# --- bounded waits and the write probe --------------------------------------------------------------------
TIMEOUT_ENV = "REMIXER_T5_STORAGE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0


class StorageTimeout(StorageError):
  """A wait on storage that ran past $REMIXER_T5_STORAGE_TIMEOUT."""


def env_seconds(name: str, default: float) -> float:
  """$name as a positive number of seconds, `default` when unset; ValueError naming it otherwise."""
  text = os.environ.get(name)
  if not text:
    return default
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if value <= 0:
    raise ValueError(f"${name}={text!r}: expected a positive number of seconds")
  return value


def timeout_seconds() -> float:
  """The longest any wait on storage may take ($REMIXER_T5_STORAGE_TIMEOUT seconds, default 600)."""
  return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def bounded(fn, what: str, timeout: float | None = None):
  """`fn()` in a helper thread, waited for at most `timeout` (default timeout_seconds()); StorageTimeout naming
  `what` after that (the thread is left behind: a storage client that does not answer cannot be interrupted)."""
  timeout = timeout_seconds() if timeout is None else timeout
  result: dict = {}

  def run():
    try:
      result["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
      result["error"] = e

  thread = threading.Thread(target=run, name=f"remixer_t5-bounded-{what[:40]}", daemon=True)
  thread.start()
  thread.join(timeout)
  if thread.is_alive():
    global ABANDONED
    ABANDONED = True
    raise StorageTimeout(f"{what} did not finish within {timeout:.0f}s (${TIMEOUT_ENV}); the storage did not answer")
  if "error" in result:
    raise result["error"]
  return result.get("value")


ABANDONED = False  # a storage wait was given up: the process must not wait for its threads at exit


def probe_writes(root: Path, timeout: float = 60.0) -> None:
  """For a bucket MODEL_DIR: writes, reads back and deletes one small object through each client the run
  writes with (epath/gcsfs for its files, tensorstore for the checkpoint arrays), each within `timeout`;
  StorageError naming the client that failed. Local folders pass."""
  if not is_bucket(root):
    return
  name = f".probe-{uuid.uuid4().hex[:12]}"
  timeout = min(timeout, timeout_seconds())

  def files():
    target = root / name
    target.write_bytes(b"probe")
    if target.read_bytes() != b"probe":
      raise StorageError(f"{target} read back other bytes than were written")
    target.unlink()

  def arrays():
    bucket, _, prefix = root.as_posix()[len("gs://") :].partition("/")
    store = ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": f"{prefix}/" if prefix else ""}).result(
      timeout=timeout
    )
    store.write(name + "-ts", b"probe").result(timeout=timeout)
    if store.read(name + "-ts").result(timeout=timeout).value != b"probe":
      raise StorageError("tensorstore read back other bytes than were written")
    store.delete_range(ts.KvStore.KeyRange(name + "-ts", name + "-tt")).result(timeout=timeout)

  for client, fn in (("the file client (gcsfs)", files), ("the array client (tensorstore)", arrays)):
    try:
      bounded(fn, f"a test write to MODEL_DIR {root} through {client}", timeout)
    except StorageError as e:
      raise StorageError(
        f"{e}; checkpoints could not be written (check the endpoint: "
        f"{'TENSORSTORE_GCS_HTTP_URL' if 'tensorstore' in client else 'STORAGE_EMULATOR_HOST'} "
        "for an emulator)"
      ) from None
    except Exception as e:  # noqa: BLE001 - each client has its own error types: one line each
      text = str(e).splitlines()[0][:200] if str(e) else ""
      raise StorageError(
        f"MODEL_DIR {root}: a test write through {client} failed ({type(e).__name__}: "
        f"{text}); checkpoints could not be written"
      ) from None


def fingerprint(path) -> str:
  """A content fingerprint of a file: a bucket object's CRC32C and size (Cloud Storage computes it over the
  bytes), a local file's SHA-256 and size (read once)."""
  path = run_path(path)
  if is_bucket(path):
    import gcsfs

    info = gcsfs.GCSFileSystem().info(path.as_posix())
    return f"crc32c:{info.get('crc32c') or info.get('md5Hash')}:{info.get('size')}"
  digest, size = hashlib.sha256(), 0
  with open(str(path), "rb") as f:
    while chunk := f.read(8 << 20):
      digest.update(chunk)
      size += len(chunk)
  return f"sha256:{digest.hexdigest()[:16]}:{size}"
