"""Kernels for GPUs: Pallas (Triton) kernels, used in programs lowered for CUDA GPUs."""
