"""Runs that live in a bucket, against a real GCS server (fake-gcs-server, in memory, on a loopback port):
train into gs://, resume from it (also after kill -9 mid-save), read it back with eval, plot, compare, info and
export-hf, finetune from a gs:// INIT_CHECKPOINT, and the one-line errors of a bucket that cannot be used. No
command may create a local folder named `gs:` (what pathlib made of gs:// paths)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from gcs_server import GCSServer, free_port
from subprocess_util import REPO, xla_flags

from remixer_t5 import cli, storage
from remixer_t5.training import checkpoints

RUN = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/demo.gin",
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
  "--gin.LOG_PERIOD=1",
  "--gin.EVAL_PERIOD=0",
  "--gin.network.T5Config.emb_dim=32",
  "--gin.network.T5Config.mlp_dim=48",
  "--gin.network.T5Config.num_encoder_layers=1",
  "--gin.network.T5Config.num_decoder_layers=1",
]


def _train(model_dir, steps, period, *extra):
  return [
    "train",
    *RUN,
    f"--gin.MODEL_DIR='{model_dir}'",
    f"--gin.TRAIN_STEPS={steps}",
    f"--gin.CHECKPOINT_PERIOD={period}",
    *extra,
  ]


def _rows(model_dir):
  return [
    json.loads(line)
    for line in storage.run_path(model_dir).joinpath("metrics.jsonl").read_text().splitlines()
    if line.strip()
  ]


def _losses(model_dir):
  return {r["step"]: r["loss"] for r in _rows(model_dir) if r["split"] == "train"}


def _assert_same(a, b):
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def _no_local_gs(*roots):
  for root in roots:
    found = [str(p) for p in Path(root).rglob("gs:*")]
    assert not found, f"local folders named like a bucket: {found}"


@pytest.fixture(scope="module")
def gcs(embedded_cache):
  """The server, a bucket, and this process's clients pointed at it (subprocesses get `env`)."""
  server = GCSServer()
  server.create_bucket("bucket")
  mp = pytest.MonkeyPatch()
  for k, v in server.env.items():
    mp.setenv(k, v)
  mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  import gcsfs

  gcsfs.GCSFileSystem.clear_instance_cache()  # an instance made before would keep its endpoint
  server.child_env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
  yield server
  mp.undo()
  gcsfs.GCSFileSystem.clear_instance_cache()
  server.stop()


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, gcs):
  """The same run in a local folder, uninterrupted: 8 steps, checkpoints at 4 and 8."""
  root = tmp_path_factory.mktemp("local") / "run"
  assert cli.main(_train(root, 8, 4)) == 0
  return root


@pytest.fixture(scope="module")
def bucket_run(gcs, local_reference):
  """gs://bucket/run trained to step 4, then resumed to step 8 by a second `train`."""
  run = "gs://bucket/run"
  assert cli.main(_train(run, 4, 2)) == 0
  assert cli.main(_train(run, 8, 4)) == 0
  return run


def test_train_into_a_bucket_resumes_from_it_exactly(gcs, bucket_run, local_reference, capsys, tmp_path):
  names = set(gcs.objects("bucket", "run/"))
  for step in (4, 8):
    assert f"run/checkpoints/{step}/commit_success.txt" in names  # orbax's marker: the step is finalised
    assert f"run/input_state/{step}/process-00000-of-00001/iterator.index" in names
  assert {"run/metrics.jsonl", "run/config.gin", "run/run_signature.json", "run/metrics.png"} <= names
  assert any(n.startswith("run/tensorboard/train/events.out.tfevents") for n in names)
  assert checkpoints.Checkpointer(bucket_run).all_steps()[-1] == 8
  # Steps 5-8 came from the bucket's step-4 checkpoint and input state: the same losses and parameters as the
  # uninterrupted local run.
  assert _losses(bucket_run) == _losses(local_reference)
  _assert_same(checkpoints.restore_any_params(bucket_run), checkpoints.restore_any_params(local_reference))
  # A rerun of a finished run says where it resumed from.
  capsys.readouterr()
  assert cli.main(_train(bucket_run, 8, 4)) == 0
  out = capsys.readouterr().out
  assert "resumed from gs://bucket/run/checkpoints/8" in out
  _no_local_gs(REPO, Path.cwd())


def test_eval_plot_compare_info_and_export_read_a_run_in_the_bucket(gcs, bucket_run, local_reference, tmp_path, capsys):
  assert cli.main(["eval", *RUN, f"--gin.MODEL_DIR='{bucket_run}'", "--gin.EVAL_STEPS=1"]) == 0
  assert [r["step"] for r in _rows(bucket_run) if r["split"] == "validation"][-1] == 8
  # plot: curves of the run, and mixing matrices from its checkpoint into the bucket
  assert cli.main(["plot", bucket_run, "--out", f"{bucket_run}/plots", "--length", "6"]) == 0
  assert any(n.startswith("run/plots/") and n.endswith(".png") for n in gcs.objects("bucket", "run/plots/"))
  # compare: a bucket run beside a local one, the output in the bucket
  capsys.readouterr()
  assert (
    cli.main(["compare", bucket_run, str(local_reference), "--names", "bucket,local", "--out", "gs://bucket/compare"])
    == 0
  )
  table = capsys.readouterr().out
  assert "| bucket |" in table and "| local |" in table
  assert {"compare/compare.png", "compare/compare.md", "compare/compare.csv"} <= set(gcs.objects("bucket", "compare/"))
  # info on the run's own config
  assert cli.main(["info", f"--gin_file={bucket_run}/config.gin"]) == 0
  assert "198,112" in capsys.readouterr().out
  # export-hf reads the run's latest step and its config.gin from the bucket
  out = tmp_path / "hf"
  assert cli.main(["export-hf", bucket_run, str(out)]) == 0
  assert (out / "config.json").is_file()
  # import-hf writes its output into the bucket: the same parameters back, and a model.gin gin can read there
  assert cli.main(["import-hf", str(out), "gs://bucket/imported"]) == 0
  assert {"imported/model.gin", "imported/checkpoint/commit_success.txt"} <= set(gcs.objects("bucket", "imported/"))
  _assert_same(checkpoints.restore_any_params("gs://bucket/imported"), checkpoints.restore_any_params(bucket_run))
  assert cli.main(["info", "--gin_file=gs://bucket/imported/model.gin"]) == 0
  assert cli.main(["import-hf", str(out), "gs://bucket/imported"]) == 2  # not onto a non-empty output
  assert "not empty" in capsys.readouterr().err
  storage.run_path("gs://bucket/imported/model.gin").unlink()  # as a kill before the last write leaves it
  assert cli.main(["import-hf", str(out), "gs://bucket/imported"]) == 2
  assert "an unfinished import: no model.gin; delete it" in capsys.readouterr().err
  _no_local_gs(REPO, Path.cwd(), tmp_path)


# orbax leaves the reads of the corrupt step's other arrays as coroutines never awaited once one read fails.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_latest_checkpoint_in_the_bucket_is_moved_aside(gcs, bucket_run, local_reference, capsys):
  """A bucket has no folder rename: the unreadable step's objects are copied aside, then deleted, and the run
  resumes from the previous step to the uninterrupted run's parameters."""
  run = "gs://bucket/corrupt"
  storage._copy_tree(storage.run_path(bucket_run), storage.run_path(run))
  assert checkpoints.Checkpointer(run).all_steps() == [2, 4, 8]
  for p in storage._files(storage.run_path(f"{run}/checkpoints/8/state")):
    if "ocdbt.process_0/d/" in p.as_posix():
      p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
  capsys.readouterr()
  assert cli.main(_train(run, 8, 4)) == 0
  out = capsys.readouterr().out
  assert f"checkpoint {run}/checkpoints/8 cannot be restored" in out
  assert f"resumed from {run}/checkpoints/4" in out
  names = gcs.objects("bucket", "corrupt/checkpoints/")
  assert any(n.startswith("corrupt/checkpoints/8.corrupt-0/state/") for n in names)
  _assert_same(checkpoints.restore_any_params(run), checkpoints.restore_any_params(local_reference))
  import gc

  gc.collect()  # the abandoned reads' warnings are raised here, where they are filtered, not in a later test


def test_finetune_from_a_bucket_init_checkpoint(gcs, bucket_run, capsys):
  capsys.readouterr()
  init = f"--gin.run_config.Training.init_checkpoint='{bucket_run}'"
  assert cli.main(_train("gs://bucket/finetune", 2, 2, init)) == 0
  assert f"initialised params from {bucket_run}" in capsys.readouterr().out
  assert "finetune/checkpoints/2/commit_success.txt" in gcs.objects("bucket", "finetune/")


def test_kill_9_mid_save_in_a_bucket_then_resume_matches_uninterrupted(gcs, local_reference, capsys):
  """Killed while orbax writes a step into the bucket (its objects there, its commit marker not yet), the run
  resumes from the previous finalised step and ends with the uninterrupted run's losses and parameters."""
  run = "gs://bucket/killed"
  proc = subprocess.Popen(
    [sys.executable, "-m", "remixer_t5", *_train(run, 8, 1)],
    env=gcs.child_env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=REPO,
  )
  deadline, killed_at = time.time() + 240, None
  while proc.poll() is None and time.time() < deadline:
    names = gcs.objects("bucket", "killed/checkpoints/")
    steps = {n.split("/")[2] for n in names}
    in_flight = [s for s in steps if f"killed/checkpoints/{s}/commit_success.txt" not in names]
    if in_flight and len(steps) >= 3:
      proc.send_signal(signal.SIGKILL)
      killed_at = in_flight
      break
    time.sleep(0.005)
  proc.wait(timeout=60)
  assert killed_at is not None, "never caught a save in flight"
  capsys.readouterr()
  assert cli.main(_train(run, 8, 1)) == 0
  out = capsys.readouterr().out
  assert "resumed from gs://bucket/killed/checkpoints/" in out and "input position restored from" in out
  assert _losses(run) == _losses(local_reference)
  _assert_same(checkpoints.restore_any_params(run), checkpoints.restore_any_params(local_reference))


def test_a_missing_bucket_is_one_line_before_any_compile(gcs, capfd):
  code = cli.main(_train("gs://no-such-bucket/run", 2, 2))
  err = capfd.readouterr().err
  assert code == 4  # storage (docs/cli.md, exit codes)
  assert "gs://no-such-bucket" in err and "does not exist" in err and "Traceback" not in err
  assert "no-such-bucket" not in "".join(gcs.objects("bucket"))


def test_a_server_that_does_not_answer_is_one_line(gcs, monkeypatch, capfd):
  import gcsfs

  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
  gcsfs.GCSFileSystem.clear_instance_cache()
  try:
    code = cli.main(_train("gs://bucket/unreachable", 2, 2))
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()
  err = capfd.readouterr().err
  assert code == 4 and "did not answer" in err and "gs://bucket/unreachable" in err and "Traceback" not in err


def test_missing_credentials_name_the_bucket_and_the_fix(gcs, monkeypatch):
  """The emulator accepts any token, so the client's refusal is what Cloud Storage's client raises without
  credentials."""
  import gcsfs
  import google.auth.exceptions

  def refuse(self, path, **kwargs):
    raise google.auth.exceptions.DefaultCredentialsError("Your default credentials were not found.")

  monkeypatch.setattr(gcsfs.GCSFileSystem, "info", refuse)
  with pytest.raises(storage.StorageError, match=r"MODEL_DIR gs://bkt/run: no usable credentials.*application-default"):
    storage.check_bucket("gs://bkt/run")


def test_another_models_run_in_the_bucket_is_refused(gcs, bucket_run, capfd):
  code = cli.main(_train(bucket_run, 9, 9, "--gin.network.T5Config.emb_dim=48"))
  err = capfd.readouterr().err
  assert code == 2 and f"MODEL_DIR {bucket_run} holds another run" in err
  assert "config.emb_dim: 32 -> 48" in err


def test_a_second_writer_in_the_bucket_is_refused_and_the_first_logs_each_step_once(gcs, capfd):
  run = "gs://bucket/locked"
  first = subprocess.Popen(
    [sys.executable, "-m", "remixer_t5", *_train(run, 10**6, 10**6)],
    env=gcs.child_env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )  # runs until told to stop
  deadline = time.time() + 240
  while (
    first.poll() is None and "locked/metrics.jsonl" not in gcs.objects("bucket", "locked/") and (time.time() < deadline)
  ):
    time.sleep(0.2)
  assert first.poll() is None and "locked/LOCK" in gcs.objects("bucket", "locked/")
  capfd.readouterr()
  assert cli.main(_train(run, 10**6, 10**6)) == 2
  err = capfd.readouterr().err
  assert f"MODEL_DIR {run} is in use by process {first.pid} on " in err and "Traceback" not in err
  first.send_signal(signal.SIGTERM)
  out, _ = first.communicate(timeout=400)
  assert first.returncode == 0, out[-3000:]
  saved = checkpoints.Checkpointer(run).latest_step()
  assert saved and [r["step"] for r in _rows(run) if r["split"] == "train"] == list(range(1, saved + 1))
  assert "locked/LOCK" not in gcs.objects("bucket", "locked/")


@pytest.mark.parametrize("name", ["q?dir", "r#x"])
def test_object_names_that_urls_cut_are_refused_before_anything_is_written(gcs, capfd, name):
  before = set(gcs.objects("bucket"))
  code = cli.main(_train(f"gs://bucket/{name}/run", 2, 2))
  err = capfd.readouterr().err
  assert code == 2 and f"holds {name[1]!r}" in err and "Traceback" not in err, err[-2000:]
  assert set(gcs.objects("bucket")) == before


def test_a_dead_array_endpoint_fails_before_training_in_one_line(gcs, monkeypatch, capfd):
  """gcsfs reaches the bucket, tensorstore (the checkpoint arrays' client) does not: the start-up probe of each
  client refuses the run before it trains, instead of a save that never ends."""
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{free_port()}")
  monkeypatch.setenv("REMIXER_T5_STORAGE_TIMEOUT", "15")
  t0 = time.time()
  code = cli.main(_train("gs://bucket/dead-arrays", 2, 2))
  elapsed = time.time() - t0
  err = capfd.readouterr().err
  assert code == 4 and "tensorstore" in err and "Traceback" not in err, err[-2000:]
  assert elapsed < 90, elapsed
  assert "dead-arrays/checkpoints" not in " ".join(gcs.objects("bucket", "dead-arrays/"))
  assert "dead-arrays/LOCK" not in gcs.objects("bucket", "dead-arrays/")


def _own_files(root, upload):
  """A task's own files: two TSV shards with a header (train) and a gzipped JSONL (validation), written under
  `root` by `upload(name, bytes)`; returns the train glob and the validation file."""
  import gzip

  rows = [(f"say {w} twice", f"{w} {w}") for w in "one two three four five six seven eight nine ten".split()]
  for shard in range(2):
    lines = ["targets\tinputs"] + [f"{t}\t{i}" for i, t in rows[shard::2]]
    upload(f"train-{shard}.tsv", "".join(line + "\n" for line in lines).encode())
  upload(
    "dev.jsonl.gz", gzip.compress("".join(json.dumps({"inputs": i, "targets": t}) + "\n" for i, t in rows[:3]).encode())
  )
  return f"{root}/train-*.tsv", f"{root}/dev.jsonl.gz"


def test_your_own_files_in_a_bucket_read_and_resume_as_local_ones(gcs, tmp_path):
  """Own files in gs:// (a glob of TSV shards, a gzipped JSONL): listed, checked and read through the emulator to
  the batches the same files give locally, and an input position restored after the local copies are gone (a new
  process's view). The trainer saves and restores this iterator as here (tests/test_input_resume.py)."""
  import seqio

  from remixer_t5.data import input_pipeline
  from remixer_t5.tasks import custom

  local_dir = tmp_path / "own"
  local_dir.mkdir()
  local = _own_files(local_dir, lambda name, data: (local_dir / name).write_bytes(data))
  bucket = _own_files("gs://bucket/own", lambda name, data: storage.write_bytes(f"gs://bucket/own/{name}", data))
  lengths = {"inputs": 16, "targets": 8}
  try:
    for name, (train, validation) in (("own_local", local), ("own_bucket", bucket)):
      custom.register(name, train=train, validation=validation)
    batches = lambda name: input_pipeline.get_batches(
      seqio.get_mixture_or_task(name), lengths, "train", 2, seed=0, shuffle=True, repeat=True, pack=False
    )
    want = [next(it) for it in [batches("own_local")] for _ in range(8)]
    read = batches("own_bucket")
    got = [next(read) for _ in range(3)]
    prefix = read.save(str(tmp_path / "input" / "iterator"))
    storage._LOCAL_COPIES.clear()
    resumed = batches("own_bucket")
    resumed.restore(prefix, 3)
    got += [next(resumed) for _ in range(5)]
    _assert_same(got, want)
    examples = lambda name: list(
      seqio.get_mixture_or_task(name)
      .get_dataset(lengths, split="validation", shuffle=False, use_cached=False)
      .as_numpy_iterator()
    )
    assert len(examples("own_bucket")) == 3
    _assert_same(examples("own_bucket"), examples("own_local"))
  finally:
    for name in ("own_local", "own_bucket"):
      seqio.TaskRegistry.remove(name)
      custom._registered.pop(name, None)
  _no_local_gs(REPO, Path.cwd(), tmp_path)


@pytest.mark.parametrize(
  "bad, why",
  [
    ("gs:/bucket/run", "expected gs://bucket/path"),
    ("s3://bucket/run", "unsupported storage scheme 's3'"),
    ("gs:///run", "expected gs://bucket/path"),
  ],
)
def test_malformed_bucket_paths_are_refused(bad, why):
  with pytest.raises(ValueError, match=why):
    storage.run_path(bad)


def test_local_paths_stay_local_and_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(storage.run_path("runs/a")) == str(tmp_path / "runs" / "a")
  assert str(storage.run_path("~/x")) == str(Path.home() / "x")
  assert str(storage.run_path("gs://b/run/")) == "gs://b/run"


def _two_processes(env, args):
  port, procs = free_port(), []
  for pid in range(2):
    penv = dict(
      env, REMIXER_T5_COORDINATOR=f"127.0.0.1:{port}", REMIXER_T5_NUM_PROCESSES="2", REMIXER_T5_PROCESS_ID=str(pid)
    )
    procs.append(
      subprocess.Popen(
        [sys.executable, "-m", "remixer_t5", *args],
        env=penv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  outs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs


def test_two_processes_train_and_resume_one_run_in_the_bucket(gcs):
  """The multi-host path on CPU collectives: both processes save collectively into the bucket, each its own
  input state. The last step is then removed and a second launch redoes it from step 4, each process from its
  own saved input position: the same losses and parameters, bitwise."""
  run = "gs://bucket/two"
  _two_processes(gcs.child_env, _train(run, 6, 2))
  names = set(gcs.objects("bucket", "two/"))
  for step in (2, 4, 6):
    assert f"two/checkpoints/{step}/commit_success.txt" in names
  for pid in range(2):
    assert f"two/input_state/6/process-{pid:05d}-of-00002/iterator.index" in names
  first, params = _losses(run), checkpoints.restore_any_params(run)
  assert sorted(first) == [1, 2, 3, 4, 5, 6]
  assert "two/LOCK" not in names  # process 0 held the run's one lock and released it
  storage.remove_tree(f"{run}/checkpoints/6")
  outs = _two_processes(gcs.child_env, _train(run, 6, 2))
  for pid, out in enumerate(outs):
    assert f"input position restored from {run}/input_state/4/process-{pid:05d}-of-00002/iterator" in out, out[-2000:]
  redone = [r for r in _rows(run) if r["split"] == "train"][6:]
  assert [(r["step"], r["loss"]) for r in redone] == [(5, first[5]), (6, first[6])]
  _assert_same(checkpoints.restore_any_params(run), params)


def test_an_array_endpoint_that_dies_mid_run_stops_it_within_the_storage_timeout(gcs):
  """The checkpoint arrays' client (tensorstore) on a server of its own that stops after the first save: the
  next save cannot finish, and the run ends within $REMIXER_T5_STORAGE_TIMEOUT in one line, with exit code 4,
  instead of waiting for ever (the process does not wait for the blocked client's threads either)."""
  arrays = GCSServer()
  try:
    arrays.create_bucket("bucket")
    env = dict(gcs.child_env, TENSORSTORE_GCS_HTTP_URL=arrays.url, REMIXER_T5_STORAGE_TIMEOUT="15")
    proc = subprocess.Popen(
      [sys.executable, "-m", "remixer_t5", *_train("gs://bucket/outage", 100000, 20), "--gin.LOG_PERIOD=20"],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    deadline = time.time() + 240
    while (
      proc.poll() is None
      and "outage/checkpoints/20/commit_success.txt" not in gcs.objects("bucket", "outage/")
      and time.time() < deadline
    ):
      time.sleep(0.1)
    arrays.stop()
    stopped = time.time()
    out, _ = proc.communicate(timeout=240)
    elapsed = time.time() - stopped
  finally:
    arrays.stop()
  assert proc.returncode == 4, out[-3000:]
  assert elapsed < 90, elapsed
  last = out.strip().splitlines()[-1]
  assert last.startswith("remixer-t5: error: ") and "gs://bucket/outage/checkpoints/" in last, out[-3000:]
  assert "Traceback" not in out


def test_a_data_dir_in_the_bucket_is_read_as_the_same_files_locally(gcs, tmp_path):
  """DATA_DIR=gs://...: a dataset's release files in the bucket (ANLI round 1 here) are found, listed and read to
  the examples the same files give in a local DATA_DIR; a dataset missing from the bucket still comes from TFDS, as
  from a local folder; a bucket that does not exist is one StorageError naming DATA_DIR; another URL scheme is a
  ValueError, never a local folder that does not exist."""
  from remixer_t5.tasks import nli, sources

  rows = [
    {
      "uid": f"r1-{i}",
      "context": f"Context {i}.",
      "hypothesis": f"Hypothesis {i}.",
      "label": "enc"[i % 3],
      "model_label": "n",
      "emturk": False,
      "genre": "",
      "reason": "",
      "tag": "",
    }
    for i in range(5)
  ]
  for name in ("train", "dev", "test"):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "anli" / "R1").mkdir(parents=True, exist_ok=True)
    (tmp_path / "anli" / "R1" / f"{name}.jsonl").write_text(text)
    storage.write_text(f"gs://bucket/data/anli/R1/{name}.jsonl", text)
  source = nli.anli_source(1)

  def read(root):
    sources.set_data_dir(root)
    assert source.local_root() is not None
    return source.files("validation"), list(source.get_dataset("validation", shuffle=False).as_numpy_iterator())

  local_files, local_rows = read(str(tmp_path))
  bucket_files, bucket_rows = read("gs://bucket/data")
  assert bucket_files == ["gs://bucket/data/anli/R1/dev.jsonl"] and local_files == [str(tmp_path / "anli/R1/dev.jsonl")]
  assert len(bucket_rows) == 5 and bucket_rows[1]["label"] == 1
  _assert_same(bucket_rows, local_rows)
  sources.set_data_dir("gs://bucket/elsewhere")
  assert source.local_root() is None  # no anli/R1 there: TFDS's copy, as for a local folder without it
  sources.set_data_dir("gs://no-such-bucket/data")
  with pytest.raises(
    storage.StorageError,
    match=r"^DATA_DIR gs://no-such-bucket/data: bucket gs://no-such-bucket "
    r"does not exist",
  ):
    source.local_root()
  sources.set_data_dir("s3://bucket/data")
  with pytest.raises(ValueError, match="unsupported storage scheme 's3'"):
    source.local_root()
  _no_local_gs(REPO, Path.cwd(), tmp_path)


def test_a_bucket_lock_is_taken_over_once_its_lease_lapses_and_a_replaced_one_is_lost(gcs):
  """The bucket lock through GCS's generation preconditions: another host's lock within its lease refuses, past
  it is taken over; a holder whose lock object was replaced notices at its next renewal."""
  from remixer_t5.training import run_lock

  held = run_lock.RunLock("gs://bucket/leased", lease_s=60).acquire()
  data, generation = held.file.read()
  other = {**json.loads(data), "host": "elsewhere", "pid": 7, "token": "other", "renewed": time.time()}
  assert held.file.replace(json.dumps(other).encode(), generation)  # another host holds it now
  assert not held.file.replace(b"{}", generation)  # a stale generation is refused by the server
  held.renew()
  with pytest.raises(run_lock.RunLockLostError, match="taken by process 7 on elsewhere"):
    held.check()
  with pytest.raises(run_lock.RunLockedError, match="in use by process 7 on elsewhere"):
    run_lock.RunLock("gs://bucket/leased", lease_s=60).acquire()
  data, generation = held.file.read()
  assert held.file.replace(json.dumps({**other, "renewed": time.time() - 600}).encode(), generation)  # lapsed
  taken = run_lock.RunLock("gs://bucket/leased", lease_s=60).acquire()
  assert json.loads(taken.file.read()[0])["token"] == taken.token
  taken.release()
  assert "leased/LOCK" not in gcs.objects("bucket", "leased/")
