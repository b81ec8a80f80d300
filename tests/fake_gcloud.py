"""A fake `gcloud` for the launcher tests: the Cloud TPU commands launch/tpu_vm.sh uses, played against a
scripted lifecycle on this computer, without Google Cloud.

`install(bin_dir, state_dir, **config)` puts a `gcloud` on `bin_dir` that runs this file. Every call is recorded
(`calls(state_dir)`). What it plays:

* `compute tpus queued-resources create|describe|delete` and `compute tpus tpu-vm create|describe|delete|ssh|scp`,
  with the flags the launcher passes and gcloud accepts (others are refused as gcloud refuses them, exit 2);
  `alpha` is accepted before `compute`, and only the alpha create takes `--best-effort`.
* A queued resource is WAITING_FOR_RESOURCES for `waiting_polls` describes (then PROVISIONING for one), then
  ACTIVE with its TPU VM READY. Each creation is a new generation of the slice: new worker homes and hostnames
  (`<node>-g<generation>-w<worker>`), as a recreated slice has.
* Preemption: once a file matching `preempt_when` (a glob under the state folder) exists while generation
  `preempt_generation` is up, the next call finds the TPU VM PREEMPTED and the queued resource SUSPENDED, and
  every process started on that generation's workers has been killed with SIGKILL (no SIGTERM: a preempted
  slice just stops). With `preempt_during` (launcher steps, e.g. ["watch", "all"]) only a call made by a launcher
  running one of those steps finds it preempted, so that a script's `status` and `logs` before its `watch` see
  the job running. A deleted slice's processes are killed the same way.
* `ssh --worker=all --command=C` runs C with bash on every worker at once (HOME = the worker's home, PATH with
  stub `hostname`, `sudo` (records, runs nothing), `python3.11` (its `-m venv` makes a venv whose `pip` records
  and whose `remixer-t5` is the stub trainer below)); the first `ssh_failures` ssh calls fail with exit 255 before
  reaching a worker, as a new slice's first ssh does while its key propagates.
* `scp SRC NODE:DEST --worker=all` copies SRC into every worker's home.

The stub trainer (`remixer-t5 train ...` on a worker) stands in for a run: `gs://bucket/path` is the folder
`<state>/gcs/bucket/path`; it refuses a `--gin_file` missing from its working folder (exit 2), takes MODEL_DIR's
lock as remixer-t5 does (refused, exit 2 "is in use by", while another host's lock is younger than
$REMIXER_T5_LOCK_LEASE), resumes from the latest `checkpoints/<step>` folder (the workers of one start wait for
each other before the first step, as JAX's processes do), records each start in
`starts.jsonl`, checkpoints every CHECKPOINT_PERIOD steps (worker 0 writes), and on SIGTERM saves and exits 0 with
remixer-t5's "rerun the same command to resume" line. A first run (from step 0) pauses at step `pause_at` until
it is killed (or `<state>/release` exists), so that a preemption lands at a known step. With $FAKE_TRAIN_EXIT
set, worker 0 stops at step 3 with that exit code and a remixer-t5 error line (3: a NaN loss).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULTS = {
  "waiting_polls": 1,
  "ssh_failures": 0,
  "preempt_when": None,
  "preempt_generation": 1,
  "preempt_during": None,
  "pause_at": None,
  "train_steps": 20,
  "checkpoint_period": 5,
  "step_seconds": 0.01,
  "worker_env": {},
}


def install(bin_dir, state_dir, **config) -> dict:
  """A `gcloud` in `bin_dir` playing `config` (see DEFAULTS) with its state in `state_dir`; returns the
  environment for a launcher that should find it (PATH first, then the system's)."""
  bin_dir, state_dir = Path(bin_dir), Path(state_dir)
  bin_dir.mkdir(parents=True, exist_ok=True)
  state_dir.mkdir(parents=True, exist_ok=True)
  unknown = set(config) - set(DEFAULTS)
  if unknown:
    raise TypeError(f"unknown fake gcloud settings {sorted(unknown)}")
  (state_dir / "config.json").write_text(json.dumps({**DEFAULTS, **config}))
  _write_exe(bin_dir / "gcloud", f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
  return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GCLOUD_DIR": str(state_dir), "HOME": str(state_dir)}


def calls(state_dir) -> list[list[str]]:
  """Every gcloud call so far, as its argument list."""
  path = Path(state_dir) / "calls.jsonl"
  return [json.loads(line)["argv"] for line in path.read_text().splitlines()] if path.exists() else []


def deletions(state_dir) -> list[dict]:
  """Each delete: what was deleted and the state it was in."""
  path = Path(state_dir) / "deletions.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gcs(state_dir, url: str) -> Path:
  """The folder that stands for `gs://bucket/path`."""
  return Path(state_dir) / "gcs" / url[len("gs://") :]


def kill_all(state_dir) -> None:
  """Kills every process started on any fake worker of `state_dir` (test teardown)."""
  _kill_matching(f"FAKE_GCLOUD_DIR={Path(state_dir)}")


def _write_exe(path: Path, text: str) -> None:
  path.write_text(text)
  path.chmod(0o755)


def _kill_matching(*needles: str) -> None:
  """SIGKILL to every process whose environment holds all of `needles` (NAME=VALUE)."""
  markers = {n.encode() for n in needles}
  for proc in Path("/proc").iterdir():
    if not proc.name.isdigit() or int(proc.name) == os.getpid():
      continue
    try:
      env = set((proc / "environ").read_bytes().split(b"\0"))
    except OSError:
      continue
    if markers <= env:
      with contextlib.suppress(OSError):
        os.kill(int(proc.name), signal.SIGKILL)


# --- gcloud ------------------------------------------------------------------------------------------------
class Refused(Exception):
  def __init__(self, message: str, code: int = 1):
    super().__init__(message)
    self.code = code


# Flags each command takes (gcloud's own names; a value after '=').
COMMON = {"--zone", "--project", "--quiet", "--format"}
FLAGS = {
  ("queued-resources", "create"): {
    "--node-id",
    "--accelerator-type",
    "--runtime-version",
    "--spot",
    "--reserved",
    "--guaranteed",
    "--async",
    "--network",
    "--description",
  },
  ("queued-resources", "describe"): set(),
  ("queued-resources", "delete"): {"--force", "--async"},
  ("tpu-vm", "create"): {
    "--accelerator-type",
    "--version",
    "--spot",
    "--reserved",
    "--preemptible",
    "--async",
    "--network",
    "--description",
  },
  ("tpu-vm", "describe"): set(),
  ("tpu-vm", "delete"): {"--async"},
  ("tpu-vm", "ssh"): {"--worker", "--command"},
  ("tpu-vm", "scp"): {"--worker", "--recurse"},
}
ALPHA_ONLY = {("queued-resources", "create"): {"--best-effort"}}


class Fake:
  def __init__(self, state_dir: Path):
    self.dir = state_dir
    self.config = json.loads((state_dir / "config.json").read_text())
    self.state_path = state_dir / "state.json"
    self.state = (
      json.loads(self.state_path.read_text())
      if self.state_path.exists()
      else {"queued": {}, "nodes": {}, "generation": 0, "ssh_calls": 0}
    )

  def save(self):
    self.state_path.write_text(json.dumps(self.state, indent=1))

  def log(self, name: str, record: dict):
    with open(self.dir / name, "a") as f:
      f.write(json.dumps(record) + "\n")

  # the lifecycle ----------------------------------------------------------------------------------------
  def preempt_if_due(self):
    when, during = self.config["preempt_when"], self.config["preempt_during"]
    if not when:
      return
    if during:
      try:
        caller = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
      except OSError:
        caller = []
      if not set(during) & set(caller):
        return
    for name, node in self.state["nodes"].items():
      if (
        node["state"] == "READY"
        and node["generation"] == self.config["preempt_generation"]
        and glob.glob(str(self.dir / when))
      ):
        _kill_matching(f"FAKE_GCLOUD_DIR={self.dir}", f"FAKE_GCLOUD_NODE={self.tag(name, node)}")
        node["state"] = "PREEMPTED"
        qr = self.state["queued"].get(node.get("queued") or "")
        if qr:
          qr["state"] = "SUSPENDED"
        self.log("events.jsonl", {"event": "preempted", "node": self.tag(name, node)})

  def tag(self, name, node):
    return f"{name}-g{node['generation']}"

  def new_node(self, name, accelerator, queued=None):
    self.state["generation"] += 1
    cores = int(accelerator.rsplit("-", 1)[1])
    hosts = max(1, cores // 8)
    node = {
      "state": "READY",
      "generation": self.state["generation"],
      "hosts": hosts,
      "queued": queued,
      "accelerator": accelerator,
    }
    self.state["nodes"][name] = node
    for w in range(hosts):
      self.home(name, node, w).mkdir(parents=True)
    return node

  def home(self, name, node, worker) -> Path:
    return self.dir / "workers" / f"{self.tag(name, node)}-w{worker}"

  def delete_node(self, name):
    node = self.state["nodes"].pop(name, None)
    if node:
      _kill_matching(f"FAKE_GCLOUD_DIR={self.dir}", f"FAKE_GCLOUD_NODE={self.tag(name, node)}")
    return node

  # commands ---------------------------------------------------------------------------------------------
  def run(self, argv: list[str]) -> int:
    self.log("calls.jsonl", {"argv": argv})
    self.preempt_if_due()
    words = list(argv)
    alpha = bool(words) and words[0] in ("alpha", "beta") and words.pop(0) == "alpha"
    positional = [w for w in words if not w.startswith("--")]
    flags = {}
    for w in words:
      if w.startswith("--"):
        key, _, value = w.partition("=")
        flags[key] = value if "=" in w else True
    if positional[:2] != ["compute", "tpus"] or len(positional) < 5:
      raise Refused(f"ERROR: (gcloud) the fake plays compute tpus commands only, not {' '.join(argv)}", 2)
    group, verb = positional[2], positional[3]
    allowed = FLAGS.get((group, verb))
    if allowed is None:
      raise Refused(f"ERROR: (gcloud.compute.tpus.{group}) Invalid choice: '{verb}'.", 2)
    allowed = allowed | COMMON | (ALPHA_ONLY.get((group, verb), set()) if alpha else set())
    unknown = [k for k in flags if k not in allowed]
    if unknown:
      raise Refused(f"ERROR: (gcloud.compute.tpus.{group}.{verb}) unrecognized arguments: {' '.join(unknown)}", 2)
    if "--zone" not in flags:
      raise Refused(f"ERROR: (gcloud.compute.tpus.{group}.{verb}) the fake wants --zone", 2)
    method = getattr(self, f"{group.replace('-', '_')}_{verb}")
    try:
      return method(positional[4:], flags)
    finally:
      self.save()

  def not_found(self, kind, name, flags):
    raise Refused(
      f"ERROR: (gcloud.compute.tpus.{kind}.describe) NOT_FOUND: Resource 'projects/fake/locations/"
      f"{flags['--zone']}/{'queuedResources' if kind == 'queued-resources' else 'nodes'}/{name}' was "
      "not found"
    )

  def queued_resources_create(self, pos, flags):
    (name,) = pos
    for required in ("--node-id", "--accelerator-type", "--runtime-version"):
      if required not in flags:
        raise Refused(f"ERROR: (gcloud.compute.tpus.queued-resources.create) argument {required}: required", 2)
    if name in self.state["queued"]:
      raise Refused(f"ERROR: (gcloud.compute.tpus.queued-resources.create) ALREADY_EXISTS: {name}")
    self.state["queued"][name] = {
      "state": "WAITING_FOR_RESOURCES",
      "polls": self.config["waiting_polls"],
      "node": flags["--node-id"],
      "accelerator": flags["--accelerator-type"],
      "tier": [t for t in ("--spot", "--reserved", "--best-effort") if t in flags],
    }
    print(f"Create request issued for: [{name}]", file=sys.stderr)
    return 0

  def queued_resources_describe(self, pos, flags):
    (name,) = pos
    qr = self.state["queued"].get(name)
    if qr is None:
      self.not_found("queued-resources", name, flags)
    if qr["state"] == "WAITING_FOR_RESOURCES":
      if qr["polls"] > 0:
        qr["polls"] -= 1
      else:
        qr["state"] = "PROVISIONING"
    elif qr["state"] == "PROVISIONING":
      qr["state"] = "ACTIVE"
      self.new_node(qr["node"], qr["accelerator"], queued=name)
    print(
      qr["state"] if flags.get("--format") == "value(state.state)" else json.dumps({"state": {"state": qr["state"]}})
    )
    return 0

  def queued_resources_delete(self, pos, flags):
    (name,) = pos
    qr = self.state["queued"].get(name)
    if qr is None:
      self.not_found("queued-resources", name, flags)
    node = self.state["nodes"].get(qr["node"])
    if node and node["state"] != "PREEMPTED" and "--force" not in flags:
      raise Refused(
        f"ERROR: (gcloud.compute.tpus.queued-resources.delete) FAILED_PRECONDITION: {name} has a "
        "node; delete it first or pass --force"
      )
    self.log(
      "deletions.jsonl",
      {
        "queued": name,
        "state": qr["state"],
        "node": self.tag(qr["node"], node) if node else None,
        "node_state": node["state"] if node else None,
      },
    )
    self.delete_node(qr["node"])
    del self.state["queued"][name]
    return 0

  def tpu_vm_create(self, pos, flags):
    (name,) = pos
    if "--version" not in flags:
      raise Refused("ERROR: (gcloud.compute.tpus.tpu-vm.create) argument --version: required", 2)
    if name in self.state["nodes"]:
      raise Refused(f"ERROR: (gcloud.compute.tpus.tpu-vm.create) ALREADY_EXISTS: {name}")
    self.new_node(name, flags.get("--accelerator-type", "v2-8"))
    return 0

  def tpu_vm_describe(self, pos, flags):
    (name,) = pos
    node = self.state["nodes"].get(name)
    if node is None:
      self.not_found("tpu-vm", name, flags)
    print(node["state"] if flags.get("--format") == "value(state)" else json.dumps({"state": node["state"]}))
    return 0

  def tpu_vm_delete(self, pos, flags):
    (name,) = pos
    node = self.state["nodes"].get(name)
    if node is None:
      self.not_found("tpu-vm", name, flags)
    self.log("deletions.jsonl", {"node": self.tag(name, node), "node_state": node["state"]})
    self.delete_node(name)
    return 0

  def ready_node(self, name, flags, verb):
    node = self.state["nodes"].get(name)
    if node is None:
      self.not_found("tpu-vm", name, flags)
    if node["state"] != "READY":
      raise Refused(f"ERROR: (gcloud.compute.tpus.tpu-vm.{verb}) {name} is {node['state']}", 255)
    if flags.get("--worker") != "all":
      raise Refused(f"ERROR: (gcloud.compute.tpus.tpu-vm.{verb}) the fake plays --worker=all only", 2)
    return node

  def worker_env(self, name, node, worker):
    bin_dir = self.dir / "workerbin"
    if not bin_dir.exists():
      _write_worker_bin(bin_dir)
    return {
      **os.environ,
      **self.config["worker_env"],
      "HOME": str(self.home(name, node, worker)),
      "PATH": f"{bin_dir}:{os.environ['PATH']}",
      "FAKE_GCLOUD_DIR": str(self.dir),
      "FAKE_GCLOUD_NODE": self.tag(name, node),
      "FAKE_WORKER_ID": str(worker),
      "FAKE_WORKERS": str(node["hosts"]),
      "FAKE_SSH_CALL": str(self.state["ssh_calls"]),
    }

  def tpu_vm_ssh(self, pos, flags):
    (name,) = pos
    self.state["ssh_calls"] += 1
    if self.state["ssh_calls"] <= self.config["ssh_failures"]:
      print("ERROR: (gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [255].", file=sys.stderr)
      return 255
    node = self.ready_node(name, flags, "ssh")
    procs = [
      subprocess.Popen(
        ["bash", "-c", flags["--command"]],
        env=self.worker_env(name, node, w),
        cwd=self.home(name, node, w),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
      )
      for w in range(node["hosts"])
    ]
    self.save()  # the remote commands may take a while: later calls see this one's state
    rc = 0
    for p in procs:
      out, err = p.communicate()
      sys.stdout.buffer.write(out)
      sys.stderr.buffer.write(err)
      rc = max(rc, p.returncode)
    sys.stdout.flush()
    return rc

  def tpu_vm_scp(self, pos, flags):
    src, dest = pos
    name, _, target = dest.partition(":")
    node = self.ready_node(name, flags, "scp")
    for w in range(node["hosts"]):
      home = self.home(name, node, w)
      path = home / target if not target.endswith("/") else home / target / Path(src).name
      path.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(src, path)
    return 0


def _write_worker_bin(bin_dir: Path) -> None:
  bin_dir.mkdir(parents=True, exist_ok=True)
  me = f"{sys.executable} {Path(__file__).resolve()}"
  _write_exe(bin_dir / "hostname", '#!/bin/sh\necho "$FAKE_GCLOUD_NODE-w$FAKE_WORKER_ID"\n')
  _write_exe(
    bin_dir / "sudo", '#!/bin/sh\necho "$FAKE_GCLOUD_NODE-w$FAKE_WORKER_ID sudo $*" >> "$FAKE_GCLOUD_DIR/sudo.log"\n'
  )
  _write_exe(bin_dir / "python3.11", f'#!/bin/sh\nexec {me} --python "$@"\n')


def fake_python(argv: list[str]) -> int:
  """`python3.11 -m venv DIR` on a worker: DIR/bin/pip records its arguments, DIR/bin/remixer-t5 is the stub."""
  if argv[:2] != ["-m", "venv"] or len(argv) != 3:
    print(f"fake python3.11: only -m venv DIR, not {argv}", file=sys.stderr)
    return 2
  bin_dir = Path(argv[2]) / "bin"
  bin_dir.mkdir(parents=True, exist_ok=True)
  me = f"{sys.executable} {Path(__file__).resolve()}"
  _write_exe(bin_dir / "pip", f'#!/bin/sh\necho "pip $*" >> "{bin_dir.parent}/pip.log"\n')
  _write_exe(bin_dir / "remixer-t5", f'#!/bin/sh\nexec {me} --trainer "$@"\n')
  return 0


# --- the stub trainer ----------------------------------------------------------------------------------------
def trainer(argv: list[str]) -> int:
  config = json.loads((Path(os.environ["FAKE_GCLOUD_DIR"]) / "config.json").read_text())
  host = f"{os.environ['FAKE_GCLOUD_NODE']}-w{os.environ['FAKE_WORKER_ID']}"
  worker0 = os.environ["FAKE_WORKER_ID"] == "0"
  if argv[:1] != ["train"]:
    print(f"remixer-t5: error: the stub plays train only, not {argv[:1]}", file=sys.stderr)
    return 2
  binding = lambda key, default: next(
    (a.split("=", 1)[1].strip("'\"") for a in argv if a.startswith(f"--gin.{key}=")), default
  )
  for a in argv:
    if a.startswith("--gin_file="):
      name = a.split("=", 1)[1]
      if not (Path(name).exists() or (Path("gin") / name).exists()):
        print(f"remixer-t5: error: no gin file {name} in {os.getcwd()}", file=sys.stderr)
        return 2
  model_dir = binding("MODEL_DIR", None)
  if model_dir is None:
    print("remixer-t5: error: no MODEL_DIR", file=sys.stderr)
    return 2
  folder = (
    Path(os.environ["FAKE_GCLOUD_DIR"]) / "gcs" / model_dir[5:] if model_dir.startswith("gs://") else Path(model_dir)
  )
  steps = int(binding("TRAIN_STEPS", config["train_steps"]))
  period = int(binding("CHECKPOINT_PERIOD", config["checkpoint_period"]))
  folder.mkdir(parents=True, exist_ok=True)
  lock = folder / "lock.json"
  if worker0 and lock.exists():
    holder = json.loads(lock.read_text())
    lease = float(os.environ.get("REMIXER_T5_LOCK_LEASE", 120))
    if holder["host"] != host and time.time() - holder["renewed"] < lease:
      print(
        f"remixer-t5: error: MODEL_DIR {model_dir} is in use by process {holder['pid']} on {holder['host']}", flush=True
      )
      return 2

  def take_lock():  # written whole or not at all, as a bucket object is
    part = lock.with_name(f"lock.{host}.part")
    part.write_text(json.dumps({"host": host, "pid": os.getpid(), "renewed": time.time()}))
    os.replace(part, lock)

  if worker0:
    take_lock()
  checkpoints = folder / "checkpoints"
  done = sorted(int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()) if checkpoints.exists() else []
  start = done[-1] if done else 0
  stop = []
  signal.signal(signal.SIGTERM, lambda *_: stop.append("preempted (SIGTERM)"))
  # Every worker read the checkpoint before any trains: the processes of one start wait for each other, as
  # jax.distributed.initialize() makes them do.
  barrier = (
    Path(os.environ["FAKE_GCLOUD_DIR"]) / "barrier" / f"{os.environ['FAKE_GCLOUD_NODE']}-{os.environ['FAKE_SSH_CALL']}"
  )
  barrier.mkdir(parents=True, exist_ok=True)
  (barrier / host).touch()
  while len(list(barrier.iterdir())) < int(os.environ["FAKE_WORKERS"]):
    if stop:
      return 0
    time.sleep(0.01)
  with open(folder / "starts.jsonl", "a") as f:
    f.write(
      json.dumps(
        {
          "host": host,
          "start": start,
          "argv": argv,
          "env": {k: os.environ.get(k) for k in ("TFDS_DATA_DIR", "REMIXER_T5_DISTRIBUTED")},
        }
      )
      + "\n"
    )
  print(f"resuming from step {start}" if start else "starting at step 0", flush=True)

  def save(step):
    if worker0:
      (checkpoints / str(step)).mkdir(parents=True, exist_ok=True)
      take_lock()

  for step in range(start + 1, steps + 1):
    time.sleep(config["step_seconds"])
    print(f"step {step}/{steps} loss {10.0 / step:.3f}", flush=True)
    if stop:
      save(step)
      print(f"{stop[0]}: saved step {step} in {model_dir}/checkpoints; rerun the same command to resume", flush=True)
      if worker0:
        lock.unlink()
      return 0
    if step % period == 0 or step == steps:
      save(step)
    if worker0 and os.environ.get("FAKE_TRAIN_EXIT") and step == 3:
      code = int(os.environ["FAKE_TRAIN_EXIT"])
      print(f"remixer-t5: error: loss is NaN at step {step}; stopped without saving", flush=True)
      return code
    if config["pause_at"] and start < config["pause_at"] == step:
      print(f"pausing at step {step} until the slice is preempted", flush=True)
      release = Path(os.environ["FAKE_GCLOUD_DIR"]) / "release"
      for _ in range(6000):
        time.sleep(0.01)
        if worker0:
          take_lock()  # renewed while it runs, as remixer-t5's lock is
        if stop or release.exists():
          break
  if worker0:
    lock.unlink()
  print(f"finished at step {steps}", flush=True)
  return 0


def main(argv: list[str]) -> int:
  if argv[:1] == ["--trainer"]:
    return trainer(argv[1:])
  if argv[:1] == ["--python"]:
    return fake_python(argv[1:])
  state_dir = Path(os.environ["FAKE_GCLOUD_DIR"])
  with open(state_dir / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    fake = Fake(state_dir)
    try:
      return fake.run(argv)
    except Refused as e:
      print(e, file=sys.stderr)
      return e.code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
