"""W&B tracking (remixer_t5/training/tracking.py): with a W&B project named, a run's metrics rows go to W&B row for
row with its gin settings as config, a relaunch continues the same W&B run, and a sweep's group is kept. Read
back from W&B's offline run files (`WANDB_MODE=offline`), whose framing the reader here checks byte for byte."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from remixer_t5 import cli
from remixer_t5.gin_utils import parse_gin
from remixer_t5.training import metrics_log, tracking

wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e '.[wandb]'")
from wandb.proto import wandb_internal_pb2  # noqa: E402 - after the skip: the record type of W&B's run files

# A .wandb file as wandb-core writes it (core/internal/transactionlog/writer.go: OpenWriter, and
# core/pkg/leveldb/record.go: NewWriterExt, Writer.fillHeader): the header ':W&B', magic 0xBEE1 (little-endian),
# version 0; then leveldb log framing in 32 KiB blocks, the header counted in the first: each chunk a 7-byte
# header (CRC-32 (IEEE, as zlib's, unmasked) of the type byte and the data, little-endian; the data's length, 2
# bytes little-endian; the type) and its data. A block's tail shorter than a header is zero padding.
BLOCK, CHUNK_HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
  """The wandb_internal_pb2.Record messages of a .wandb file, in order; an AssertionError naming the offset of
  a header, checksum or chunk sequence that is not W&B's."""
  data = path.read_bytes()
  assert data[:4] == b":W&B", f"{path}: starts with {data[:4]!r}, expected b':W&B'"
  magic, version = struct.unpack("<HB", data[4:7])
  assert (magic, version) == (0xBEE1, 0), f"{path}: magic {magic:#x} version {version}, expected 0xbee1 0"
  records, parts, pos = [], None, 7
  while pos + CHUNK_HEADER <= len(data):
    left = BLOCK - pos % BLOCK
    if left < CHUNK_HEADER:
      pos += left
      continue
    crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
    if (crc, length, kind) == (0, 0, 0):  # the rest of the block is zeroes
      pos += left
      continue
    chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
    assert len(chunk) == length and pos % BLOCK + CHUNK_HEADER + length <= BLOCK, (
      f"{path}: chunk at {pos} of length {length} runs past its block or the file"
    )
    assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: checksum mismatch at {pos}"
    assert (kind in (FULL, FIRST)) == (parts is None), f"{path}: chunk type {kind} at {pos} out of sequence"
    parts = [chunk] if kind in (FULL, FIRST) else parts + [chunk]
    if kind in (FULL, LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b"".join(parts))
      records.append(record)
      parts = None
    pos += CHUNK_HEADER + length
  assert parts is None and pos == len(data), f"{path}: ends in a record cut short at {pos} of {len(data)}"
  return records


def read_run(path: Path) -> dict:
  """One launch's W&B run file: its run record, history rows (key -> value, W&B's own `_` keys left out) and
  config (run record's, then config updates)."""
  run, history, config = None, [], {}
  for record in read_records(path):
    kind = record.WhichOneof("record_type")
    if kind == "run":
      run = record.run
      config.update({u.key: json.loads(u.value_json) for u in run.config.update})
    elif kind == "config":
      config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    elif kind == "history":
      row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
      history.append({k: v for k, v in row.items() if not k.startswith("_")})
  assert run is not None, f"{path}: no run record"
  return {"run": run, "history": history, "config": config}


def offline_runs(wandb_dir: Path) -> list[dict]:
  """Every launch's run file under WANDB_DIR, in the order the launches started."""
  files = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
  return sorted((read_run(f) for f in files), key=lambda r: (r["run"].start_time.seconds, r["run"].start_time.nanos))


def _train(root: Path, steps: int) -> None:
  assert (
    cli.main(
      [
        "train",
        "--gin_file=models/t5_1_1/tiny.gin",
        "--gin_file=runs/demo.gin",
        "--gin.BATCH_SIZE=2",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
        "--gin.network.T5Config.emb_dim=32",
        "--gin.network.T5Config.mlp_dim=48",
        "--gin.network.T5Config.num_encoder_layers=1",
        "--gin.network.T5Config.num_decoder_layers=1",
        f"--gin.MODEL_DIR='{root}'",
        f"--gin.TRAIN_STEPS={steps}",
        "--gin.LOG_PERIOD=2",
        "--gin.EVAL_PERIOD=4",
        "--gin.EVAL_STEPS=1",
        "--gin.CHECKPOINT_PERIOD=4",
      ]
    )
    == 0
  )


def _wandb_core_of(pid: int) -> list[str]:
  """The ids of the wandb-core processes that still serve process `pid` (wandb-core is started with --pid)."""
  if not Path("/proc/self/cmdline").exists():
    pytest.skip("no /proc to list processes in")
  found, served = [], str(pid).encode()
  for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
    try:
      args = cmdline.read_bytes().split(b"\0")
    except OSError:  # ended meanwhile
      continue
    if args[0].endswith(b"wandb-core") and any(a == b"--pid" and b == served for a, b in zip(args, args[1:])):
      found.append(cmdline.parent.name)
  return found


def _wait_for_no_wandb_core(pid: int, seconds: float = 10) -> list[str]:
  deadline = time.time() + seconds
  while (left := _wandb_core_of(pid)) and time.time() < deadline:
    time.sleep(0.2)
  return left


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, embedded_cache):
  """A run in a sweep's group: 6 steps (rows every 2, validation and checkpoints at 4 and 6), its step-6
  checkpoint then lost, and a relaunch to step 8 that resumes from step 4 and logs step 6 again."""
  base = tmp_path_factory.mktemp("tracking")
  root, wandb_dir = base / "run", base / "wandb_files"
  wandb_dir.mkdir()
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
    for name, value in {
      "WANDB_MODE": "offline",
      "WANDB_PROJECT": "test",
      "WANDB_DIR": str(wandb_dir),
      "WANDB_SILENT": "true",
      "WANDB_ERROR_REPORTING": "false",
      "WANDB_RUN_GROUP": "sweep-lr",
    }.items():
      mp.setenv(name, value)
    mp.delenv("WANDB_ENTITY", raising=False)
    _train(root, 6)
    shutil.rmtree(root / "checkpoints" / "6")
    time.sleep(1)  # W&B names a launch's folder by the second it started in
    _train(root, 8)
  assert wandb.run is None, "a W&B run was left open after train returned"
  wandb.teardown()  # the W&B service of this test process: it would otherwise outlive the module
  assert not _wait_for_no_wandb_core(os.getpid()), "wandb-core still runs after wandb.teardown()"
  return root, offline_runs(wandb_dir)


def _jsonl_rows(root: Path) -> list[dict]:
  """metrics.jsonl's rows as W&B should hold them: `<split>/<key>` values with `step` and `attempt`."""
  rows = []
  for r in metrics_log.read_rows(root / "metrics.jsonl"):
    if r["split"] == "start":
      continue
    values = {f"{r['split']}/{k}": v for k, v in r.items() if k not in ("step", "split", "time", "attempt", "examples")}
    rows.append({**values, "step": r["step"], "attempt": r["attempt"]})
  return rows


def test_the_wandb_history_is_metrics_jsonl_row_for_row(tracked_run):
  root, runs = tracked_run
  assert len(runs) == 2, f"{len(runs)} W&B run files, expected one per launch (2)"
  history = [row for run in runs for row in run["history"]]
  expected = _jsonl_rows(root)
  train = [r for r in expected if "train/loss" in r]
  assert [(r["step"], r["attempt"]) for r in train] == [(2, 1), (4, 1), (6, 1), (6, 2), (8, 2)]
  assert [r for r in history if "train/loss" in r] == train  # every key of every train row, step for step
  assert history == expected  # validation rows too, in the order they were written


def test_a_relaunch_continues_the_same_wandb_run_in_the_sweeps_group(tracked_run):
  root, runs = tracked_run
  run_id = (root / tracking.RUN_ID_FILE).read_text().strip()
  assert run_id, f"{root / tracking.RUN_ID_FILE} is empty; expected the W&B run id"
  for launch in runs:
    run = launch["run"]
    assert (run.run_id, run.project, run.run_group, run.display_name) == (run_id, "test", "sweep-lr", "run"), run


def test_the_wandb_config_is_the_runs_gin_bindings(tracked_run):
  root, runs = tracked_run
  first, last = runs[0]["config"], runs[-1]["config"]
  assert first["MODEL_DIR"] == str(root) and first["network.T5Config.emb_dim"] == 32
  assert first["TRAIN_STEPS"] == 6 and last["TRAIN_STEPS"] == 8  # the relaunch's own settings
  assert last["run_config.Training.model"] == "%MODEL" and last["MODEL"] == "@models.EncoderDecoderModel()"
  assert last["TASK_FEATURE_LENGTHS"] == "{'inputs': 16, 'targets': 8}"  # not a scalar: the value's text


def test_gin_bindings_reads_continued_values_and_skips_imports_and_comments():
  text = (
    "from __gin__ import dynamic_registration\nfrom remixer_t5.training import optim\n\n# Macros:\n"
    "# ====\nBATCH_SIZE = 32\nDATA_DIR = None\nNAME = 'x = y'\nLONG = \\\n    {'a': 1,\n     'b': 2}\n"
    "optim.rsqrt_schedule.warmup_steps = 300\nflag = True\nrate = 1e-3\n"
  )
  assert tracking.gin_bindings(text) == {
    "BATCH_SIZE": 32,
    "DATA_DIR": None,
    "NAME": "x = y",
    "LONG": "{'a': 1, 'b': 2}",
    "optim.rsqrt_schedule.warmup_steps": 300,
    "flag": True,
    "rate": 1e-3,
  }


def test_a_gin_binding_names_the_project_and_group_before_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_PROJECT", "from-env")
  monkeypatch.setenv("WANDB_RUN_GROUP", "group-from-env")
  monkeypatch.delenv("WANDB_ENTITY", raising=False)
  parse_gin(["models/t5_1_1/tiny.gin", "runs/demo.gin"], ["MODEL_DIR='/tmp/unused'"])
  assert tracking.settings() == tracking.Wandb(project="from-env", group="group-from-env")
  bound = tmp_path / "tracking.gin"
  bound.write_text(
    "from __gin__ import dynamic_registration\nfrom remixer_t5.training import tracking\n"
    "tracking.Wandb.project = 'from-gin'\n"
  )
  parse_gin(["models/t5_1_1/tiny.gin", "runs/demo.gin", str(bound)], ["MODEL_DIR='/tmp/unused'"])
  assert tracking.settings() == tracking.Wandb(project="from-gin", group="group-from-env")
  monkeypatch.delenv("WANDB_PROJECT")
  monkeypatch.delenv("WANDB_RUN_GROUP")
  parse_gin(["models/t5_1_1/tiny.gin", "runs/demo.gin"], ["MODEL_DIR='/tmp/unused'"])
  assert tracking.from_environment(str(tmp_path)) is None  # no project: no tracking, nothing written
  assert not (tmp_path / tracking.RUN_ID_FILE).exists()


def test_tracking_without_wandb_installed_is_one_line_naming_the_extra(tmp_path, monkeypatch):
  import gin

  gin.clear_config()
  monkeypatch.setenv("WANDB_PROJECT", "test")
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with pytest.raises(ImportError) as e:
    tracking.from_environment(str(tmp_path))
  assert "pip install -e '.[wandb]'" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_tracked_process_leaves_no_wandb_process_behind(tmp_path):
  """Even a process that ends with os._exit (the CLI's exit after abandoned storage waits) leaves none. Its
  second row (3,000 keys, ~80 KB) spans blocks: the reader joins W&B's first, middle and last chunks."""
  script = (
    "import os\nfrom remixer_t5.training import tracking\n"
    f"t = tracking.from_environment({str(tmp_path / 'run')!r})\n"
    "t.log(1, 'train', {'loss': 1.0}, 1)\nt.log(2, 'wide', {f'k{i}': i / 7 for i in range(3000)}, 1)\n"
    "t.close()\nprint(os.getpid(), flush=True)\nos._exit(0)\n"
  )
  env = {
    **os.environ,
    "WANDB_MODE": "offline",
    "WANDB_PROJECT": "test",
    "WANDB_DIR": str(tmp_path),
    "WANDB_SILENT": "true",
    "WANDB_ERROR_REPORTING": "false",
  }
  (tmp_path / "run").mkdir()
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  pid = int(done.stdout.split()[-1])
  left = _wait_for_no_wandb_core(pid)
  assert not left, f"wandb-core processes {left} outlived their process {pid}"
  (history,) = [r["history"] for r in offline_runs(tmp_path)]
  assert history == [
    {"train/loss": 1, "step": 1, "attempt": 1},
    {**{f"wide/k{i}": i / 7 for i in range(3000)}, "step": 2, "attempt": 1},
  ]
  (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
  assert run_file.stat().st_size > 2 * BLOCK, f"{run_file}: {run_file.stat().st_size} bytes, expected > 2 blocks"
