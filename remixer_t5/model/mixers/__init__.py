"""Token mixers and feature mixers, one file per paper; `base.py` holds the contract they share."""
