"""`remixer-t5 export-hf`: a checkpoint (an import-hf output or a MODEL_DIR's step) -> a Hugging Face T5 v1.1
folder, with the run's tokenizer when its vocabulary is known (interop/hf.py)."""

from __future__ import annotations

import argparse
import sys

from remixer_t5.commands import common
from remixer_t5.data import vocab as vocab_lib
from remixer_t5.tasks import lookup as task_lookup
from remixer_t5.gin_utils import macro
from remixer_t5.interop import hf
from remixer_t5.training import best, checkpoints


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("checkpoint")
  common.add_step_argument(p)
  p.add_argument("out_dir")
  p.add_argument(
    "--vocabulary",
    help="SentencePiece model written as the tokenizer (default: the run's gin VOCABULARY, else its task's vocabulary)",
  )


def run_vocabulary(path: str | None):
  """(the run's seqio vocabulary, where it came from): --vocabulary, else the gin VOCABULARY, else the
  vocabulary of the gin's MIXTURE_OR_TASK_NAME; (None, None) when none of them is there."""
  if path:
    return vocab_lib.get_vocabulary(path), path
  vocabulary = macro("VOCABULARY")
  if vocabulary is not None:
    return vocabulary, "the gin VOCABULARY"
  task = macro("MIXTURE_OR_TASK_NAME")
  if task:
    provider = task_lookup.get_mixture_or_task(task)
    return provider.output_features["targets"].vocabulary, f"task {task}"
  return None, None


def main(args: argparse.Namespace) -> int:
  common.load_gin(args)
  ckpt = common.checkpoint_arg(args.checkpoint)
  model = common.model_for_checkpoint(ckpt)
  params = checkpoints.restore_any_params(best.checkpoint_dir(ckpt, args.step))
  vocabulary, source = run_vocabulary(args.vocabulary)
  tokenizer = None
  if vocabulary is not None:
    if vocabulary.vocab_size > model.module.config.vocab_size:
      raise ValueError(
        f"the vocabulary ({source}) has {vocabulary.vocab_size} ids but the model's vocab_size "
        f"is {model.module.config.vocab_size}; pass the run's own --vocabulary"
      )
    tokenizer = hf.vocabulary_tokenizer_files(vocabulary)
  hf.write_hf_checkpoint(args.out_dir, model.module.config, params, tokenizer=tokenizer)
  print(f"wrote Hugging Face T5 v1.1 checkpoint to {args.out_dir}")
  if hf.is_scanned(params):  # write_hf_checkpoint unstacks them: one HF block per layer
    print("the checkpoint's layers were scanned (T5Config.scan_layers): exported unstacked, one block per layer")
  if tokenizer:
    print(
      f"with its tokenizer ({', '.join(tokenizer)}; {vocabulary.vocab_size} ids, {vocabulary.extra_ids} "
      f"sentinels) from {source}"
    )
  else:
    print(
      "no tokenizer written: no vocabulary is known for this checkpoint (no VOCABULARY or "
      "MIXTURE_OR_TASK_NAME in its gin); pass --vocabulary=PATH/TO/sentencepiece.model",
      file=sys.stderr,
    )
  return 0
