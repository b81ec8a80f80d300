"""The suite's two tiers (tests/conftest.py registers the `integration` marker): parameter lists whose
representatives run in `make test` and whose rest runs in `make test-integration`; and the GPU compile tests,
which run where XLA's CUDA compiler plugin is installed (`make test-gpu-compile`, in .venv-gpu)."""

import importlib.util

import pytest


def tiered(values, quick):
  """`values` as parameters: those in `quick` plain, the others marked integration."""
  return [v if v in quick else pytest.param(v, marks=pytest.mark.integration) for v in values]


def _cuda_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    return False


needs_cuda_plugin = pytest.mark.skipif(
  not _cuda_plugin(),
  reason="XLA's CUDA compiler plugin is not installed "
  "(the gpu-compile extra): `make test-gpu-compile` runs these in .venv-gpu",
)
