"""Kernels for CPUs: fused C++ loops called through XLA's FFI (csrc/), compiled on first use by ffi.py."""
