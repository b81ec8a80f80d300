"""remixer_t5: token-mixing seq2seq models (T5.1.1, MLP-Mixer, Remixer, HyperMixer) in JAX/Flax.

Layout: model/ (config, layers, mixers, network, loss and decoding), training/ (trainer, optimizers,
partitioning, checkpoints, evaluation), kernels/ (each platform's faster forms of the model's operations),
data/ and remixer_t5.tasks (seqio), bench/, interop/ (Hugging Face, t5x), repro/ (paper experiments), and the
command line (cli.py dispatching to commands/, one module per command; gin_utils.py, aot_compile.py, compare.py,
info.py, runtime.py).
"""
