"""`remixer-t5 bench train`: the trainer's jitted step timed on random tokens, optionally beside HF's T5."""

import json
import os
from pathlib import Path

import pytest

from remixer_t5.bench import train as bench_train
from remixer_t5 import cli

ARGS = [
  "bench",
  "train",
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/demo.gin",
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
  "--steps=2",
  "--rounds=1",
  "--warmup=1",
  "--json",
]


def _row(capsys) -> dict:
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.integration
def test_json_fields_and_reference(capsys):
  pytest.importorskip("torch", reason="the HF reference needs the optional .[hf] extra (PyTorch)")
  pytest.importorskip("transformers", reason="the HF reference needs the optional .[hf] extra (transformers)")
  assert cli.main([*ARGS, "--reference=hf", "--lengths=12,6", "--batch_size=3", "--peak_flops=1e12"]) == 0
  r = _row(capsys)
  assert (r["batch_size"], r["inputs_length"], r["targets_length"]) == (3, 12, 6)  # the overrides win
  assert r["steps"] == 2 and r["rounds"] == 1 and r["backend"] == "cpu"
  for name in ("ours", "hf"):
    assert r[f"{name}_s_per_step"] > 0 and len(r[f"{name}_round_medians"]) == 1
    assert r[f"{name}_tokens_per_s"] == pytest.approx(3 * (12 + 6) / r[f"{name}_s_per_step"])
    # process CPU use over the timed steps: busy cores, system time and minor page faults per step
    assert 0 < r[f"{name}_cores_busy"] <= 64 and r[f"{name}_system_s_per_step"] >= 0
    assert r[f"{name}_minor_faults_per_step"] >= 0
    assert r[f"{name}_mfu"] == pytest.approx(r["model_flops_per_step"] / r["devices"] / r[f"{name}_s_per_step"] / 1e12)
  assert r["ratio_ours_to_hf"] == pytest.approx(r["ours_s_per_step"] / r["hf_s_per_step"])
  assert r["model_flops_per_step"] > 0 and r["peak_flops_per_device"] == 1e12
  assert r["xla_denormals_flushed"] is True  # PyTorch's: in fresh processes, below
  # The reference ran in a process of its own (the default); its PyTorch settings were measured there.
  assert r["hf_process"] == "own" and r["torch_num_threads"] >= 1 and r["torch_denormals_flushed"] is True
  assert r["torch_version"] and r["transformers_version"]


@pytest.mark.integration
def test_reference_in_this_process_on_request(capsys):
  pytest.importorskip("torch", reason="the HF reference needs the optional .[hf] extra (PyTorch)")
  pytest.importorskip("transformers", reason="the HF reference needs the optional .[hf] extra (transformers)")
  assert cli.main([*ARGS, "--reference=hf", "--hf_process=shared", "--lengths=8,4", "--batch_size=2", "--json"]) == 0
  r = _row(capsys)
  assert r["hf_process"] == "shared" and r["hf_s_per_step"] > 0 and "torch_num_threads" in r


@pytest.mark.integration
def test_reference_process_is_another_and_its_failure_is_reported():
  pytest.importorskip("torch", reason="the HF reference needs the optional .[hf] extra (PyTorch)")
  pytest.importorskip("transformers", reason="the HF reference needs the optional .[hf] extra (transformers)")
  import os
  from remixer_t5.model import config
  from remixer_t5.interop import hf

  batch = bench_train.random_batch(64, 2, {"inputs": 6, "targets": 4})
  cfg = hf.config_to_hf(
    config.T5Config(
      vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32, num_encoder_layers=1, num_decoder_layers=1
    )
  )
  child = bench_train._ChildReference(cfg, batch, seed=0, flush_denormal=True)
  try:
    assert child.process.pid != os.getpid() and child.process.is_alive()
    times, cpu, system, faults = child.round(0, 2)
    assert len(times) == 2 and all(t > 0 for t in times) and cpu > 0 and faults >= 0
  finally:
    child.close()
  assert not child.process.is_alive()
  with pytest.raises(RuntimeError, match="the HF reference failed in its own process: .*d_model"):
    bench_train._ChildReference({**cfg, "d_model": "wide"}, batch, seed=0, flush_denormal=True)


@pytest.mark.integration
@pytest.mark.parametrize("mode, flushed", [("keep", False), ("flush", True), (None, True)])
def test_hf_denormals_flag_sets_what_the_row_measures(mode, flushed):
  """In a fresh process each (the mode is per thread, and a test process's PyTorch threads may predate the
  setting): the row's torch_denormals_flushed, a sum run on every PyTorch thread, follows the flag."""
  pytest.importorskip("torch", reason="the HF reference needs the optional .[hf] extra (PyTorch)")
  pytest.importorskip("transformers", reason="the HF reference needs the optional .[hf] extra (transformers)")
  import os
  import subprocess
  import sys

  flag = [] if mode is None else [f"--hf_denormals={mode}"]
  done = subprocess.run(
    [sys.executable, "-m", "remixer_t5", *ARGS, "--reference=hf", *flag, "--lengths=8,4", "--batch_size=2"],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert done.returncode == 0, done.stderr[-2000:]
  r = json.loads(done.stdout.strip().splitlines()[-1])
  assert r["torch_denormals_flushed"] is flushed and r["xla_denormals_flushed"] is True


def _exit_code(argv) -> int:
  try:
    return cli.main(argv)
  except SystemExit as e:  # a usage error: argparse's, one line
    return e.code


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--reference=hf", "--hf_denormals=off"], "argument --hf_denormals/--hf-denormals: invalid choice: 'off'"),
    (["--reference=hf", "--hf_denormals="], "argument --hf_denormals/--hf-denormals: invalid choice: ''"),
    (["--hf_denormals=keep"], "--hf_denormals=keep sets the HF reference; it needs --reference hf"),
    (["--hf_process=own"], "--hf_process=own sets the HF reference; it needs --reference hf"),
  ],
)
def test_bad_hf_denormals_is_a_clear_error(capsys, flags, message):
  assert _exit_code([*ARGS, *flags]) == 2
  assert message in capsys.readouterr().err


@pytest.mark.integration
def test_text_report_from_a_model_config_alone_has_no_cpu_mfu(capsys):
  assert (
    cli.main(
      [
        "bench",
        "train",
        "--gin_file=models/t5_1_1/tiny.gin",
        "--batch_size=2",
        "--lengths=16,8",
        "--steps=2",
        "--rounds=1",
        "--warmup=0",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "batch 2 x 16/8" in out and "tokens/s" in out and "MFU n/a" in out and "HF" not in out


def test_missing_sizes_are_a_clear_error(capsys):
  assert cli.main(["bench", "train", "--gin_file=models/t5_1_1/tiny.gin", "--steps=1"]) == 2
  err = capsys.readouterr().err
  assert "TASK_FEATURE_LENGTHS (or --lengths)" in err and "BATCH_SIZE (or --batch_size)" in err


def test_bad_reference_is_a_clear_error(capsys):
  assert _exit_code([*ARGS, "--reference=torch"]) == 2
  err = capsys.readouterr().err
  assert "argument --reference: invalid choice: 'torch' (choose from 'hf', 'none')" in err


def test_bad_sizes_are_clear_errors():
  with pytest.raises(ValueError, match="steps=0"):
    bench_train.bench_train(None, None, batch_size=1, feature_lengths={"inputs": 4, "targets": 4}, steps=0)
  with pytest.raises(ValueError, match="unknown --reference 'tf'"):
    bench_train.bench_train(None, None, batch_size=1, feature_lengths={"inputs": 4, "targets": 4}, reference="tf")


def test_random_batch_shifts_targets_right():
  b = bench_train.random_batch(100, 2, {"inputs": 5, "targets": 4})
  assert b["encoder_input_tokens"].shape == (2, 5) and b["decoder_target_tokens"].shape == (2, 4)
  assert (b["decoder_input_tokens"][:, 0] == 0).all()
  assert (b["decoder_input_tokens"][:, 1:] == b["decoder_target_tokens"][:, :-1]).all()
  assert b["encoder_input_tokens"].min() >= 2 and b["encoder_input_tokens"].max() < 100


@pytest.mark.integration
def test_rows_record_the_machine_flags_threads_and_load(capsys, monkeypatch):
  monkeypatch.setenv("OMP_NUM_THREADS", "2")
  assert cli.main([*ARGS, "--lengths=12,6", "--batch_size=2", "--json"]) == 0
  r = _row(capsys)
  from remixer_t5.bench import env as bench_env

  cpuinfo = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
  if cpuinfo:
    first = next(line for line in cpuinfo.splitlines() if line.lower().startswith("model name"))
    assert r["cpu_model"] == first.split(":", 1)[1].strip()
    field = lambda name: next(
      line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.split(":", 1)[0].strip() == name
    )
    if "cpu family" in cpuinfo:
      assert r["cpu_id"] == (
        f"{field('vendor_id')} family {field('cpu family')} model {field('model')} stepping {field('stepping')}"
      )
    flags = set(next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split(":", 1)[1].split())
    assert r["cpu_flags"] == [f for f in bench_env.CPU_FLAGS_OF_INTEREST if f in flags]
  assert r["thread_env"] == {"OMP_NUM_THREADS": "2"}
  assert len(r["load_average_start"]) == 3 and len(r["load_average_end"]) == 3
  assert isinstance(r["host_malloc_policy"], bool) and "xla_flags" in r
  assert "cpu_hypermixing" in r and "cpu_threefry" in r  # what the CPU kernels ran (None: not used)
  assert r["xla_denormals_flushed"] is True  # XLA:CPU's FTZ/DAZ, which the HF reference is made to match
  thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
  if thp.exists():  # the bracketed mode of the kernel's setting, e.g. "always [madvise] never" -> "madvise"
    assert f"[{r['transparent_hugepages']}]" in thp.read_text()
  else:
    assert r["transparent_hugepages"] is None
  assert r["git_commit"] is None or len(r["git_commit"].split("+")[0]) == 40


def test_cores_env_pins_the_cli_before_its_thread_pools_start(tmp_path):
  """$REMIXER_T5_CPUS (set by `repro cogs --jobs`): the process and every thread it makes run on those cores,
  and XLA sizes its pool to them; a bad list is one clear error naming the variable."""
  import os
  import subprocess
  import sys

  if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs Linux with 2 usable cores")
  core = max(os.sched_getaffinity(0))
  code = (
    "import os, threading; from remixer_t5 import cli; import jax; jax.numpy.ones(2).block_until_ready(); "
    "masks = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}; "
    "print(cli._PINNED, sorted(masks), os.cpu_count(), flush=True)"
  )
  env = {**os.environ, "REMIXER_T5_CPUS": str(core), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split("]")[0] + "]" == f"[{core}]"
  assert f"[({core},)]" in out.stdout  # every thread of the process (numpy's, XLA's) has the one-core mask
  ok = subprocess.run(
    [sys.executable, "-m", "remixer_t5", "tasks"], capture_output=True, text=True, env=env, timeout=300
  )
  assert ok.returncode == 0 and f"cores: this process runs on {core} ($REMIXER_T5_CPUS)" in ok.stderr, ok.stderr
  bad = subprocess.run(
    [sys.executable, "-m", "remixer_t5", "tasks"],
    capture_output=True,
    text=True,
    env={**env, "REMIXER_T5_CPUS": "0,x"},
    timeout=300,
  )
  assert bad.returncode == 2 and "$REMIXER_T5_CPUS='0,x': expected comma-separated core numbers" in bad.stderr
  assert "Traceback" not in bad.stderr


def test_cores_env_refuses_cores_this_process_may_not_use():
  from remixer_t5 import runtime

  assert runtime.pin_from_env({}) is None and runtime.pin_from_env({"REMIXER_T5_CPUS": " "}) is None
  with pytest.raises(ValueError, match=r"\$REMIXER_T5_CPUS='100000': this process may use cores"):
    runtime.pin_from_env({"REMIXER_T5_CPUS": "100000"})


def test_against_a_commit_times_both_trees_in_alternating_processes(capsys):
  """`bench train --against HEAD`: each round one fresh process per tree (the commit's checked out aside), the
  row their per-round times, medians and ratio; the worktree is gone after. Another commit's name is checked."""
  import subprocess

  repo = Path(__file__).resolve().parents[1]
  head = subprocess.run(
    ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  if not head:
    pytest.skip("not a git checkout")
  worktrees = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
  argv = [
    *ARGS[:4],
    "--batch_size=2",
    "--lengths=16,8",
    "--steps=1",
    "--warmup=1",
    "--against",
    "HEAD",
    "--rounds",
    "1",
    "--json",
  ]
  assert cli.main(argv) == 0
  out, err = capsys.readouterr()
  row = json.loads(out.strip().splitlines()[-1])
  assert row["against"] == head and row["here"].startswith(head) and row["rounds"] == 1 and row["bench"] == "train"
  step = row["ours_s_per_step"]
  assert len(step["base_rounds"]) == len(step["here_rounds"]) == 1 and step["base"] > 0
  assert step["here_over_base"] == pytest.approx(step["here"] / step["base"])
  assert "round 1/1: base ours_s_per_step" in err and "round 1/1: here" in err and row["cpu_model"]
  assert (
    subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout == worktrees
  )
  assert cli.main([*ARGS[:4], "--against", "no-such-commit-xyz"]) == 2
  assert "--against no-such-commit-xyz: not a commit" in capsys.readouterr().err
