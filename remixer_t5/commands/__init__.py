"""The `remixer-t5` commands, one module each. A command module has `add_arguments(parser)`, which adds the
flags that command reads and no other, and `main(args) -> int`; `COMMANDS` below names it, and
`remixer_t5/cli.py` imports it only when it is the command given, so what it imports is loaded by that command
alone. `common.py` holds what several commands share: parsing the gin flags, the run they configure, checkpoint
arguments. The `bench` and `repro` groups' subcommands follow the same contract in bench/ and repro/. This module
imports none of them.
"""

from typing import NamedTuple

# The gin flags of the commands that take them (`Command.gin`), as every such --help ends.
GIN_FLAGS = """gin flags (t5x's; any number, anywhere on the line):
  --gin_file=F          repeatable; looked up as given, then in --gin_search_paths, then in the package's gin/
                        (a model, e.g. models/t5_1_1/small.gin, then a run, e.g. runs/pretrain.gin)
  --gin.NAME=VALUE      a binding applied after the files (`--gin.MODEL_DIR="'/tmp/run'"`, `--gin.BATCH_SIZE=8`)
  --gin_search_paths=A,B
"""


class Command(NamedTuple):
  module: str  # with add_arguments(parser) and main(args)
  help: str
  gin: bool = True  # takes the gin flags
  runs: bool = False  # runs steps on this host: its allocator is configured first (runtime.configure)


def _bench(kind: str, help: str, gin: bool = False) -> Command:
  return Command(f"remixer_t5.bench.{kind}", help, gin, runs=True)


def _repro(name: str, help: str) -> Command:
  return Command(f"remixer_t5.repro.{name}", help, gin=False, runs=True)


COMMANDS = {
  "train": Command("remixer_t5.commands.train", "train (resumes from MODEL_DIR)", runs=True),
  "eval": Command(
    "remixer_t5.commands.eval",
    "evaluate the latest checkpoint in MODEL_DIR (a training run, an "
    "import-hf output or a t5x checkpoint): validation loss, and the task's metrics on decoded "
    "outputs (seqio Evaluator; JSON + TensorBoard in MODEL_DIR/inference_eval)",
    runs=True,
  ),
  "infer": Command(
    "remixer_t5.commands.infer",
    "predictions of a checkpoint (MODEL_DIR or --checkpoint: a training "
    "run, an import-hf output or a t5x checkpoint) for a task's split or a file of inputs, as JSONL",
    runs=True,
  ),
  "compare": Command(
    "remixer_t5.commands.compare",
    "several runs side by side: loss against step and tokens seen, "
    "best validation loss, parameters, tokens/s, task metrics (compare.png, .md, .csv under "
    "--out)",
    gin=False,
  ),
  "compile": Command(
    "remixer_t5.commands.compile",
    "compile the train step (same gin flags as train) for a TPU "
    "slice or GPUs on this host, no TPU or GPU needed: memory per device against HBM, FLOPs, "
    "estimated step time",
  ),
  "sweep": Command(
    "remixer_t5.sweep",
    "train every point of a grid of gin settings at each seed (a folder per "
    "point, resumable), then tabulate the metrics over seeds: mean, std, t interval at 95 per cent, Welch's "
    "t-test (sweep.csv, sweep.md, sweep.png)",
  ),
  "tasks": Command(
    "remixer_t5.commands.tasks", "list registered tasks and mixtures, or show NAME's preprocessed examples"
  ),
  "info": Command("remixer_t5.commands.info", "parameter count, per-module breakdown, FLOPs per token"),
  "import-hf": Command(
    "remixer_t5.commands.import_hf", "Hugging Face T5 v1.1 dir -> orbax checkpoint + model.gin", gin=False
  ),
  "export-hf": Command(
    "remixer_t5.commands.export_hf", "checkpoint (import-hf output or MODEL_DIR) -> Hugging Face dir"
  ),
  "plot": Command(
    "remixer_t5.commands.plot", "PNG maps of softmax(H), self-attention and HyperMixing pseudo-attention", runs=True
  ),
  "bench": {
    "mixing": _bench("mixing", "fwd+bwd time and FLOPs of one token-mixing layer against length"),
    "input": _bench(
      "input",
      "the training input pipeline (same gin flags as train) per process, its restore "
      "time, and whether a host keeps up",
      gin=True,
    ),
    "train": _bench(
      "train",
      "the jitted train step on random tokens (same gin flags as train), optionally "
      "beside HF transformers' PyTorch T5 or another commit",
      gin=True,
    ),
    "decode": _bench(
      "decode",
      "greedy and beam-search decoding of random inputs through the evaluator's "
      "decode, every position (same gin flags as train), optionally beside HF's generate",
      gin=True,
    ),
    "kernels": _bench("kernels", "each kernel against plain JAX in the train steps it exists for (the 1.2x rule)"),
    "drift": _bench(
      "drift",
      "one workload's steps with a field at auto and at xla, from the same state: "
      "rounding or a fault (docs/benchmarks.md)",
    ),
  },
  "repro": {
    "hypermixer-synthetic": _repro(
      "hypermixer_synthetic", "HyperMixer §4.7, Fig. 5: test MSE against training-set size and pseudo-attention maps"
    ),
    "cogs": _repro(
      "cogs",
      "Remixer paper §3.4: each model trained from scratch on COGS, exact match on dev, test and every gen category",
    ),
    "cogs-curve": _repro(
      "cogs_curve", "one COGS run with a checkpoint every --every steps, each decoded: exact match against steps"
    ),
  },
}
GROUPS = {
  "bench": "measurements (JSON rows with --json; docs/benchmarks.md)",
  "repro": "reproduce a paper experiment on a CPU",
}
