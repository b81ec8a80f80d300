"""The model: T5Config (config.py), layers, the mixers of each paper (mixers/), the network that stacks them, the
encoder-decoder model's loss and decoding, and fixed-length mixers' lengths. Plain JAX/flax on every platform;
faster kernels come in through remixer_t5/kernels/ by name."""
