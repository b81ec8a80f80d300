"""Interoperation: Hugging Face T5 v1.1 checkpoints and tokenizers (hf.py), t5x's model and checkpoint
contracts (t5x.py)."""
