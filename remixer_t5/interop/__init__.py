"""Interoperation: Hugging Face T5 v1.1 checkpoints and tokenizers (hf.py), t5x's trainer contracts (t5x.py;
t5x's checkpoints are read by training/t5x_checkpoints.py)."""
