"""`remixer-t5 compile`: ahead-of-time compilation for TPU slices on this CPU machine (libtpu, no TPU).

Only tiny configs compile here; base-size compiles (minutes, 7-9 GiB of RAM each) are scripts/cost_table.py's.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from remixer_t5 import aot_compile, cli

pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")

TINY = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/pretrain.gin",
  "--gin.BATCH_SIZE=8",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
]


def test_accelerator_names_map_to_layouts_that_libtpu_accepts():
  assert aot_compile.accelerator("v3-8").topology == "v3:2x2"
  assert aot_compile.accelerator("v3-32").topology == "v3:4x4"
  assert aot_compile.accelerator("v3-128").topology == "v3:8x8"
  assert aot_compile.accelerator("v4-8").topology == "v4:2x2x1"
  assert aot_compile.accelerator("v5e-16").topology == "v5e:4x4"
  for bad in ("v3-7", "v3-4", "v9-8", "tpu", "v5e-3"):
    with pytest.raises(ValueError, match="v3-32|slices known here"):
      aot_compile.accelerator(bad)
  names = aot_compile.accelerator_names()
  assert len(names) > 40
  for name in names:  # every listed slice: libtpu describes it with the devices we expect
    acc = aot_compile.accelerator(name)
    devices = aot_compile.topology_devices(acc)
    assert len(devices) == acc.num_devices, name
    kind = devices[0].device_kind.lower()
    assert kind.startswith("tpu " + acc.generation.name[:2]), (name, kind)
  assert len(aot_compile.topology_devices(aot_compile.accelerator("v3-8"), num_slices=2)) == 16


def test_xla_out_of_memory_messages_are_read():
  msg = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (20.59G) "
    "exceeds available HBM (15.48G)."
  )
  need, have = aot_compile._oom_numbers(msg)
  assert need == pytest.approx(20.59 * 2**30) and have == pytest.approx(15.48 * 2**30)
  assert aot_compile._oom_numbers("Used 17.1G of 15.48G hbm. Exceeded hbm capacity by 1.6G.")[0] == pytest.approx(
    17.1 * 2**30
  )
  assert aot_compile._oom_numbers("something else") is None


def test_without_libtpu_the_command_says_how_to_install_it(monkeypatch, capsys):
  real = aot_compile.importlib.util.find_spec
  monkeypatch.setattr(aot_compile.importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a))
  assert cli.main(["compile", *TINY, "--topology", "v3-8"]) == 2
  assert "pip install -e '.[tpu]'" in capsys.readouterr().err


def test_a_tiny_config_compiles_for_v3_8_with_every_step(capsys):
  import warnings

  import jax

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cli.main(["compile", *TINY, "--topology", "v3-8", "--all_steps", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The same program again, with the persistent compilation cache tests/conftest.py sets: a TPU executable
    # cannot be read back without a TPU client (JAX warned "Error reading persistent compilation cache entry
    # ... must be constructed with a Client"), so deviceless compiles write none.
    assert cli.main(["compile", *TINY, "--topology", "v3-8", "--json"]) == 0
  again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert again["steps"]["train"]["memory"] == report["steps"]["train"]["memory"]
  assert not [str(w.message) for w in caught if "compilation cache" in str(w.message)]
  assert jax.config.jax_persistent_cache_min_compile_time_secs < 1e3  # restored for the programs run here
  assert report["topology"] == "v3-8" and report["libtpu_topology"] == "v3:2x2" and report["devices"] == 8
  assert report["device_kind"] == "TPU v3" and report["mesh"] == {"data": 8, "model": 1}
  assert report["fits"] and set(report["steps"]) == {"train", "eval", "decode"}
  train = report["steps"]["train"]
  m = train["memory"]
  for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "total_bytes"):
    assert m[field] >= 0, field
  assert m["total_bytes"] == (
    m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"] + m["code_bytes"]
  )
  assert m["alias_bytes"] > 0  # the donated train state
  assert train["available_bytes"] == pytest.approx(15.48 * 2**30, rel=1e-3)
  tokens = 8 * (32 + 8)
  assert train["model_flops_per_token"] == pytest.approx(train["model_flops_per_step"] / tokens)
  assert train["model_flops_per_device"] == pytest.approx(train["model_flops_per_step"] / 8)
  # XLA's per-core count of the compiled step is the model's fwd+bwd share plus the optimizer update (which
  # every core runs on every parameter here: a large share for a tiny model at 8 x 40 tokens).
  assert 1.0 < train["xla_flops_per_device"] / train["model_flops_per_device"] < 2.0
  assert train["optimal_seconds"] > 0 and train["est_steps_per_s"] == pytest.approx(1 / train["optimal_seconds"])
  assert train["est_mfu"] == pytest.approx(train["model_flops_per_device"] * train["est_steps_per_s"] / 61.5e12)
  assert "loops" not in train and "estimate_note" not in train and "model_flops_note" not in train
  assert report["steps"]["eval"]["xla_flops_per_device"] < train["xla_flops_per_device"]


def test_a_config_too_big_for_a_v3_core_reports_the_numbers_and_fails(capsys):
  # One layer each, but a 2M x 2048 embedding and logits layer (16 GiB of float32 each), replicated: cheap to
  # compile, far beyond a v3 core's 15.48 GiB.
  big = [
    "--gin.network.T5Config.vocab_size=2000000",
    "--gin.network.T5Config.emb_dim=2048",
    "--gin.network.T5Config.num_encoder_layers=1",
    "--gin.network.T5Config.num_decoder_layers=1",
  ]
  code = cli.main(["compile", *TINY, *big, "--topology", "v3-8", "--rules", "data"])
  out, err = capsys.readouterr()
  assert code == 1
  assert "DOES NOT FIT" in out
  assert "does not fit on v3-8: needs" in err and "GiB per device, 15.48 GiB available" in err
  assert "fsdp" in err and "remat" in err and "num_microbatches" in err and "v3-32" in err


def test_compiling_imports_no_tensorflow_or_seqio():
  code = textwrap.dedent("""
      import sys
      from remixer_t5 import aot_compile, gin_utils
      from remixer_t5.training import run_config
      gin_utils.parse_gin(["models/remixer/tiny.gin", "runs/pretrain.gin"],
                          ["BATCH_SIZE=8", "TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}"],
                          macro_defaults={"MODEL_DIR": "None"})
      report = aot_compile.compile_run(run_config.from_gin(), "v3-8", steps=("eval",))
      assert report["devices"] == 8
      loaded = [m for m in ("tensorflow", "seqio") if m in sys.modules]
      assert not loaded, loaded
      print("ok")
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_a_multislice_mesh_puts_the_slices_on_the_data_axis():
  from remixer_t5.training import partitioning

  devices = aot_compile.topology_devices(aot_compile.accelerator("v3-8"), num_slices=2)
  mesh = partitioning.make_mesh(1, (8, 2), devices)
  slices = [[d.slice_index for d in row] for row in mesh.devices]
  assert all(s == [0, 0] for s in slices[:4]) and all(s == [1, 1] for s in slices[4:])
  with pytest.raises(ValueError, match="multiple of 2"):
    partitioning.make_mesh(1, (1, 16), devices)


@pytest.mark.parametrize("pack", [True, False])
def test_the_compiled_batch_is_the_one_the_input_pipeline_gives(pack, embedded_env):
  # compile lowers the step for programs.batch_shapes; train calls it with get_batches' arrays: same features.
  from remixer_t5.data import input_pipeline
  from remixer_t5.tasks import lookup as task_lookup
  from remixer_t5.training import programs

  lengths = {"inputs": 32, "targets": 8}
  task = task_lookup.get_task("embedded_span_corruption")
  real = next(
    input_pipeline.get_batches(task, lengths, "validation", 4, seed=0, shuffle=False, repeat=False, pack=pack)
  )
  shapes = programs.batch_shapes(lengths, 4, pack)
  assert {k: (v.shape, v.dtype.name) for k, v in real.items()} == {
    k: (v.shape, v.dtype.name) for k, v in shapes.items()
  }


def test_a_batch_that_does_not_split_over_the_slice_is_refused_by_name(capsys):
  # v3-8's 8 cores take the batch 8 ways: a global batch of 12 cannot be split evenly.
  code = cli.main(["compile", *TINY, "--gin.BATCH_SIZE=12", "--topology", "v3-8"])
  err = capsys.readouterr().err
  assert code != 0
  assert "BATCH_SIZE=12 does not split over the mesh {'data': 8, 'model': 1}" in err
  assert "multiple of 8" in err and "--gin.BATCH_SIZE=8 (or 16)" in err


@pytest.mark.integration
def test_a_scanned_stack_gets_no_step_time_from_a_loop_counted_once(capsys):
  # XLA's cost model counts a scanned stack's body once, so the report must not turn it into steps/s or an MFU;
  # memory and model FLOPs are still exact.
  assert cli.main(["compile", *TINY, "--gin.network.T5Config.scan_layers=True", "--topology", "v3-8", "--json"]) == 0
  train = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]["train"]
  assert "est_steps_per_s" not in train and "est_mfu" not in train
  assert "loop body once" in train["estimate_note"]
  assert train["memory"]["total_bytes"] > 0 and train["model_flops_per_step"] > 0
  assert cli.main(["compile", *TINY, "--gin.network.T5Config.scan_layers=True", "--topology", "v3-8"]) == 0
  assert "no estimated step time: the layers are scanned" in capsys.readouterr().out


@pytest.mark.parametrize(
  "gin_file,extra,where",
  [
    pytest.param(
      "models/hypermixer/tiny.gin",
      [],
      "token_mixer._segmented",  # packed HyperMixing scans segment ids
      marks=pytest.mark.integration,
    ),
    ("models/t5_1_1/tiny.gin", ["--gin.run_config.Training.num_microbatches=2"], "microbatch"),
  ],
)
def test_any_loop_in_the_step_withholds_the_estimate_and_is_named(capsys, gin_file, extra, where):
  # Not only scanned stacks: a mixer's own scan or the microbatch loop is also counted once by XLA's cost model.
  args = ["compile", f"--gin_file={gin_file}", *TINY[1:], *extra, "--topology", "v3-8", "--json"]
  assert cli.main(args) == 0
  train = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]["train"]
  assert any(where in loop for loop in train["loops"]), train["loops"]
  assert "est_steps_per_s" not in train and "est_mfu" not in train and "est_hfu" not in train
  assert "loop body once" in train["estimate_note"] and where in train["estimate_note"]
  # Model FLOPs count the mixers' chunks one by one (mfu.model_flops_per_step): no loop is left in that count.
  assert "model_flops_note" not in train
