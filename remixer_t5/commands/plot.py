"""`remixer-t5 plot`: PNG maps of a checkpoint's token mixing on one input: softmax(H), self-attention and
HyperMixing's pseudo-attention (training/plots.py)."""

from __future__ import annotations

import argparse

import numpy as np

from remixer_t5.commands import common
from remixer_t5.data import vocab as vocab_lib
from remixer_t5.gin_utils import macro
from remixer_t5.training import best, checkpoints, plots


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("checkpoint", help="MODEL_DIR, import-hf output or params checkpoint")
  common.add_step_argument(p)
  p.add_argument("--out", default=".", help="directory for the PNG files (default: current)")
  p.add_argument("--text", help="input text, tokenised with the vocabulary (ends with EOS)")
  p.add_argument("--vocabulary", help="SentencePiece model for --text (default: gin VOCABULARY or embedded)")
  p.add_argument("--input_ids", "--input-ids", help="comma-separated token ids instead of --text")
  p.add_argument("--length", type=int, default=32, help="random input length without --text/--input_ids")
  p.add_argument("--seed", type=int, default=0, help="seed of the random input ids")
  p.add_argument(
    "--pseudo_samples",
    "--pseudo-samples",
    type=int,
    default=0,
    help="0: exact pseudo-attention (n*d gradients); S: estimate from S random probes per token",
  )


def tokens(args: argparse.Namespace, vocab_size: int):
  """(ids, labels): --text through a vocabulary if one is available, else --input_ids, else seeded random ids."""
  if args.text is not None:
    try:
      vocab = (
        vocab_lib.get_vocabulary(args.vocabulary)
        if args.vocabulary
        else macro("VOCABULARY") or vocab_lib.get_vocabulary()
      )
      ids = list(vocab.encode(args.text)) + [1]  # EOS, as encoder inputs end
      piece = getattr(getattr(vocab, "tokenizer", None), "id_to_piece", None)
      labels = [piece(i) if piece and i < vocab.tokenizer.get_piece_size() else str(i) for i in ids]
    except Exception as e:  # noqa: BLE001 - no usable vocabulary: say so and fall back
      common.stderr(
        f"remixer-t5 plot: no vocabulary for --text ({type(e).__name__}: {e}); using "
        f"{'--input_ids' if args.input_ids else f'{args.length} random ids (seed {args.seed})'}"
      )
    else:
      return ids, labels
  ids = (
    [int(t) for t in args.input_ids.replace(" ", ",").split(",") if t]
    if args.input_ids
    else np.random.default_rng(args.seed).integers(3, vocab_size, args.length).tolist()
  )
  return ids, [str(i) for i in ids]


def main(args: argparse.Namespace) -> int:
  common.load_gin(args)
  ckpt = common.checkpoint_arg(args.checkpoint)
  module = common.model_for_checkpoint(ckpt).module
  params = checkpoints.restore_any_params(best.checkpoint_dir(ckpt, args.step))
  ids, labels = tokens(args, module.config.vocab_size)
  if not ids or min(ids) < 0 or max(ids) >= module.config.vocab_size:
    raise ValueError(f"input ids must lie in [0, {module.config.vocab_size}) for this model; got {ids}")
  log = lambda msg: common.stderr(f"remixer-t5 plot: {msg}")
  log(f"{len(ids)} input tokens: {ids}")
  for path in plots.plot_mixing(module, params, [ids], args.out, labels, args.pseudo_samples, log=log):
    print(path)
  return 0
