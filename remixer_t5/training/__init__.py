"""Training: the trainer's loop, its state and jitted programs, optimizers, partitioning over a mesh, checkpoints,
evaluation, metrics and plots, and the multi-process start."""
