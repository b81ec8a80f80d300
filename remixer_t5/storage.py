"""Where a run's files live: local folders and `gs://` buckets, through one path type, `etils.epath.Path`.

Everything a run reads or writes under MODEL_DIR, INIT_CHECKPOINT and the commands that read a run goes through
`run_path`, so `gs://bucket/run` and `/home/me/run` work alike (pathlib would turn `gs://b/r` into a local
`gs:/b/r`). epath uses fsspec's `gcsfs` (EPATH_USE_TF=false, set here as a default), which honours
`STORAGE_EMULATOR_HOST`; what only TensorFlow writes goes through `Mirror`. Which client writes what, and how
writes stay whole on a bucket (no folder rename, no append): docs/scaling.md, "Which client writes what".
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import urllib.parse
from pathlib import Path as LocalPath

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
    if not text.startswith("gs://") or not text[len("gs://"):].split("/")[0]:
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


def check_bucket(path, what: str = "MODEL_DIR") -> None:
  """For a `gs://` path: that the server answers, the credentials are accepted and the bucket exists, as one
  StorageError naming the path and what to do (before a run compiles anything). Local paths pass."""
  path = run_path(path)
  if not is_bucket(path):
    return
  bucket = path.as_posix()[len("gs://"):].split("/")[0]
  emulator = os.environ.get("STORAGE_EMULATOR_HOST")
  where = f"the GCS emulator at {emulator} (STORAGE_EMULATOR_HOST)" if emulator else "Cloud Storage"
  endpoint = urllib.parse.urlsplit(emulator if emulator else "https://storage.googleapis.com")
  try:  # one connection attempt first: the client retries an unreachable server with backoff for a minute
    socket.create_connection((endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)),
                             timeout=10).close()
  except OSError as e:
    raise StorageError(f"{what} {path}: {where} did not answer for gs://{bucket} ({type(e).__name__}: {e}); "
                       "check the network (or that the emulator is running) and retry") from None
  try:
    import gcsfs
    fs = gcsfs.GCSFileSystem(retries=1) if emulator else gcsfs.GCSFileSystem()
    fs.info(bucket)
  except FileNotFoundError:
    raise StorageError(f"{what} {path}: bucket gs://{bucket} does not exist on {where}; create it "
                       f"(gcloud storage buckets create gs://{bucket}) or fix the name") from None
  except ImportError as e:
    raise StorageError(f"{what} {path}: the GCS client is missing ({e}); pip install -e . installs gcsfs") from None
  except Exception as e:  # noqa: BLE001 - the client's errors have many types; each becomes one line
    name, text = type(e).__name__, str(e).splitlines()[0][:200] if str(e) else ""
    if "credential" in f"{name} {text}".lower() or "Unauthorized" in text or "401" in text or "403" in text:
      raise StorageError(f"{what} {path}: no usable credentials for gs://{bucket} ({name}: {text}); on a TPU VM "
                         "the VM's service account needs storage access; elsewhere run `gcloud auth "
                         "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS") from None
    raise StorageError(f"{what} {path}: {where} did not answer for gs://{bucket} ({name}: {text}); check the "
                       "network (or that the emulator is running) and retry") from None


_LOCAL_COPIES: dict[str, str] = {}  # bucket path -> its local copy, made once per process, removed at exit


def local_copy(path) -> str:
  """A local file with `path`'s bytes, for readers that take local files only (gin's parser, tf.data's
  TextLineDataset): `path` itself when local, else a copy (same name, streamed, in a temporary folder removed at
  exit) made the first time this process asks for it."""
  import atexit
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
