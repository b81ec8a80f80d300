"""Make tests/fixtures/hf_t5_v1_1_tiny.npz: a random tiny Hugging Face T5 v1.1 with its inputs and outputs.

Needs the optional `hf` extra (torch + transformers), never CI:

  python3 -m venv .venv-hf
  .venv-hf/bin/pip install /path/to/torch-...+cpu-...whl transformers numpy
  .venv-hf/bin/python scripts/make_hf_fixture.py --out tests/fixtures/hf_t5_v1_1_tiny.npz

The model is `T5ForConditionalGeneration(T5Config(feed_forward_proj="gated-gelu", ...))` with an untied
`lm_head` (T5 v1.1), random weights (layer norm scales and relative position biases perturbed too, so that a
wrong mapping of them shows), float32, eval mode. Inputs: batch 2, encoder length 150 (> 128, the relative
position max distance), decoder length 20 (> 16 exact buckets of the decoder); the second row of each side is
padded.

The .npz holds
  w/<name>                 every weight under its HF state_dict name (tied copies of shared.weight left out)
  config_json              the model's config (`config.to_json_string()`)
  transformers_version, torch_version
  encoder_input_tokens     [2, 150] int32, 0 at padding
  encoder_attention_mask   [2, 150] int32
  decoder_input_tokens     [2, 20] int32, labels shifted right with start id 0, 0 at padding
  decoder_target_tokens    [2, 20] int32, the labels with 0 at padding (HF: -100)
  decoder_attention_mask   [2, 20] int32
  encoder_output           [2, 150, 32] float32, the encoder's last hidden state
  logits                   [2, 20, vocab] float32
  loss                     float32 scalar, HF's mean cross entropy over non-padding labels

With `--save-pretrained DIR` the model is also written as an HF checkpoint directory.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import transformers
from transformers import T5Config, T5ForConditionalGeneration

SEED = 20240611
REAL_VOCAB = 60  # ids actually used; vocab_size is rounded up to a multiple of 32 (T5: 32100 -> 32128)
VOCAB_MULTIPLE = 32
ENC_LEN, DEC_LEN = 150, 20
ENC_VALID = (ENC_LEN, 97)  # non-padding length of each row
DEC_VALID = (DEC_LEN, 13)


def build_model() -> T5ForConditionalGeneration:
  torch.manual_seed(SEED)
  vocab = -(-REAL_VOCAB // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  config = T5Config(
      vocab_size=vocab, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=3,
      relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
      layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  model = T5ForConditionalGeneration(config).float().eval()

  gen = torch.Generator().manual_seed(SEED + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
      elif "relative_attention_bias" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
    # transformers 5.x builds T5 with lm_head tied to shared.weight (its config forces tie_word_embeddings
    # True and reads the v1.1 "no scaling" from scale_decoder_outputs); 4.x with tie_word_embeddings=False
    # already has a separate lm_head. Either way give lm_head its own random weights.
    lm_head = 0.5 * torch.randn(model.lm_head.weight.shape, generator=gen)
    model.lm_head.weight = torch.nn.Parameter(lm_head)
    if hasattr(model, "all_tied_weights_keys"):  # 5.x bookkeeping of tied parameters
      model.all_tied_weights_keys.pop("lm_head.weight", None)
  if model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr():
    raise RuntimeError("lm_head is still tied to shared.weight")
  if getattr(model.config, "scale_decoder_outputs", False):
    raise RuntimeError("this transformers version would scale decoder outputs: not T5 v1.1")
  return model


def make_inputs(vocab_used: int):
  rng = np.random.default_rng(SEED)
  enc = np.zeros((2, ENC_LEN), np.int64)
  labels = np.full((2, DEC_LEN), -100, np.int64)
  for row in range(2):
    enc[row, :ENC_VALID[row]] = rng.integers(2, vocab_used, ENC_VALID[row])
    enc[row, ENC_VALID[row] - 1] = 1  # EOS
    labels[row, :DEC_VALID[row]] = rng.integers(2, vocab_used, DEC_VALID[row])
    labels[row, DEC_VALID[row] - 1] = 1
  enc_mask = (enc != 0).astype(np.int64)
  dec_mask = (labels != -100).astype(np.int64)
  targets = np.where(labels == -100, 0, labels)
  dec_in = np.zeros_like(targets)  # shift right, start id 0 (T5's _shift_right)
  dec_in[:, 1:] = targets[:, :-1]
  return enc, enc_mask, labels, targets, dec_in, dec_mask


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="tests/fixtures/hf_t5_v1_1_tiny.npz")
  parser.add_argument("--save-pretrained", metavar="DIR", help="also write an HF checkpoint directory")
  args = parser.parse_args(argv)

  model = build_model()
  enc, enc_mask, labels, targets, dec_in, dec_mask = make_inputs(REAL_VOCAB)
  t = lambda a: torch.from_numpy(a)
  with torch.no_grad():
    out = model(input_ids=t(enc), attention_mask=t(enc_mask), decoder_input_ids=t(dec_in),
                decoder_attention_mask=t(dec_mask), labels=t(labels))

  state = model.state_dict()
  shared = state["shared.weight"]
  weights = {}
  for name, value in state.items():
    if name != "shared.weight" and name.endswith("embed_tokens.weight") and torch.equal(value, shared):
      continue  # tied copy of shared.weight
    weights[f"w/{name}"] = value.detach().float().numpy()

  arrays = dict(
      weights,
      config_json=np.array(model.config.to_json_string()),
      transformers_version=np.array(transformers.__version__),
      torch_version=np.array(torch.__version__),
      encoder_input_tokens=enc.astype(np.int32),
      encoder_attention_mask=enc_mask.astype(np.int32),
      decoder_input_tokens=dec_in.astype(np.int32),
      decoder_target_tokens=targets.astype(np.int32),
      decoder_attention_mask=dec_mask.astype(np.int32),
      encoder_output=out.encoder_last_hidden_state.float().numpy(),
      logits=out.logits.float().numpy(),
      loss=np.asarray(out.loss.item(), np.float32),
  )
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  tmp = args.out + ".tmp.npz"
  np.savez_compressed(tmp, **arrays)
  os.replace(tmp, args.out)
  print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes, {len(weights)} weights, "
        f"transformers {transformers.__version__}, loss {out.loss.item():.6f})")

  if args.save_pretrained:
    model.save_pretrained(args.save_pretrained)
    print(f"wrote {args.save_pretrained}: {sorted(os.listdir(args.save_pretrained))}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
