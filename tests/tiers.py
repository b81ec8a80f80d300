"""The suite's two tiers (tests/conftest.py registers the `integration` marker): parameter lists whose
representatives run in `make test` and whose rest runs in `make test-integration`."""
import pytest


def tiered(values, quick):
  """`values` as parameters: those in `quick` plain, the others marked integration."""
  return [v if v in quick else pytest.param(v, marks=pytest.mark.integration) for v in values]
