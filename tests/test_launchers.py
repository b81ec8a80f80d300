"""launch/*.sh: dry runs print the right gcloud/sbatch commands, arguments survive quoting, bad flags exit 2, and
the TPU VM launcher carries a run through a slice's lifecycle.

Nothing here reaches Google Cloud or a SLURM cluster: launcher calls are --dry-runs, run with an empty PATH (where
the launcher must refuse for lack of gcloud/sbatch), or run against tests/fake_gcloud.py, a `gcloud` that plays
queued resources, preemption and workers on this computer. The printed remote commands and sbatch script are
executed by bash against stub programs, so quoting is checked by bash itself, not by string matching.
"""

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import fake_gcloud
import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
BASH = shutil.which("bash")
# A gin binding with shell quotes, and an argument with spaces, quotes and a dollar sign.
ARGS = ["train", "--gin_file=runs/pretrain.gin", "--gin.MODEL_DIR='gs://b/run'", "--gin.RUN_NAME=\"it's a $HOME test\""]


def launch(script, *argv, cwd=None, env=None):
  return subprocess.run(
    [BASH, str(LAUNCH / script), *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=30
  )


def tpu(*argv, **kw):
  return launch("tpu_vm.sh", "--name=r5", "--zone=europe-west4-a", *argv, **kw)


def commands(stdout):
  """The printed command lines (comment lines dropped), each split into words by bash itself."""
  lines = [line for line in stdout.splitlines() if line.strip() and not line.startswith("#")]
  script = "".join(f"set -- {line}\nprintf '%s\\0' \"$@\"; printf '\\1\\0'\n" for line in lines)
  words = subprocess.run([BASH, "-c", script], capture_output=True, text=True, check=True, timeout=30).stdout
  out, current = [], []
  for word in words.split("\0")[:-1]:
    if word == "\1":
      out.append(current)
      current = []
    else:
      current.append(word)
  return out


def ssh_commands(cmds):
  return [next(a.split("=", 1)[1] for a in c if a.startswith("--command=")) for c in cmds if c[4:5] == ["ssh"]]


def gcloud_verbs(cmds):
  """(group, verb) of each gcloud command, e.g. ('queued-resources', 'create'), ('tpu-vm', 'ssh')."""
  return [tuple(c[3:5]) for c in cmds if c[0] == "gcloud"]


def make_exe(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


def jax_pin():
  return re.search(r'"jax==([^"]+)"', (REPO / "setup.py").read_text()).group(1)


def test_the_gpu_extra_is_jaxs_cuda_plugin_at_the_pinned_jax():
  text = (REPO / "setup.py").read_text()
  assert re.search(r'GPU_REQUIRES = \["jax\[cuda12\]==([^"]+)"\]', text).group(1) == jax_pin()
  assert '"gpu": GPU_REQUIRES' in text


# --- all launchers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", sorted(p.name for p in LAUNCH.glob("*.sh")))
def test_syntax(script):
  res = subprocess.run([BASH, "-n", str(LAUNCH / script)], capture_output=True, text=True)
  assert res.returncode == 0, res.stderr


def test_shellcheck():
  if not shutil.which("shellcheck"):
    pytest.skip("shellcheck not installed; bash -n still checks the syntax")
  res = subprocess.run(
    ["shellcheck", "-S", "warning", *map(str, sorted(LAUNCH.glob("*.sh")))], capture_output=True, text=True
  )
  assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", ["tpu_vm.sh", "slurm.sh", "local.sh"])
def test_help(script):
  res = launch(script, "--help")
  assert res.returncode == 0 and "Usage" in res.stdout and "--dry-run" in res.stdout


# --- TPU VM: what a dry run prints ------------------------------------------------------------------------
def remote(command, home, env=None, timeout=30):
  """Runs a printed remote command with bash as a worker would: HOME=`home`, a stub `sudo` that records its
  arguments in home/sudo.log and runs nothing."""
  make_exe(home / "stubs" / "sudo", '#!/bin/sh\necho "$*" >> "$HOME/sudo.log"\n')
  return subprocess.run(
    [BASH, "-c", command],
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=home,
    env={"HOME": str(home), "PATH": f"{home / 'stubs'}:{os.environ['PATH']}", **(env or {})},
  )


def wait_for(path, timeout=10):
  deadline = time.time() + timeout
  while not path.exists():
    assert time.time() < deadline, f"{path} did not appear in {timeout} s"
    time.sleep(0.02)
  return path.read_text()


def test_tpu_all_creates_installs_starts_the_job_follows_it_then_deletes():
  res = tpu("--accelerator=v3-32", "--dry-run", "all", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  cmds = commands(res.stdout)
  assert gcloud_verbs(cmds) == [
    ("tpu-vm", v) for v in ("create", "describe", "scp", "ssh", "ssh", "ssh", "describe", "ssh", "ssh", "delete")
  ]
  gcloud = [c for c in cmds if c[0] == "gcloud"]
  create = gcloud[0]
  assert create[5] == "r5" and "--accelerator-type=v3-32" in create
  assert "--version=tpu-ubuntu2204-base" in create and "--zone=europe-west4-a" in create
  assert all("--worker=all" in c for c in gcloud if c[4] in ("scp", "ssh"))
  assert gcloud[-1][4:6] == ["delete", "r5"] and "--quiet" in gcloud[-1]
  _, install, start, status, logs = ssh_commands(cmds)
  assert f"jax[tpu]=={jax_pin()}" in shlex.split(install.split("pip install -q", 2)[2])
  assert "nohup setsid bash" in start and "remixer-t5-job" in status and "tail -n 100" in logs


def test_tpu_queued_spot_all_requests_spot_starts_a_detached_job_and_forwards_the_env(tmp_path):
  """The issue's dry run: a Spot queued resource, a start that returns while the job runs on, TFDS_DATA_DIR
  reaching the job, the TPU's leftover users and libtpu's lock file cleared first."""
  res = tpu(
    "--queued", "--spot", "--accelerator=v3-32", "--env=TFDS_DATA_DIR=gs://b/tfds", "--dry-run", "all", "--", *ARGS
  )
  assert res.returncode == 0, res.stderr
  cmds = commands(res.stdout)
  create = cmds[0]
  assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "r5"]
  assert {
    "--node-id=r5",
    "--accelerator-type=v3-32",
    "--runtime-version=tpu-ubuntu2204-base",
    "--spot",
    "--zone=europe-west4-a",
  } <= set(create)
  assert gcloud_verbs(cmds)[-1] == ("queued-resources", "delete") and {"--force", "--quiet"} <= set(cmds[-1])
  start = ssh_commands(cmds)[2]
  make_exe(
    tmp_path / "remixer-t5-venv" / "bin" / "remixer-t5",
    '#!/usr/bin/env bash\nsleep 0.5\necho "TFDS_DATA_DIR=$TFDS_DATA_DIR"\n'
    'echo "REMIXER_T5_DISTRIBUTED=$REMIXER_T5_DISTRIBUTED"\nprintf "%s\\n" "$@"\n',
  )
  (tmp_path / "remixer-t5").mkdir()
  started = remote(start, tmp_path)
  assert started.returncode == 0 and "started the job" in started.stdout, started.stdout + started.stderr
  job = tmp_path / "remixer-t5-job"
  pid = int((job / "pid").read_text())
  os.kill(pid, 0)  # the ssh command has returned; the job runs on
  assert wait_for(job / "exit").strip() == "0"
  log = (job / "log").read_text().splitlines()
  assert log[1:] == ["TFDS_DATA_DIR=gs://b/tfds", "REMIXER_T5_DISTRIBUTED=auto", *ARGS]
  assert (tmp_path / "sudo.log").read_text().splitlines() == ["-n lsof -t /dev/accel*", "-n rm -f /tmp/libtpu_lockfile"]


def test_tpu_run_passes_arguments_through_with_quoting_intact(tmp_path):
  """bash runs the printed start command against a stub remixer-t5 that lists its arguments."""
  res = tpu("--dry-run", "--env=TFDS_DATA_DIR=gs://b/tfds dir", "run", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  (start,) = ssh_commands(commands(res.stdout))
  (tmp_path / "remixer-t5").mkdir()
  make_exe(
    tmp_path / "remixer-t5-venv" / "bin" / "remixer-t5",
    '#!/usr/bin/env bash\necho "cwd=$PWD"\necho "TFDS_DATA_DIR=$TFDS_DATA_DIR"\nprintf "%s\\n" "$@"\n',
  )
  assert remote(start, tmp_path).returncode == 0
  assert wait_for(tmp_path / "remixer-t5-job" / "exit").strip() == "0"
  out = (tmp_path / "remixer-t5-job" / "log").read_text().splitlines()[1:]
  assert out[0] == f"cwd={tmp_path / 'remixer-t5'}"
  assert out[1] == "TFDS_DATA_DIR=gs://b/tfds dir"
  assert out[2:] == ARGS


def test_tpu_tiers_best_effort_is_alphas_and_spot_needs_no_queue():
  best = commands(tpu("--dry-run", "--queued", "--best-effort", "create").stdout)[0]
  assert best[:5] == ["gcloud", "alpha", "compute", "tpus", "queued-resources"] and "--best-effort" in best
  for tier in ("--spot", "--reserved"):
    create = commands(tpu("--dry-run", tier, "create").stdout)[0]
    assert create[3:5] == ["tpu-vm", "create"] and tier in create


@pytest.mark.parametrize("queued", [[], ["--queued"]])
def test_tpu_status_logs_stop_delete_and_watch(queued):
  kind = "queued-resources" if queued else "tpu-vm"
  status = commands(tpu("--dry-run", *queued, "status").stdout)
  assert gcloud_verbs(status) == [(kind, "describe")] * bool(queued) + [("tpu-vm", "describe"), ("tpu-vm", "ssh")]
  (logs,) = ssh_commands(commands(tpu("--dry-run", *queued, "logs", "--lines=5").stdout))
  assert "tail -n 5 $HOME/remixer-t5-job/log" in logs
  (stop,) = ssh_commands(commands(tpu("--dry-run", *queued, "stop").stdout))
  assert "kill -TERM" in stop and "stopped" in stop
  (delete,) = commands(tpu("--dry-run", *queued, "delete").stdout)
  assert delete[3:6] == [kind, "delete", "r5"] and "--quiet" in delete and ("--force" in delete) == bool(queued)
  watch = gcloud_verbs(commands(tpu("--dry-run", *queued, "watch", "--", *ARGS).stdout))
  assert ("tpu-vm", "delete") not in watch and (kind, "delete") not in watch
  watch = gcloud_verbs(commands(tpu("--dry-run", *queued, "watch", "--delete", "--", *ARGS).stdout))
  assert watch[-1] == (kind, "delete")


def test_tpu_run_never_deletes_and_a_dry_run_writes_no_log(tmp_path):
  res = tpu("--dry-run", "--log=r5.log", "run", "--", *ARGS, cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  assert gcloud_verbs(commands(res.stdout)) == [("tpu-vm", "ssh")]
  assert list(tmp_path.iterdir()) == []


def test_tpu_all_keep_skips_the_delete():
  cmds = commands(tpu("--dry-run", "--keep", "all", "--", *ARGS).stdout)
  assert gcloud_verbs(cmds)[-1] == ("tpu-vm", "ssh")


@pytest.mark.parametrize(
  "source, expected",
  [
    (["--repo=https://github.com/me/remixer_t5.git@v1"], "git+https://github.com/me/remixer_t5.git@v1"),
    (
      ["--wheel=https://example.org/remixer_t5-0.1.0-py3-none-any.whl"],
      "https://example.org/remixer_t5-0.1.0-py3-none-any.whl",
    ),
  ],
)
def test_tpu_install_from_git_or_wheel_url(source, expected):
  res = tpu("--dry-run", *source, "install")
  assert res.returncode == 0, res.stderr
  cmds = commands(res.stdout)
  assert [c[4] for c in cmds] == ["ssh"]  # nothing copied from this checkout
  (install,) = ssh_commands(cmds)
  assert shlex.split(install.split("pip install -q", 2)[2]) == [f"jax[tpu]=={jax_pin()}", expected]


def test_tpu_install_local_wheel_is_copied_to_every_worker():
  cmds = commands(tpu("--dry-run", "--wheel=dist/remixer_t5-0.1.0-py3-none-any.whl", "install").stdout)
  scp = next(c for c in cmds if c[4] == "scp")
  assert scp[5:7] == ["dist/remixer_t5-0.1.0-py3-none-any.whl", "r5:remixer-t5/"] and "--worker=all" in scp
  assert ssh_commands(cmds)[-1].endswith("$HOME/remixer-t5/remixer_t5-0.1.0-py3-none-any.whl")


def test_tpu_single_host_accepts_a_local_model_dir_and_project_reaches_every_command():
  res = tpu("--dry-run", "--project=my-proj", "--queued", "all", "--", "train", "--gin.MODEL_DIR='/tmp/run'")
  assert res.returncode == 0, res.stderr
  gcloud = [c for c in commands(res.stdout) if c[0] == "gcloud"]
  assert len(gcloud) > 5 and all("--project=my-proj" in c for c in gcloud)


def test_tpu_multi_host_without_model_dir_binding_warns():
  res = tpu("--dry-run", "--accelerator=v3-32", "run", "--", "train", "--gin_file=runs/pretrain.gin")
  assert res.returncode == 0 and "warning" in res.stderr and "gs://" in res.stderr


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["--accelerator=v3-32", "run", "--", "train", "--gin.MODEL_DIR='/tmp/run'"], "--gin.MODEL_DIR"),
    (["--bogus", "run"], "--bogus"),
    (["--accelerator=v3", "create"], "--accelerator"),
    (["--accelerator=tpu-8", "create"], "--accelerator"),
    (["--zone"], "--zone"),
    (["--version", "--dry-run", "create"], "--version"),
    (["--wheel=a.whl", "--repo=https://x/y.git", "install"], "--wheel"),
    (["--keep", "run", "--", "train"], "--keep"),
    (["--delete", "run", "--", "train"], "--delete"),
    (["--restart", "watch", "--", "train"], "--restart"),
    (["--spot", "--reserved", "create"], "--reserved"),
    (["--best-effort", "create"], "--best-effort needs --queued"),
    (["--max-restarts=many", "watch", "--", "train"], "--max-restarts"),
    (["--poll=soon", "status"], "--poll"),
    (["--active-timeout=-1", "create"], "--active-timeout"),
    (["--lines=x", "logs"], "--lines"),
    (["--env=1X=2", "run", "--", "train"], "--env"),
    (["run"], "after --"),
    (["watch"], "after --"),
    (["create", "--", "train"], "after --"),
    (["status", "--", "train"], "after --"),
    ([], "step"),
    (["launch"], "step"),
  ],
)
def test_tpu_bad_flags_exit_2_naming_the_flag_in_one_line(argv, flag):
  res = tpu("--dry-run", *argv)
  assert res.returncode == 2, res.stdout
  assert flag in res.stderr and "error" in res.stderr and not res.stdout
  assert len(res.stderr.splitlines()) == 1, res.stderr


@pytest.mark.parametrize("missing", ["--name", "--zone"])
def test_tpu_requires_name_and_zone(missing):
  given = [a for a in ("--name=r5", "--zone=europe-west4-a") if not a.startswith(missing)]
  res = launch("tpu_vm.sh", *given, "--dry-run", "delete")
  assert res.returncode == 2 and f"{missing} is required" in res.stderr


def test_tpu_backoff_must_be_whole_seconds():
  res = tpu("--dry-run", "delete", env={**os.environ, "REMIXER_T5_LAUNCH_BACKOFF": "soon"})
  assert res.returncode == 2 and "REMIXER_T5_LAUNCH_BACKOFF" in res.stderr


# --- TPU VM: a run's lifecycle against the fake gcloud -----------------------------------------------------
V3_32 = ["--name=r5", "--zone=europe-west4-a", "--accelerator=v3-32"]
TRAIN = ["train", "--gin.MODEL_DIR='gs://b/r5'", "--gin.TRAIN_STEPS=20", "--gin.CHECKPOINT_PERIOD=5"]


class Cloud:
  """A fake gcloud on PATH (tests/fake_gcloud.py), its state in `state`; `tpu(...)` runs the launcher against it
  with the backoff and the polls shortened."""

  def __init__(self, tmp_path, **config):
    self.state = tmp_path / "cloud"
    self.env = {
      **os.environ,
      **fake_gcloud.install(tmp_path / "bin", self.state, **config),
      "REMIXER_T5_LAUNCH_BACKOFF": "0",
      "REMIXER_T5_LAUNCH_POLL": "0.05",
    }
    self.wheel = tmp_path / "remixer_t5-0.1.0-py3-none-any.whl"
    self.wheel.write_bytes(b"")

  def tpu(self, *argv, timeout=60):
    return subprocess.run(
      [BASH, str(LAUNCH / "tpu_vm.sh"), *V3_32, f"--wheel={self.wheel}", *argv],
      capture_output=True,
      text=True,
      env=self.env,
      timeout=timeout,
      cwd=self.state.parent,
    )

  def calls(self):
    return fake_gcloud.calls(self.state)

  def verbs(self):
    return [tuple(w for w in c if not w.startswith("-"))[2:4] for c in self.calls()]

  def starts(self, worker=0):
    """Where each start of the job on worker `worker` began: (host, step)."""
    path = fake_gcloud.gcs(self.state, "gs://b/r5") / "starts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["host"], r["start"]) for r in rows if r["host"].endswith(f"-w{worker}")]


@pytest.fixture
def cloud(tmp_path):
  made = []
  yield lambda **config: made.append(Cloud(tmp_path, **config)) or made[-1]
  for c in made:
    fake_gcloud.kill_all(c.state)


def test_tpu_lifecycle_preemption_restart_and_resume(cloud):
  """A Spot queued resource waits, turns ACTIVE; the first ssh fails and is retried; the job runs detached on
  the 4 workers; the slice is preempted at step 10 (the job killed without a signal); `all --restart` recreates
  it, reinstalls and reruns the same command, which resumes from the step-10 checkpoint and finishes; the slice is
  deleted once, at the end."""
  c = cloud(ssh_failures=1, preempt_when="gcs/b/r5/checkpoints/10", pause_at=10)
  res = c.tpu(
    "--queued",
    "--spot",
    "--env=TFDS_DATA_DIR=gs://b/tfds",
    "--env=REMIXER_T5_LOCK_LEASE=0",
    "--lines=1",
    "all",
    "--restart",
    "--",
    *TRAIN,
  )
  assert res.returncode == 0, res.stdout + res.stderr
  out = res.stdout
  assert "WAITING_FOR_RESOURCES" in out and out.count("is READY") == 2
  assert "install (mkdir) failed (exit 255); retry 1 of 5" in res.stderr
  restarts = [line for line in out.splitlines() if "restart" in line]
  assert len(restarts) == 1, out
  restart = restarts[0]
  assert re.search(r"restart 1 of 10: r5 is (SUSPENDED|PREEMPTED); recreating the slice", restart)
  assert "the job finished on every worker of r5 (exit 0)" in out
  assert c.starts() == [("r5-g1-w0", 0), ("r5-g2-w0", 10)]
  assert fake_gcloud.deletions(c.state) == [
    {"queued": "r5", "state": "SUSPENDED", "node": "r5-g1", "node_state": "PREEMPTED"},
    {"queued": "r5", "state": "ACTIVE", "node": "r5-g2", "node_state": "READY"},
  ]
  assert c.verbs()[-1] == ("queued-resources", "delete")
  assert [v for v in c.verbs() if v[1] == "create"] == [("queued-resources", "create")] * 2
  create = next(call for call in c.calls() if call[2:4] == ["queued-resources", "create"])
  assert "--spot" in create
  rows = [
    json.loads(line) for line in (fake_gcloud.gcs(c.state, "gs://b/r5") / "starts.jsonl").read_text().splitlines()
  ]
  assert len(rows) == 8 and all(
    r["env"] == {"TFDS_DATA_DIR": "gs://b/tfds", "REMIXER_T5_DISTRIBUTED": "auto"} for r in rows
  )
  assert sorted(p.name for p in (fake_gcloud.gcs(c.state, "gs://b/r5") / "checkpoints").iterdir()) == [
    "10",
    "15",
    "20",
    "5",
  ]


def test_tpu_a_dry_run_prints_the_commands_a_run_makes(cloud):
  """The distinct gcloud commands of a real `all` against the fake, in the order of their first use, are the ones
  its --dry-run prints (polls repeat; each start's token differs)."""
  c = cloud(waiting_polls=0)
  argv = ["--queued", "--spot", "--env=TFDS_DATA_DIR=gs://b/tfds", "all", "--", *TRAIN]
  res = c.tpu(*argv)
  assert res.returncode == 0, res.stdout + res.stderr
  dry = c.tpu("--dry-run", *argv)
  assert dry.returncode == 0, dry.stderr

  def distinct(cmds):
    out = []
    for cmd in cmds:
      cmd = [re.sub(r"token=[^;]+;", "token=T;", w) for w in cmd]
      if cmd not in out:
        out.append(cmd)
    return out

  printed = distinct(cmd[1:] for cmd in commands(dry.stdout) if cmd[0] == "gcloud")
  assert distinct(c.calls()) == printed
  assert len(printed) == 10  # create, 2 describes, mkdir, scp, install, start, status, logs, delete


def test_tpu_all_without_restart_ends_at_a_preemption_and_deletes(cloud):
  """Without --restart, `all` follows the job and, when the slice is preempted, says so, ends with exit 1 and
  deletes the slice (the queued resource) once."""
  c = cloud(preempt_when="gcs/b/r5/checkpoints/10", pause_at=10)
  res = c.tpu("--queued", "--spot", "all", "--", *TRAIN)
  assert res.returncode == 1, res.stdout + res.stderr
  assert re.search(r"r5 is (SUSPENDED|PREEMPTED); not restarted \(all --restart restarts\)", res.stdout)
  assert [d["state"] for d in fake_gcloud.deletions(c.state)] == ["SUSPENDED"]
  assert c.starts() == [("r5-g1-w0", 0)]


def test_tpu_a_job_that_dies_on_a_ready_slice_is_rerun_there(cloud):
  """A worker's remixer-t5 killed (kill -9, as the OOM killer does) on a healthy slice: the job is rerun on the same
  slice (the other workers' processes replaced), resumes, and no slice is recreated."""
  c = cloud(pause_at=10)
  proc = subprocess.Popen(
    [BASH, str(LAUNCH / "tpu_vm.sh"), *V3_32, f"--wheel={c.wheel}", "all", "--restart", "--", *TRAIN],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=c.env,
  )
  try:
    job = c.state / "workers" / "r5-g1-w2" / "remixer-t5-job"
    while not ((job / "log").exists() and "pausing" in (job / "log").read_text()):
      assert proc.poll() is None
      time.sleep(0.05)
    os.kill(int((job / "pid").read_text()), signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 0, out
  assert "restart 1 of 10: the job exited with 137; running the same command again on r5" in out
  assert [v for v in c.verbs() if v[1] in ("create", "delete")] == [("tpu-vm", "create"), ("tpu-vm", "delete")]
  hosts, steps = zip(*c.starts())
  assert hosts == ("r5-g1-w0", "r5-g1-w0") and steps[0] == 0 and steps[1] >= 10


def test_tpu_a_job_that_fails_for_good_is_not_rerun(cloud):
  """Exit 3 (a NaN loss) would recur on a rerun: `all --restart` reports it and ends with its code, and the slice
  goes."""
  c = cloud(worker_env={"FAKE_TRAIN_EXIT": "3"})
  res = c.tpu("all", "--restart", "--", *TRAIN)
  assert res.returncode == 3, res.stdout + res.stderr
  assert "the job failed (exit 3: r5-g1-w0: remixer-t5: error: loss is NaN at step 3" in res.stdout
  assert "restart 1" not in res.stdout
  assert [v for v in c.verbs() if v[1] in ("create", "delete")] == [("tpu-vm", "create"), ("tpu-vm", "delete")]


def test_tpu_a_lock_still_held_after_a_recreation_is_waited_out(cloud):
  """The preempted run's MODEL_DIR lock was renewed moments ago (the fake recreates a slice within the 3 s lease;
  Google takes minutes, longer than the default 120 s): the rerun on the new hosts is refused (exit 2, "is in use
  by"); the launcher waits the lease and runs it again, and it takes the lock over."""
  c = cloud(preempt_when="gcs/b/r5/checkpoints/10", pause_at=10)
  res = c.tpu("--queued", "--env=REMIXER_T5_LOCK_LEASE=3", "all", "--restart", "--", *TRAIN)
  assert res.returncode == 0, res.stdout + res.stderr
  restarts = [line for line in res.stdout.splitlines() if "restart " in line]
  assert len(restarts) == 2 and "MODEL_DIR's lock is held" in restarts[1] and "is in use by" in restarts[1]
  assert c.starts() == [("r5-g1-w0", 0), ("r5-g2-w0", 10)]  # the refused start records nothing


def test_tpu_the_job_outlives_the_launcher(cloud):
  """The launcher's session ends (SIGHUP) while `all` follows the job: slice and job keep running and a second
  `run` is refused; `status` and `logs` read it, and `watch --delete` follows it to the end and deletes the slice."""
  c = cloud(pause_at=10)
  proc = subprocess.Popen(
    [BASH, str(LAUNCH / "tpu_vm.sh"), *V3_32, f"--wheel={c.wheel}", "--queued", "all", "--", *TRAIN],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=c.env,
  )
  log = c.state / "workers" / "r5-g1-w0" / "remixer-t5-job" / "log"
  try:
    while not (log.exists() and "pausing" in log.read_text()):
      assert proc.poll() is None
      time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 129 and "r5 and its job keep running" in out, out
  assert all(v[1] != "delete" for v in c.verbs())
  again = c.tpu("--queued", "run", "--", *TRAIN)
  assert again.returncode == 1 and "a job is already running" in again.stderr
  assert len(again.stderr.strip().splitlines()) == 1
  status = c.tpu("--queued", "status")
  assert status.stdout.count(": running; last line: ") == 4, status.stdout
  logs = c.tpu("--queued", "logs", "--lines=1")
  assert logs.stdout.splitlines() == [f"r5-g1-w{w}: pausing at step 10 until the slice is preempted" for w in range(4)]
  (c.state / "release").touch()
  res = c.tpu("--queued", "watch", "--delete", "--", *TRAIN)
  assert res.returncode == 0 and "the job finished on every worker of r5" in res.stdout, res.stdout + res.stderr
  assert [v for v in c.verbs() if v[1] == "delete"] == [("queued-resources", "delete")]


def _walkthrough_blocks():
  """The shell blocks of docs/scaling.md's v3-32 section that run the launcher."""
  text = (REPO / "docs" / "scaling.md").read_text()
  section = text.split("## Launch a v3-32 run", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"^```(?:bash|sh)?\n(.*?)^```", section, re.S | re.M)
  return [b for b in blocks if "launch/tpu_vm.sh" in b]


@pytest.mark.parametrize("block", range(2))
def test_docs_v3_32_walkthrough_runs_as_written(cloud, tmp_path, block):
  """Each launcher block of the walk-through, as written (the launcher's path made absolute), against the fake
  gcloud: queued Spot slice, a failed first ssh, the checkout installed, the job preempted at step 10 and resumed
  on a recreated slice, the slice deleted at the end. In the fake, the preempted run's MODEL_DIR lock has lapsed
  by the time the slice is back, as it has after Google's minutes of recreation."""
  blocks = _walkthrough_blocks()
  assert len(blocks) == 2
  c = cloud(
    ssh_failures=1,
    preempt_when="gcs/my-bucket/r5/checkpoints/10",
    preempt_during=["watch", "all"],
    pause_at=10,
    worker_env={"REMIXER_T5_LOCK_LEASE": "0"},
  )
  script = blocks[block].replace("launch/tpu_vm.sh", str(LAUNCH / "tpu_vm.sh"))
  res = subprocess.run(
    [BASH, "-euo", "pipefail", "-c", script], capture_output=True, text=True, env=c.env, cwd=c.state.parent, timeout=120
  )
  assert res.returncode == 0, res.stdout + res.stderr
  assert re.search(r"r5 is (SUSPENDED|PREEMPTED); recreating the slice", res.stdout)
  rows = [
    json.loads(line)
    for line in (fake_gcloud.gcs(c.state, "gs://my-bucket/r5") / "starts.jsonl").read_text().splitlines()
  ]
  assert [(r["host"], r["start"]) for r in rows if r["host"].endswith("-w0")] == [("r5-g1-w0", 0), ("r5-g2-w0", 10)]
  assert all(r["env"]["TFDS_DATA_DIR"] == "gs://my-bucket/tensorflow_datasets" for r in rows)
  assert [d["state"] for d in fake_gcloud.deletions(c.state)] == ["SUSPENDED", "ACTIVE"]
  assert c.verbs()[-1] == ("queued-resources", "delete")


# --- SLURM -----------------------------------------------------------------------------------------------
def slurm_dry_run(tmp_path, *flags):
  res = launch("slurm.sh", *flags, "--dry-run", "--", *ARGS, cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  lines = res.stdout.splitlines()
  assert lines[0] == "cat > remixer-t5.sbatch <<'SBATCH_SCRIPT'"
  end = lines.index("SBATCH_SCRIPT")
  assert lines[end + 1 :] == ["sbatch remixer-t5.sbatch"]
  assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
  return lines[1:end]


def test_slurm_script_has_directives_and_one_srun_task_per_node(tmp_path):
  script = slurm_dry_run(
    tmp_path, "--nodes", "4", "--gpus-per-node=8", "--partition=gpu", "--time=2-00:00:00", "--sbatch-arg=--exclusive"
  )
  assert script[0] == "#!/bin/bash"
  for directive in (
    "--nodes=4",
    "--ntasks-per-node=1",
    "--gpus-per-node=8",
    "--partition=gpu",
    "--time=2-00:00:00",
    "--job-name=remixer-t5",
    "--exclusive",
  ):
    assert f"#SBATCH {directive}" in script
  text = "\n".join(script)
  assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
  for var in ("REMIXER_T5_COORDINATOR", "REMIXER_T5_NUM_PROCESSES", "REMIXER_T5_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
    assert var in text
  srun = shlex.split(script[-1])
  assert srun[0] == "srun" and srun[-len(ARGS) :] == ARGS


def test_slurm_script_runs_one_process_per_node_with_coordinator_env(tmp_path):
  """bash runs the printed script with stub scontrol/srun and a venv whose remixer-t5 records its env."""
  work = tmp_path / "work"
  work.mkdir()
  script = slurm_dry_run(
    work, "--nodes=2", "--gpus-per-node=4", f"--venv={tmp_path / 'my venv'}", "--env=REMIXER_T5_DATA_DIR=/data/a b"
  )
  (tmp_path / "job.sbatch").write_text("\n".join(script) + "\n")
  stubs, out = tmp_path / "stubs", tmp_path / "out"
  out.mkdir()
  make_exe(
    stubs / "scontrol", '#!/usr/bin/env bash\n[ "$*" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n'
  )
  # srun: drop its own options, then start the command once per task, as SLURM would on each node.
  make_exe(
    stubs / "srun",
    '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
    'for i in 0 1; do SLURM_NTASKS=2 SLURM_PROCID=$i "$@" || exit; done\n',
  )
  make_exe(
    tmp_path / "my venv" / "bin" / "remixer-t5",
    '#!/usr/bin/env bash\nenv | grep -E "^(REMIXER_T5_|JAX_COORDINATOR)" | sort > "$OUT/$SLURM_PROCID.env"\n'
    'printf "%s\\n" "$@" > "$OUT/$SLURM_PROCID.args"\n',
  )
  (tmp_path / "my venv" / "bin" / "activate").write_text(
    f'export PATH={shlex.quote(str(tmp_path / "my venv" / "bin"))}:"$PATH"\n'
  )
  env = {
    "PATH": f"{stubs}:{os.environ['PATH']}",
    "OUT": str(out),
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "4097",
    "SLURM_JOB_NUM_NODES": "2",
  }
  res = subprocess.run([BASH, str(tmp_path / "job.sbatch")], capture_output=True, text=True, env=env, timeout=30)
  assert res.returncode == 0, res.stderr
  assert "coordinator gpu07:61441" in res.stdout  # 4097 % 4096 + 61440
  for i in (0, 1):
    assert (out / f"{i}.args").read_text().splitlines() == ARGS
    assert (out / f"{i}.env").read_text().splitlines() == [
      "JAX_COORDINATOR_ADDRESS=gpu07:61441",
      "REMIXER_T5_COORDINATOR=gpu07:61441",
      "REMIXER_T5_DATA_DIR=/data/a b",
      "REMIXER_T5_NUM_PROCESSES=2",
      f"REMIXER_T5_PROCESS_ID={i}",
    ]


def test_slurm_default_coordinator_matches_jax_slurm_autodetection(monkeypatch):
  """With no --port, the script's coordinator is the one a bare jax.distributed.initialize() would pick."""
  slurm_cluster = pytest.importorskip("jax._src.clusters.slurm_cluster")
  monkeypatch.setenv("SLURM_JOB_ID", "123457")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
  assert slurm_cluster.SlurmCluster.get_coordinator_address(None, None) == f"gpu07:{123457 % 4096 + 61440}"


def test_slurm_explicit_port(tmp_path):
  assert "port=29500" in slurm_dry_run(tmp_path, "--port=29500")


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["--nodes=0", "--", "train"], "--nodes"),
    (["--nodes=two", "--", "train"], "--nodes"),
    (["--gpus-per-node=", "--", "train"], "--gpus-per-node"),
    (["--time=tomorrow", "--", "train"], "--time"),
    (["--job-name=a/b", "--", "train"], "--job-name"),
    (["--port=80", "--", "train"], "--port"),
    (["--partition", "--", "train"], "--partition"),
    (["--gpus", "--", "train"], "--gpus"),
    (["train"], "after --"),
    ([], "after --"),
  ],
)
def test_slurm_bad_flags_exit_2_naming_the_flag(argv, flag, tmp_path):
  res = launch("slurm.sh", "--dry-run", *argv, cwd=tmp_path)
  assert res.returncode == 2, res.stdout
  assert flag in res.stderr and "error" in res.stderr and not res.stdout


# --- refusing to run for real without the cloud tools ----------------------------------------------------
@pytest.mark.parametrize(
  "script, argv, tool",
  [
    ("tpu_vm.sh", ["--name=r5", "--zone=europe-west4-a", "delete"], "gcloud"),
    ("slurm.sh", ["--", "train"], "sbatch"),
  ],
)
def test_refuses_to_run_without_the_tool(script, argv, tool, tmp_path):
  empty = tmp_path / "bin"
  empty.mkdir()  # PATH with nothing on it: no gcloud/sbatch can be reached
  res = launch(script, *argv, cwd=tmp_path, env={"PATH": str(empty)})
  assert res.returncode == 127 and f"{tool} not found" in res.stderr
  assert list(tmp_path.iterdir()) == [empty]


# --- local -----------------------------------------------------------------------------------------------
def test_local_dry_run_accepts_the_separator_and_keeps_quoting():
  res = launch("local.sh", "--dry-run", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  printed = shlex.split(res.stdout)
  assert printed[0].endswith("/.venv/bin/remixer-t5") and printed[1:] == ARGS


@pytest.mark.parametrize("accelerator,joins", [("v3-8", False), ("v3-32", True)])
def test_multi_host_slices_join_one_jax_runtime(accelerator, joins):
  out = subprocess.run(
    [
      "bash",
      str(LAUNCH / "tpu_vm.sh"),
      "--name=x",
      "--zone=z",
      f"--accelerator={accelerator}",
      "--dry-run",
      "run",
      "--",
      "train",
      "--gin.MODEL_DIR='gs://b/r'",
    ],
    capture_output=True,
    text=True,
    timeout=60,
    env={"PATH": os.environ["PATH"]},
  )
  assert out.returncode == 0, out.stderr
  assert ("REMIXER_T5_DISTRIBUTED=auto" in out.stdout) == joins
