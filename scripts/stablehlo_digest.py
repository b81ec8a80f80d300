"""The StableHLO of tiny models' train steps, as one sha256 per model: a refactoring that must not change a
program (a move of code, a rename) is checked by running this before and after and comparing the lines.

  python scripts/stablehlo_digest.py [--models t5_1_1,remixer,hypermixer] [--out DIR]

Each model's tiny.gin with runs/pretrain.gin (batch 8), lowered on one CPU device; --out also writes each
module's text (<model>.mlir) for a diff.
"""

import argparse
import hashlib
import pathlib

import jax

from remixer_t5.gin_utils import parse_gin
from remixer_t5.training import partitioning, programs, run_config


def digest(model: str, out: pathlib.Path | None) -> str:
  parse_gin([f"models/{model}/tiny.gin", "runs/pretrain.gin"], ["MODEL_DIR='/tmp/unused'", "BATCH_SIZE=8"])
  run = run_config.from_gin()
  partitioner = partitioning.partitioner(run.training.mesh, jax.devices()[:1])
  prog = programs.from_run(run.training, run.data.feature_lengths, partitioner)
  text = prog.lower(prog.train_step, prog.state, prog.batch(run.data.batch_size, run.data.pack)).as_text()
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{model}.mlir").write_text(text)
  return hashlib.sha256(text.encode()).hexdigest()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="t5_1_1,remixer,hypermixer")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  for model in args.models.split(","):
    print(model, digest(model, args.out), flush=True)


if __name__ == "__main__":
  main()
