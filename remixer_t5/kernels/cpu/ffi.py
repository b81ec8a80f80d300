"""Builds the C++ XLA FFI handlers of csrc/ on first use (hypermixing.py, threefry.py).

A handler is compiled with the system's C++ compiler ($CXX, else c++/g++) against jaxlib's FFI headers into
`$REMIXER_T5_CACHE_DIR/<folder>/` (default ~/.cache/remixer_t5). The library is keyed by the source and the
headers beside it (csrc/*.h, on the include path), the compiler flags, the jaxlib version and the compiler,
and, for flags that tune the code to this CPU (`-march=native`), by the CPU's model and feature flags, so a
cache shared between machines never hands one a library built for another. It is written under a temporary
name and renamed: a failed or interrupted build leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Mapping, MutableMapping, Sequence

import jax
import jaxlib

CSRC = Path(__file__).with_name("csrc")


class Unavailable(RuntimeError):
  """A library or a handler cannot be used here; the message says why."""


def compiler(environ: MutableMapping[str, str], source: Path) -> str:
  cxx = environ.get("CXX", "").strip() or shutil.which("c++") or shutil.which("g++") or ""
  if not cxx or not (os.path.isfile(cxx) or shutil.which(cxx)):
    raise Unavailable(f"no C++ compiler ($CXX={environ.get('CXX', '')!r}, c++, g++) to build {source.name}")
  return cxx


def cache_dir(folder: str, environ: MutableMapping[str, str] | None = None) -> Path:
  env = os.environ if environ is None else environ
  root = env.get("REMIXER_T5_CACHE_DIR", "").strip()
  return (Path(root).expanduser() if root else Path.home() / ".cache" / "remixer_t5") / folder


def host_cpu() -> str:
  """This CPU's model name and feature flags (Linux's /proc/cpuinfo; else the platform's description)."""
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return f"{platform.machine()} {platform.processor()}"
  keep = [l for l in lines if l.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
  return "\n".join(dict.fromkeys(keep)) or platform.machine()


def build(
  source: Path,
  folder: str,
  flags: Sequence[str] = ("-O2",),
  environ: MutableMapping[str, str] | None = None,
  log: Callable[[str], None] | None = None,
  out_dir: Path | None = None,
  what: str = "CPU",
) -> Path:
  """`source`'s shared library, compiled into the cache folder `folder` (or out_dir) unless there already;
  Unavailable with the compiler's last lines when it fails. `what` starts the log line."""
  env = os.environ if environ is None else environ
  cxx = compiler(env, source)
  text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
  native = any("native" in f for f in flags)
  key = hashlib.sha256(
    b"\0".join(
      [
        text,
        " ".join(flags).encode(),
        jaxlib.__version__.encode(),
        cxx.encode(),
        host_cpu().encode() if native else b"",
      ]
    )
  ).hexdigest()[:16]
  out_dir = Path(out_dir) if out_dir is not None else cache_dir(folder, env)
  target = out_dir / f"{source.stem}-{key}.so"
  if target.exists():
    return target
  out_dir.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=out_dir)
  os.close(fd)
  cmd = [
    cxx,
    *flags,
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",
    f"-I{source.parent}",
    f"-I{jax.ffi.include_dir()}",
    str(source),
    "-o",
    tmp,
  ]
  if log:
    log(f"{what}: building {source.name} with {cxx} (once; cached in {out_dir})")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  except (OSError, subprocess.TimeoutExpired) as e:
    os.unlink(tmp)
    raise Unavailable(f"building {source.name} failed: {e}") from None
  if proc.returncode != 0:
    os.unlink(tmp)
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise Unavailable(f"building {source.name} with {cxx} failed (exit {proc.returncode}): {tail}")
  os.replace(tmp, target)
  return target


def register_once(
  state: dict, build: Callable[[], Path], targets: Mapping[str, str], on_failure: Callable[[str], None]
) -> bool:
  """Loads the library `build()` returns and registers its handlers as CPU custom calls (target name -> the
  library's symbol), once per process; `state` remembers the outcome ("registered", or "failed": why). A failed
  build is tried once: `on_failure(why)` runs then (it may raise), and later calls return False at once."""
  if state.get("registered"):
    return True
  if "failed" in state:
    return False
  try:
    lib = ctypes.CDLL(str(build()))
  except (Unavailable, OSError) as e:
    state["failed"] = str(e)
    on_failure(str(e))
    return False
  for target, symbol in targets.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  state["registered"] = True
  return True
