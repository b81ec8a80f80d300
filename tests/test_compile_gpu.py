"""`remixer-t5 compile --topology h100x8`: GPU programs compiled on this CPU machine (no GPU).

Naming and the missing-plugin refusal run everywhere; the compiles need XLA's CUDA compiler plugin (setup.py's
gpu-compile extra), which `make test` does not install: `make test-gpu-compile` runs them in .venv-gpu.
"""

import json

import pytest

from remixer_t5 import aot_compile, cli
from tiers import needs_cuda_plugin

TINY = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/pretrain.gin",
  "--gin.BATCH_SIZE=8",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
]


def test_gpu_names_are_one_process_gpus_with_their_target_config(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  acc = aot_compile.accelerator("h100x8")
  assert (acc.name, acc.num_devices, acc.topology, acc.platform) == ("h100x8", 8, "1x1x8", "cuda")
  assert acc.device_memory_bytes == 84_942_979_072  # what the driver reports for an H100 SXM 80 GB
  assert acc.hbm_bytes == int(0.75 * 84_942_979_072)  # JAX's default share
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
  assert acc.hbm_bytes == int(0.9 * 84_942_979_072)
  assert aot_compile.accelerator("H100").num_devices == 1
  assert aot_compile.accelerator("a100x4").device_memory_bytes == 85_100_068_864
  assert aot_compile.accelerator("h200").device_memory_bytes == 151_397_597_184
  for name in aot_compile.gpu_names():
    assert "device_description_str" in aot_compile.accelerator(name).target_config
  with pytest.raises(ValueError, match="one process drives 1, 2, 4, 8 GPUs"):
    aot_compile.accelerator("h100x16")
  with pytest.raises(ValueError, match="unknown accelerator 'h300'.*h100x8"):
    aot_compile.accelerator("h300")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "most")
  with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
    aot_compile.accelerator("h100").hbm_bytes  # noqa: B018


def test_without_the_cuda_plugin_the_command_says_how_to_get_it(monkeypatch, capsys):
  real = aot_compile.importlib.util.find_spec
  monkeypatch.setattr(
    aot_compile.importlib.util, "find_spec", lambda n, *a: None if n.startswith("jax_plugins") else real(n, *a)
  )
  assert cli.main(["compile", *TINY, "--topology", "h100"]) == 2
  err = capsys.readouterr().err
  assert "make gpu-compile-env" in err and "gpu-compile" in err and "Traceback" not in err


@needs_cuda_plugin
def test_a_tiny_config_compiles_for_8_h100s(capsys, monkeypatch):
  """With XLA's attention (no Pallas kernel, whose FLOPs and bytes XLA's cost analysis does not see) the report
  has a roofline step time; with the default (`auto`: the fused attention kernel) it says why it has none."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert cli.main(["compile", *TINY, "--topology", "h100x8", "--json"]) == 0
  fused = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]["train"]
  assert fused["kernel_calls"] > 0 and "roofline_seconds" not in fused and "Pallas" in fused["estimate_note"]
  assert (
    cli.main(
      ["compile", *TINY, "--gin.network.T5Config.attention_impl='xla'", "--topology", "h100x8", "--all_steps", "--json"]
    )
    == 0
  )
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert (report["platform"], report["xla_topology"], report["devices"]) == ("cuda", "1x1x8", 8)
  assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["mesh"] == {"data": 8, "model": 1}
  assert report["fits"] and set(report["steps"]) == {"train", "eval", "decode"}
  train = report["steps"]["train"]
  m = train["memory"]
  assert m["total_bytes"] == (
    m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"] + m["code_bytes"]
  )
  assert m["alias_bytes"] > 0  # the donated train state
  assert train["available_bytes"] == int(0.75 * 84_942_979_072)
  # XLA's per-GPU count of the compiled step: the model's fwd+bwd share plus the optimizer update (every GPU
  # updates every parameter under data-parallel rules), as on TPUs.
  assert 1.0 < train["xla_flops_per_device"] / train["model_flops_per_device"] < 2.0
  roof = max(train["xla_flops_per_device"] / 989e12, train["bytes_accessed_per_device"] / 3_352_320_000_000)
  assert train["roofline_seconds"] == pytest.approx(roof)
  assert train["est_mfu"] == pytest.approx(train["model_flops_per_device"] / roof / 989e12)
  assert report["steps"]["eval"]["xla_flops_per_device"] < train["xla_flops_per_device"]


@needs_cuda_plugin
def test_sharding_over_8_gpus_divides_the_work(capsys):
  per = {}
  for topo in ("h100", "h100x8"):
    assert cli.main(["compile", *TINY, "--gin.BATCH_SIZE=64", "--topology", topo, "--json"]) == 0
    per[topo] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]["train"]
  assert per["h100"]["model_flops_per_device"] == pytest.approx(8 * per["h100x8"]["model_flops_per_device"])
  assert per["h100x8"]["memory"]["temp_bytes"] < per["h100"]["memory"]["temp_bytes"]


@needs_cuda_plugin
def test_a_run_that_does_not_fit_is_refused_with_the_shortfall(capsys, monkeypatch):
  # XLA:GPU compiles programs of any size, so the refusal is ours: here JAX is given 0.01% of each A100
  # (8.1 MiB), less than the tiny model's state and step.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.0001")
  assert cli.main(["compile", *TINY, "--topology", "a100", "--json"]) == 1
  captured = capsys.readouterr()
  train = json.loads(captured.out.strip().splitlines()[-1])["steps"]["train"]
  assert not train["fits"] and train["needs_bytes"] > train["available_bytes"] == int(0.0001 * 85_100_068_864)
  assert "does not fit on a100: needs" in captured.err and "8.1 MiB available" in captured.err
  assert "more GPUs (--topology a100x8)" in captured.err and "XLA_PYTHON_CLIENT_MEM_FRACTION=.95" in captured.err


@needs_cuda_plugin
def test_a_near_miss_says_the_prediction_can_be_wrong_by_that_much(capsys, monkeypatch):
  # The refusal of a program needing 3% more than JAX's share names the prediction's measured error
  # (aot_compile.GPU_PREDICTION_MARGIN); one needing 100x more (the test above's) does not.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.0001")
  assert cli.main(["compile", *TINY, "--topology", "a100", "--json"]) == 1
  far = capsys.readouterr()
  assert "near miss" not in far.err
  needs = json.loads(far.out.strip().splitlines()[-1])["steps"]["train"]["needs_bytes"]
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{needs / 1.03 / 85_100_068_864:.12f}")
  assert cli.main(["compile", *TINY, "--topology", "a100", "--json"]) == 1
  near = capsys.readouterr()
  train = json.loads(near.out.strip().splitlines()[-1])["steps"]["train"]
  assert not train["fits"] and train["needs_bytes"] == needs
  assert "near miss" in near.err and "within 7% of the limit" in near.err


@needs_cuda_plugin
def test_an_out_of_memory_error_without_numbers_is_still_a_refusal(capsys, monkeypatch):
  # XLA's RESOURCE_EXHAUSTED in a form _oom_numbers cannot read (the H100's "while trying to allocate 77.43GiB"):
  # the row has no sizes, so there is no near-miss to judge, and the command refuses with XLA's words.
  from remixer_t5.training import programs

  def exhausted(self, step, *args, compiler_options=None):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 77.43GiB")

  monkeypatch.setattr(programs.Program, "compile", exhausted)
  assert cli.main(["compile", *TINY, "--topology", "a100", "--json"]) == 1
  err = capsys.readouterr().err
  assert "does not fit on a100: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 77.43GiB" in err
  assert "near miss" not in err


def _tiny_program_for_h100(init_rng: str):
  """The tiny model's programs (programs.build) on one deviceless H100, data rules."""
  from remixer_t5 import aot_compile, gin_utils
  from remixer_t5.training import partitioning, programs, run_config

  gin_utils.parse_gin(
    ["models/t5_1_1/tiny.gin", "runs/pretrain.gin"],
    ["TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}"],
    macro_defaults={"MODEL_DIR": "None"},
  )
  run = run_config.from_gin()
  devices = aot_compile.gpu_topology_devices(aot_compile.accelerator("h100"))
  part = partitioning.partitioner("1x1", devices[:1], rules="data")
  return programs.from_run(run.training, run.data.feature_lengths, part, init_rng=init_rng)


@needs_cuda_plugin
def test_the_initialiser_draws_its_bits_with_the_threefry_kernel_on_gpus():
  """programs.build's initialiser on a GPU: with the kernel form ('auto' on one device) its threefry is jax's
  kernel (a custom call), so XLA:GPU does not compile every parameter's stream unrolled; 'inline' keeps XLA's."""
  import jax

  key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)
  texts = {}
  for form in ("auto", "inline"):
    prog = _tiny_program_for_h100(form)
    texts[form] = prog.lower(prog.init, key).as_text()
  calls = lambda text: [line for line in text.splitlines() if "custom_call" in line and "threefry2x32" in line]
  assert calls(texts["auto"])  # one per draw's shape (the lowering outlines draws of the same shape into one function)
  assert not calls(texts["inline"])
  # the kernel's program is the smaller one to compile (the inlined form unrolls 20 rounds per draw)
  assert len(texts["auto"]) < len(texts["inline"])


@needs_cuda_plugin
@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_hypermixer_compiles_its_pallas_kernel_and_claims_no_step_time(capsys, monkeypatch, impl):
  """HyperMixing.impl (bound in gin): with 'auto' a GPU program's causal form is a Pallas (Triton) kernel
  (kernels/gpu/hypermixing.py), which the compile lowers through Triton and ptxas; since XLA's cost analysis sees
  neither its FLOPs nor its bytes, the report implies no step time from it. The packed form keeps XLA's id-block
  loop, which the report names. With 'xla' there is no kernel: the causal form's chunked scan is a loop too (32
  targets: 4 chunks of 8, where one chunk would leave no loop)."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  tiny = [
    "--gin_file=models/hypermixer/tiny.gin",
    *TINY[1:3],
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 32}",
    f"--gin.hypermixer.HyperMixing.impl='{impl}'",
  ]
  assert cli.main(["compile", *tiny, "--topology", "h100", "--json"]) == 0
  train = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]["train"]
  assert train["fits"] and "roofline_seconds" not in train and "est_mfu" not in train
  loops = train.get("loops") or []
  assert any("_block_segmented" in loop for loop in loops), loops
  if impl == "auto":
    assert train["kernel_calls"] >= 2  # the causal form's forward and gradient
    assert all("_block_segmented" in loop for loop in loops), loops  # no scan left
    assert "Pallas (Triton) kernel" in train["estimate_note"]
  else:
    assert "kernel_calls" not in train
    assert any("_scan_causal" in loop for loop in loops), loops
    assert "Pallas (Triton) kernel" not in train["estimate_note"]


def test_cost_table_compiles_what_is_missing_and_what_redo_names():
  """scripts/cost_table.py gpu: a rerun compiles the cells without a row, and with --redo every cell of the
  named models again (their old rows stay in the JSONL; the table shows the latest); an unknown name is refused."""
  import sys
  from pathlib import Path

  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
  import cost_table as table

  rows = [{"name": c[0], "topology": c[1], "rules": c[2], "mesh": c[3], "variant": c[4]} for c in table.gpu_cells()]
  assert table.gpu_todo(rows, []) == []
  assert table.gpu_todo(rows[1:], []) == [table.gpu_cells()[0]]
  assert table.gpu_todo(rows, ["hypermixer_base"]) == [c for c in table.gpu_cells() if c[0] == "hypermixer_base"]
  assert len(table.gpu_todo(rows, ["hypermixer_base"])) == len(table.SETUPS)
  with pytest.raises(SystemExit, match="unknown model.*hypermix; expected some of"):
    table.gpu_todo(rows, ["hypermix"])
