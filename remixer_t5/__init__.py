"""remixer_t5: token-mixing seq2seq models (T5.1.1, MLP-Mixer, Remixer, HyperMixer) in JAX/Flax."""
