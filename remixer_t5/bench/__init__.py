"""Benchmarks behind `remixer-t5 bench`: one mixing layer against length (mixing.py), the trainer's step beside
Hugging Face's (train.py), decoding beside `generate` (decode.py), the input pipeline (input.py), and the machine
a row was measured on (env.py)."""
