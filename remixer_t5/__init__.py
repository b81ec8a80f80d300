"""remixer_t5: token-mixing seq2seq models (T5.1.1, MLP-Mixer, Remixer, HyperMixer) in JAX/Flax.

Layout: model/ (config, layers, mixers, network, loss and decoding), training/ (trainer, optimizers,
partitioning, checkpoints, evaluation), kernels/ (each platform's faster forms of the model's operations),
data/ and remixer_t5.tasks (seqio), bench/, interop/ (Hugging Face, t5x), repro/ (paper experiments), and the
command line (cli.py, gin_utils.py, aot_compile.py, compare.py, info.py, runtime.py).
"""

# Modules that lived at the top level before the package was divided; an old import (a gin file's
# `from remixer_t5 import network`) fails with the new place named (the old bench.py is now bench/mixing.py).
MOVED = {
    "config": "model", "layers": "model", "network": "model", "models": "model", "decoding": "model",
    "projection": "model", "fixed_length": "model", "mixers": "model",
    "trainer": "training", "checkpoints": "training", "optim": "training", "partitioning": "training",
    "accumulate": "training", "metrics_log": "training", "plots": "training", "mfu": "training",
    "evaluation": "training", "distributed": "training",
    "bench_train": "bench.train", "bench_decode": "bench.decode",
    "bench_input": "bench.input", "bench_env": "bench.env", "hf": "interop", "t5x_compat": "interop.t5x",
}


def moved_message(name: str) -> str:
  """Where the module `name` of MOVED is now, as the import line to write."""
  new = MOVED[name]
  where = (f"from remixer_t5.{new.rsplit('.', 1)[0]} import {new.rsplit('.', 1)[1]} as {name}" if "." in new
           else f"from remixer_t5.{new} import {name}")
  return f"remixer_t5.{name} has moved: write `{where}` (a gin file's bindings such as {name}.X.y stay as they are)"


def __getattr__(name: str):
  if name in MOVED:
    raise ImportError(moved_message(name))
  raise AttributeError(f"module 'remixer_t5' has no attribute {name!r}")
