"""`remixer-t5 import-hf`: a Hugging Face T5 v1.1 folder -> an orbax params checkpoint and the model.gin that
builds it (interop/hf.py)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import jax

from remixer_t5 import storage
from remixer_t5.interop import hf
from remixer_t5.training import checkpoints


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("hf_dir")
  p.add_argument("out_dir")


def model_gin(cfg, source: str = "") -> str:
  """A standalone model gin file for a T5Config."""
  lines = [
    f"# T5.1.1 model imported from {source}" if source else "# T5.1.1 model",
    "from __gin__ import dynamic_registration",
    "from remixer_t5.model import models",
    "from remixer_t5.model import network",
    "",
    "MODEL = @models.EncoderDecoderModel()",
    "models.EncoderDecoderModel.module = @network.Transformer()",
    "network.Transformer.config = @network.T5Config()",
  ]
  lines += [f"network.T5Config.{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)]
  return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
  out = storage.run_path(args.out_dir)
  storage.check_bucket(out, "OUT_DIR")
  if out.exists() and not out.is_dir():
    raise NotADirectoryError(f"OUT_DIR {out} is a file; expected a new folder")
  if out.exists() and any(out.iterdir()):
    unfinished = storage.is_bucket(out) and not (out / "model.gin").exists()
    raise FileExistsError(
      f"{out} exists and is not empty"
      + (" (an unfinished import: no model.gin; delete it)" if unfinished else "")
      + "; choose a new OUT_DIR"
    )
  module, params = hf.load_hf_t5(args.hf_dir)
  gin_text = model_gin(module.config, source=str(args.hf_dir))
  if storage.is_bucket(out):  # no folder rename: orbax's commit marker, then model.gin, written last, whole
    try:
      checkpoints.save_params(out / "checkpoint", params)
      storage.write_text(out / "model.gin", gin_text)
    except BaseException:
      storage.remove_tree(out)  # nothing half-written is left behind
      raise
  else:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    checkpoints.save_params(tmp / "checkpoint", params)
    (tmp / "model.gin").write_text(gin_text)
    tmp.replace(out)  # onto an empty OUT_DIR too
  n = sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
  print(f"wrote {out}/checkpoint ({n:,} params) and {out}/model.gin")
  return 0
