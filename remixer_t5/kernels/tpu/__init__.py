"""Kernels for TPUs: Pallas (Mosaic) kernels, used in programs lowered for TPUs."""
