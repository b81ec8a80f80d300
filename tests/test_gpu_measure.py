"""scripts/gpu_measure.py, the GPU session's one prepared script, on the CPU: it must not rot between the rare
sessions that have a GPU (its stages run the same code on whatever device JAX has)."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_measure  # noqa: E402


def test_top_ops_sums_the_device_streams_per_step(tmp_path):
  events = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 7, "name": "scatter_fusion", "dur": 3000.0},
    {"ph": "X", "pid": 1, "tid": 7, "name": "scatter_fusion", "dur": 1000.0},
    {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 500.0},
    {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction(train_step)", "dur": 9e6},  # the host: left out
  ]
  path = tmp_path / "t.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert gpu_measure.top_ops(str(path), per=2) == [("scatter_fusion", 2.0), ("gemm", 0.25)]


def test_device_time_counts_overlapping_streams_once(tmp_path):
  events = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "Stream #14(Compute)"}},
    {"ph": "X", "pid": 1, "tid": 7, "name": "a", "ts": 0.0, "dur": 1000.0},
    {"ph": "X", "pid": 1, "tid": 8, "name": "b", "ts": 500.0, "dur": 1000.0},  # overlaps a by 500 us
    {"ph": "X", "pid": 1, "tid": 7, "name": "c", "ts": 3000.0, "dur": 1000.0},  # after a 1,500 us gap
  ]
  path = tmp_path / "t.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert gpu_measure.device_time(str(path), per=2) == {
    "kernels_per_step": 1.5,
    "kernel_ms_per_step": 1.5,
    "busy_ms_per_step": 1.25,
    "span_ms": 4.0,
  }


@pytest.mark.integration
def test_a_model_stage_compiles_times_and_profiles_the_trainer_step(tmp_path):
  """The tiny T5.1.1 stage end to end (batch 8 at 512/114 on the CPU): the row a GPU session reads."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "COMMIT": "test"}
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "scripts" / "gpu_measure.py"),
      "--out",
      str(tmp_path),
      "--stages",
      "t5_1_1_tiny,init_rng,no_such_stage",
      "--steps",
      "2",
      "--warmup",
      "1",
      "--profile",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in (tmp_path / "gpu_measure.jsonl").read_text().splitlines()]
  head, row, init, bad = rows
  assert head["stage"] == "environment" and head["commit"] == "test" and head["versions"]["jax"]
  assert row["stage"] == "t5_1_1_tiny" and "error" not in row, row
  assert row["batch_size"] == 8 and row["feature_lengths"] == {"inputs": 512, "targets": 114}
  assert len(row["losses"]) == 3 and row["losses_finite"] and row["losses"][-1] < row["losses"][0]
  assert row["memory"]["total_bytes"] > 0 and row["model_flops_per_step"] > 0
  assert row["tokens_per_s"] == pytest.approx(8 * 626 / row["step_seconds_pipelined"])
  assert row["init_compile_seconds"] >= 0 and row["init_run_seconds"] >= 0
  assert (tmp_path / "t5_1_1_tiny.perfetto_trace.json.gz").stat().st_size > 0
  with gzip.open(tmp_path / "t5_1_1_tiny.hlo.txt.gz", "rt") as f:  # the compiled step's HLO, to map kernels
    assert "ENTRY" in f.read()
  # the initialiser both ways (on a CPU the kernel option changes nothing) and on the host: the same state
  assert init["stage"] == "init_rng" and init["ok"] and init["leaves"] > 100, init
  assert init["kernel_vs_inlined_leaves_differing"] == 0 and init["host_max_abs_diff"] == 0.0
  assert init["host_max_rel_diff"] == 0.0 and init["max_abs_value"] > 0
  assert not init["kernel_used"] and init["kernel_threefry_kernel_calls"] == 0  # no GPU lowering here
  assert bad["stage"] == "no_such_stage" and "unknown stage" in bad["error"]  # one bad stage costs its row only
  assert "T5.1.1-tiny" in proc.stdout and "no_such_stage: ERROR" in proc.stdout
  assert "init_rng (cpu, models/t5_1_1/tiny.gin): kernel vs inlined threefry, 0 of" in proc.stdout


@pytest.mark.integration
def test_a_stage_out_of_time_keeps_its_phases(tmp_path):
  """A model stage killed at its time limit: the row says so and carries the phases it reached (stderr)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "COMMIT": "test"}
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "scripts" / "gpu_measure.py"),
      "--out",
      str(tmp_path),
      "--stages",
      "t5_1_1_small",
      "--model-timeout",
      "25",
    ],  # batch 128: minutes to compile
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  row = json.loads((tmp_path / "gpu_measure.jsonl").read_text().splitlines()[-1])
  assert row["stage"] == "t5_1_1_small" and row["error"] == "did not finish in 25 s", row
  assert any("t5_1_1_small: compiling the train step" in line for line in row["progress"]), row
  assert "compiling the train step" in proc.stdout  # the summary prints them too


@pytest.mark.integration
def test_the_kernels_stage_runs_bench_kernels_on_packed_rows(tmp_path):
  """The `kernels` stage on the CPU: `remixer-t5 bench kernels` on HyperMixer's packed COGS step (the C++ loops
  here, the Pallas kernel on a GPU) against plain XLA, its rows and summary in the stage's row; the variants'
  first losses agree (each round's state is the variant's own, so later steps drift apart by rounding)."""
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(REPO),
    "COMMIT": "test",
    "GPU_MEASURE_KERNELS": "cogs:hypermixer:packed",
    "REMIXER_T5_CACHE_DIR": str(tmp_path / "cache"),
  }
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "scripts" / "gpu_measure.py"),
      "--out",
      str(tmp_path),
      "--stages",
      "kernels",
      "--steps",
      "1",
      "--warmup",
      "0",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  row = json.loads((tmp_path / "gpu_measure.jsonl").read_text().splitlines()[-1])
  assert row["stage"] == "kernels" and "error" not in row, row
  first = {r["variant"]: r for r in row["rows"] if r["round"] == 0}
  assert set(first) == {"default", "xla", "hypermixing=xla", "dropout=xla"}
  assert all(r["workload"] == "cogs:hypermixer:packed" and r["s_per_step"] > 0 for r in row["rows"])
  losses = [r["last_loss_sum"] for r in first.values()]
  assert max(losses) - min(losses) <= 1e-4 * abs(losses[0]), first
  assert "# cogs:hypermixer:packed: default" in proc.stdout


def test_each_attention_model_has_an_xla_attention_stage_beside_it():
  """The GPU session times the fused attention against the plain XLA form side by side: every default model
  stage with attention has its `_xla` twin binding attention_impl='xla', and the twin differs in that alone."""
  for stage in gpu_measure.DEFAULT_STAGES:
    if stage in gpu_measure.MODELS and "hypermixer" not in stage and not stage.endswith("_xla"):
      gin_file, bindings, _ = gpu_measure.MODELS[stage]
      assert gpu_measure.MODELS[f"{stage}_xla"] == (
        gin_file,
        [*bindings, gpu_measure.XLA_ATTENTION],
        gpu_measure.MODELS[f"{stage}_xla"][2],
      )
  assert any(s.endswith("_xla") for s in gpu_measure.DEFAULT_STAGES) and "cogs_quick" in gpu_measure.DEFAULT_STAGES


def test_the_attention_and_hypermixing_stages_dry_run_every_form_in_the_interpreter(tmp_path):
  """The `attention` stage on the CPU: bench/attention.py's forms (the fused kernels at two tilings, the XLA form,
  JAX's `mha`) run in Pallas's interpreter at tiny encoder and decoder shapes; each has its times and rate, the
  kernels' outputs match the XLA form's within bfloat16 rounding, and each shape names its fastest tilings. The
  `hypermixing` stage (bench/hypermixing.py) times the causal kernel and its arithmetic alone the same way."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "COMMIT": "test"}
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "scripts" / "gpu_measure.py"),
      "--out",
      str(tmp_path),
      "--stages",
      "attention,hypermixing",
      "--steps",
      "1",
      "--warmup",
      "0",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  row, hyper = (json.loads(line) for line in (tmp_path / "gpu_measure.jsonl").read_text().splitlines()[-2:])
  assert row["stage"] == "attention" and row["dry"] and "error" not in row, row
  timed = [r for r in row["rows"] if r["form"] != "best"]
  assert {(r["shape"], r["form"]) for r in timed} == {
    (s, f) for s in ("encoder", "decoder") for f in ("pallas 16x16 w4 s2", "pallas 32x16 w4 s2", "xla", "mha")
  }
  assert all("error" not in r and r["fwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in timed), timed
  assert all(r["max_diff_vs_xla"] < 3e-2 for r in timed if r["form"].startswith("pallas")), timed
  assert all("of_mha" in r for r in timed)
  best = {r["shape"]: r for r in row["rows"] if r["form"] == "best"}
  assert set(best) == {"encoder", "decoder"} and best["encoder"]["forward"].startswith("pallas")
  assert "encoder best: forward pallas" in proc.stdout
  assert hyper["stage"] == "hypermixing" and hyper["dry"] and "error" not in hyper, hyper
  assert [r["form"] for r in hyper["rows"]] == ["kernel 16x16 w2", "arithmetic"]
  assert all("error" not in r and r["decoder_ms"] > 0 and "of_arithmetic" in r for r in hyper["rows"]), hyper
  assert "hypermixing (CPU interpreter dry run):" in proc.stdout and "x12 layers" in proc.stdout
