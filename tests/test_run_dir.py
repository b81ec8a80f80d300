"""MODEL_DIR holds one run, whole: a launch of another run is refused before anything in the folder changes
(another mixer, a mixer's setting, another training file, its content, the batch or the seed), while the
settings meant to change on resume are accepted; one writer at a time (the lock: a live holder refuses a second
`train`, a dead one is taken over, a lost lock stops the run); names a bucket cannot hold are refused; a failed
background save stops the run within steps; the history says which rows a resume supersedes."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_util import xla_flags

from remixer_t5 import cli, storage
from remixer_t5.training import checkpoints, metrics_log, run_identity, run_lock

SIZES = [
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
  "--gin.EVAL_PERIOD=0",
  "--gin.network.T5Config.emb_dim=32",
  "--gin.network.T5Config.mlp_dim=48",
  "--gin.network.T5Config.num_encoder_layers=1",
  "--gin.network.T5Config.num_decoder_layers=1",
]


def _train(model_dir, steps, *extra, model="t5_1_1", period=2, log=1):
  return [
    "train",
    f"--gin_file=models/{model}/tiny.gin",
    "--gin_file=runs/demo.gin",
    *SIZES,
    f"--gin.MODEL_DIR='{model_dir}'",
    f"--gin.TRAIN_STEPS={steps}",
    f"--gin.CHECKPOINT_PERIOD={period}",
    f"--gin.LOG_PERIOD={log}",
    *extra,
  ]


def _snapshot(root: Path) -> dict[str, str]:
  """Every file under `root` with a digest of its bytes."""
  return {
    str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()
  }


def _train_steps(model_dir):
  path = Path(model_dir) / "metrics.jsonl"
  return [r["step"] for r in metrics_log.read_rows(path) if r["split"] == "train"] if path.exists() else []


@pytest.fixture
def cache(embedded_cache, monkeypatch):
  monkeypatch.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  return embedded_cache


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory, embedded_cache):
  """A tiny T5.1.1 run trained 4 steps (checkpoints at 2 and 4)."""
  root = tmp_path_factory.mktemp("t5") / "run"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
    assert cli.main(_train(root, 4)) == 0
  return root


REFUSED = [  # (launch's change, a word of the refusal naming the setting)
  ({"model": "remixer"}, "RemixerBlock"),
  ({"extra": ["--gin.network.T5Config.num_heads=2"]}, "config.num_heads"),
  ({"extra": ["--gin.BATCH_SIZE=4"]}, "batch_size"),
  ({"extra": ["--gin.RANDOM_SEED=7"]}, "random_seed"),
]


def test_another_run_is_refused_and_the_folder_is_left_byte_identical(t5_run, cache, capfd):
  before = _snapshot(t5_run)
  for change, word in REFUSED:
    extra = change.get("extra", [])
    if change.get("model"):
      extra = [*extra, "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}"]
    code = cli.main(_train(t5_run, 6, *extra, model=change.get("model", "t5_1_1")))
    err = capfd.readouterr().err
    assert code == 2, (change, err[-2000:])
    assert "holds another run" in err and word in err, (change, err[-2000:])
    assert "Traceback" not in err and "moving it aside" not in err
    assert _snapshot(t5_run) == before, change  # nothing written, renamed or moved aside
  assert not list((t5_run / "checkpoints").glob("*.corrupt-*"))
  capfd.readouterr()
  assert cli.main(_train(t5_run, 6)) == 0  # the run itself still resumes
  assert f"resumed from {t5_run / 'checkpoints'}/4" in capfd.readouterr().out


def test_resumable_settings_may_change_and_the_same_run_resumes(tmp_path, cache, capsys):
  run = tmp_path / "run"
  assert cli.main(_train(run, 2)) == 0
  signature = (run / run_identity.SIGNATURE_FILE).read_text()
  capsys.readouterr()
  changed = [
    "--gin.network.T5Config.dropout_rate=0.1",
    "--gin.network.T5Config.dtype='bfloat16'",
    "--gin.network.T5Config.remat_policy='full'",
    "--gin.run_config.Training.num_microbatches=2",
    "--gin.run_config.Schedule.keep_checkpoints=1",
  ]
  assert cli.main(_train(run, 4, *changed, period=1, log=2)) == 0
  out = capsys.readouterr().out
  assert f"resumed from {run / 'checkpoints'}/2" in out
  assert (run / run_identity.SIGNATURE_FILE).read_text() == signature
  assert checkpoints.Checkpointer(run).all_steps() == [4]


def test_a_remixer_setting_without_parameters_is_part_of_the_identity(tmp_path, cache, capfd):
  run = tmp_path / "run"
  assert cli.main(_train(run, 2, model="remixer")) == 0
  capfd.readouterr()
  before = _snapshot(run)
  code = cli.main(_train(run, 4, "--gin.remixer.RemixerBlock.compositional=False", model="remixer"))
  err = capfd.readouterr().err
  assert code == 2 and "compositional=True" in err and "compositional=False" in err, err[-2000:]
  assert _snapshot(run) == before


def test_another_train_file_or_its_content_is_refused(tmp_path, cache, capfd):
  rows = [(f"say {w}", f"{w} {w}") for w in "one two three four five six seven eight".split()]
  write = lambda path, pairs: (path.write_text("".join(f"{i}\t{t}\n" for i, t in pairs)), path)[1]
  train_a, train_b = write(tmp_path / "a.tsv", rows), write(tmp_path / "b.tsv", rows[::-1])
  dev = write(tmp_path / "dev.tsv", rows[:2])
  run = tmp_path / "run"
  files = lambda train: [f"--train_file={train}", f"--validation_file={dev}"]
  assert cli.main(_train(run, 2, *files(train_a))) == 0
  before = _snapshot(run)
  # In fresh processes: this one's task registry holds 'custom' over a.tsv already.
  other = subprocess.run(
    [sys.executable, "-m", "remixer_t5", *_train(run, 4, *files(train_b))],
    env=_child_env(cache),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert other.returncode == 2 and "holds another run" in other.stderr, other.stderr[-2000:]
  assert "train_files at" in other.stderr and "b.tsv" in other.stderr
  write(train_a, rows + [("say nine", "nine nine")])  # the same name, other content
  edited = subprocess.run(
    [sys.executable, "-m", "remixer_t5", *_train(run, 4, *files(train_a))],
    env=_child_env(cache),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert edited.returncode == 2 and f"train_files at {train_a}: sha256:" in edited.stderr, edited.stderr[-2000:]
  assert _snapshot(run) == before


def _spawn(args, env):
  return subprocess.Popen(
    [sys.executable, "-m", "remixer_t5", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )


def _child_env(embedded_cache, **extra):
  return dict(
    os.environ, REMIXER_T5_CACHE_DIR=str(embedded_cache.root), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(), **extra
  )


def test_a_second_writer_is_refused_and_the_first_logs_each_step_once(tmp_path, cache, capfd):
  run = tmp_path / "run"
  first = _spawn(_train(run, 10**6, period=10**6), _child_env(cache))  # runs until told to stop
  deadline = time.time() + 180
  while first.poll() is None and not _train_steps(run) and time.time() < deadline:
    time.sleep(0.05)
  assert first.poll() is None, first.communicate()[0][-2000:]
  holder = json.loads((run / run_lock.LOCK_FILE).read_text())
  assert holder["pid"] == first.pid
  capfd.readouterr()
  assert cli.main(_train(run, 10**6, period=10**6)) == 2
  err = capfd.readouterr().err
  assert f"MODEL_DIR {run} is in use by process {first.pid} on " in err and "Traceback" not in err, err
  first.send_signal(signal.SIGTERM)
  out, _ = first.communicate(timeout=300)
  assert first.returncode == 0, out[-2000:]
  saved = checkpoints.Checkpointer(run).latest_step()
  assert saved and _train_steps(run) == list(range(1, saved + 1))
  assert not (run / run_lock.LOCK_FILE).exists()


def test_stale_locks_are_taken_over_and_live_ones_kept(tmp_path, monkeypatch):
  run = tmp_path / "run"
  run.mkdir()
  lock_path = run / run_lock.LOCK_FILE
  # Another host's lock, renewed long ago: its lease ran out.
  lock_path.write_text(
    json.dumps(
      {"host": "elsewhere", "pid": 1, "since": 0, "renewed": time.time() - 600, "lease_s": 120, "token": "old"}
    )
  )
  lock = run_lock.RunLock(run, lease_s=60).acquire()
  assert json.loads(lock_path.read_text())["token"] == lock.token
  # A second RunLock in this (live) process is refused, naming the holder.
  with pytest.raises(run_lock.RunLockedError, match=rf"in use by process {os.getpid()} on .* \(since "):
    run_lock.RunLock(run, lease_s=60).acquire()
  # Someone replaces the lock: the holder notices at its next renewal and stops.
  lock_path.write_text(
    json.dumps({"host": "elsewhere", "pid": 2, "since": 0, "renewed": time.time(), "lease_s": 120, "token": "thief"})
  )
  lock.renew()
  with pytest.raises(run_lock.RunLockLostError, match="taken by process 2 on elsewhere"):
    lock.check()
  lock.release()
  assert json.loads(lock_path.read_text())["token"] == "thief"  # not ours to remove
  # Another host's lock renewed recently is kept.
  with pytest.raises(run_lock.RunLockedError, match="process 2 on elsewhere"):
    run_lock.RunLock(run, lease_s=60).acquire()
  # A dead process on this host: taken over at once, whatever its lease.
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  lock_path.write_text(json.dumps({**json.loads(lock_path.read_text()), "host": os.uname().nodename, "pid": dead.pid}))
  taken = run_lock.RunLock(run, lease_s=60).acquire()
  taken.release()
  assert not lock_path.exists()


def test_lock_lease_must_be_positive(monkeypatch):
  monkeypatch.setenv(run_lock.LEASE_ENV, "soon")
  with pytest.raises(ValueError, match=r"REMIXER_T5_LOCK_LEASE='soon': expected a positive number of seconds"):
    run_lock.lease_seconds()


@pytest.mark.parametrize(
  "path, word",
  [
    ("gs://bucket/q?dir/run", "'?'"),
    ("gs://bucket/r#x/run", "'#'"),
    ("gs://bucket/runs[1]/a", "'['"),
    ("gs://Bad_Bucket!/run", "not a valid bucket name"),
    ("gs://ab/run", "not a valid bucket name"),
    ("gs://my-google-bucket/run", "google"),
    ("gs://bucket/a/../run", "'..'"),
  ],
)
def test_names_a_bucket_cannot_hold_are_refused(path, word):
  with pytest.raises(storage.BadPathError, match=word.replace("[", r"\[").replace("?", r"\?")):
    storage.check_names(path)


def test_valid_bucket_names_pass():
  for path in ("gs://bucket/run", "gs://my_bucket.example.com/a-b/c_d.e/run", "gs://b12/x"):
    storage.check_names(path)


def test_a_wait_on_storage_is_bounded(tmp_path):
  with pytest.raises(storage.StorageTimeout, match=r"the slow save did not finish within 0s"):
    storage.bounded(lambda: time.sleep(5), "the slow save", timeout=0.2)
  storage.ABANDONED = False
  assert storage.bounded(lambda: 3, "a quick one", timeout=5) == 3
  with pytest.raises(KeyError):  # the function's own error, unchanged
    storage.bounded(lambda: {}["x"], "a failing one", timeout=5)


def test_current_rows_follow_the_start_rows():
  rows = [
    {"split": "start", "step": 0},
    *({"split": "train", "step": s, "a": 1} for s in (1, 2, 3, 4)),
    {"split": "start", "step": 2},
    *({"split": "train", "step": s, "a": 2} for s in (3,)),
    {"split": "start", "step": 2},
    *({"split": "train", "step": s, "a": 3} for s in (3, 4, 5)),
  ]
  current = metrics_log.current_rows(rows)
  assert [(r["step"], r["a"]) for r in current] == [(1, 1), (2, 1), (3, 3), (4, 3), (5, 3)]


def _mount_tmpfs(path: Path, size: str) -> bool:
  path.mkdir(parents=True, exist_ok=True)
  return (
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode
    == 0
  )


def test_a_full_disk_stops_the_run_at_the_failed_save_naming_the_lack_of_space(tmp_path, cache):
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, "24m"):
    pytest.skip("needs root to mount a small tmpfs (a disk that fills up)")
  try:
    run = disk / "run"
    proc = _spawn(_train(run, 150, period=50, log=10), _child_env(cache))
    deadline = time.time() + 300
    while proc.poll() is None and not (run / "checkpoints" / "50").is_dir() and time.time() < deadline:
      time.sleep(0.002)
    # The step-50 checkpoint is whole: hold the run while the disk fills but for a little room (the rows and
    # the input position still fit; the step-100 checkpoint's arrays, written in orbax's background, do not).
    proc.send_signal(signal.SIGSTOP)
    try:
      assert max(_train_steps(run), default=0) < 100
      free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
      size = lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
      room = size(run / checkpoints.INPUT_STATE_DIR / "50") + size(run / "checkpoints" / "50") // 2
      (disk / "filler").write_bytes(b"\0" * max(free - room, 0))
    finally:
      proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    steps = _train_steps(run)
    assert steps and max(steps) < 121, steps
    tail = [line for line in out.strip().splitlines() if line.strip()][-3:]
    assert any("no space left on the device" in line for line in tail), out[-3000:]
    assert "checkpoints/100 could not be written: " in out, out[-3000:]  # orbax's background save, not the position
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)
