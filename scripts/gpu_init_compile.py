"""Deviceless: how long XLA:GPU takes to compile the trainer's initialiser, with and without the threefry kernel.

`train_state.init_state` lowers the state's initialiser inside `train_state.init_rng_as_kernel()`, which makes jax
draw the parameters' random bits with its threefry kernel (a custom call) on GPUs instead of XLA's inlined
threefry. This compiles that program for a GPU target config (`remixer-t5 compile`'s deviceless topology, no
GPU needed) both ways, one after the other in this process, and prints for each the compile seconds, the
optimised HLO's size and fusion count, and XLA's temporary and output buffers. Needs the CUDA compiler plugin
(`make gpu-compile-env`):

  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false .venv-gpu/bin/python \\
      scripts/gpu_init_compile.py [--model models/t5_1_1/base.gin] [--topology h100] [--only kernel|inlined]

(Triton GEMMs off as in `aot_compile`'s retry: deviceless autotuning of them needs a GPU.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time


def initialiser(model_gin: str, run_gin: str, topology: str, bindings=()):
  """`train_state.init_program` of the configuration for one GPU of `topology` (deviceless, data rules): the
  jitted initialiser, its key's abstract value, and the state's shardings."""
  import jax

  from remixer_t5 import aot_compile, gin_utils
  from remixer_t5.training import partitioning, programs, train_state
  gin_utils.parse_gin([model_gin, run_gin], list(bindings), macro_defaults={"MODEL_DIR": "None"})
  s = aot_compile.train_settings()
  acc = aot_compile.accelerator(topology)
  mesh = partitioning.make_mesh(1, "1x1", aot_compile.gpu_topology_devices(acc)[:1], rules="data")
  model, lengths = s["model"], dict(s["feature_lengths"])
  tx = programs.optimizer(model, s.get("optimizer") or aot_compile._default_optimizer(), s.get("learning_rate"))
  prog = programs.program(model, tx, None, lengths, mesh, s.get("num_microbatches"))
  init, rng = train_state.init_program(model, tx, train_state.input_shapes(lengths), prog.shardings, 0)
  key = jax.ShapeDtypeStruct(rng.shape, rng.dtype,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return init, key, prog.shardings


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="models/t5_1_1/base.gin", help="a model gin file (gin/ relative)")
  p.add_argument("--run", default="runs/pretrain.gin", help="the run gin file whose lengths and batch it uses")
  p.add_argument("--topology", default="h100", help="one of aot_compile.gpu_names(): h100, h200, a100")
  p.add_argument("--only", choices=("kernel", "inlined"), help="compile one form only")
  args = p.parse_args()

  import jax

  from remixer_t5 import aot_compile
  from remixer_t5.training import train_state
  init, key, shardings = initialiser(args.model, args.run, args.topology, ["ACTIVATION_DTYPE='bfloat16'"])
  forms = {"kernel": lambda: train_state.init_rng_as_kernel(shardings), "inlined": contextlib.nullcontext}
  for form in [args.only] if args.only else ["kernel", "inlined"]:
    t0 = time.time()
    with forms[form]():
      lowered = init.lower(key)
    with aot_compile._without_persistent_cache():
      compiled = lowered.compile()
    seconds = time.time() - t0
    text, mem = compiled.as_text(), compiled.memory_analysis()
    print(json.dumps({"model": args.model, "topology": args.topology, "rng": form,
                      "lower_and_compile_seconds": round(seconds, 1), "hlo_chars": len(text),
                      "fusions": text.count(" fusion("), "temp_mib": round(mem.temp_size_in_bytes / 2**20, 1),
                      "output_mib": round(mem.output_size_in_bytes / 2**20, 1),
                      "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
  main()
