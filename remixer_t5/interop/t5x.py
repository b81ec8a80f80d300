"""t5x interop: t5x's trainer runs `network.Transformer` (gin/t5x/); training/t5x_checkpoints.py reads t5x's
checkpoints. t5x (github.com/google-research/t5x) is installed from source, never by this package: the functions
that need it import it lazily."""

from __future__ import annotations

from flax.core import freeze

from remixer_t5.training import partitioning

# Adafactor factorisation of the logical axes our mixers add to t5x's (t5x's `adafactor.FactorDim` member
# names). Rows and columns as for a dense kernel (input ROW, output COLUMN); t5x falls back to its size
# heuristic for parameters of rank <= 2 anyway, but it needs a rule for every axis name it meets.
FACTOR_RULES = {"mix_length": "ROW", "mix_source": "COLUMN", "mix_hidden": "COLUMN", "projection": "COLUMN"}


# --- t5x's trainer (bound in gin/t5x/model.gin) ---------------------------------------------------------
def logical_factor_rules():
  """t5x's `adafactor.standard_logical_factor_rules()` plus `FACTOR_RULES` (needs t5x)."""
  from t5x import adafactor

  rules = dict(adafactor.standard_logical_factor_rules())
  rules.update({name: adafactor.FactorDim[dim] for name, dim in FACTOR_RULES.items()})
  return freeze(rules)


def logical_axis_rules() -> list[tuple[str, str | None]]:
  """The rules of `partitioning.DEFAULT_RULES` for logical axes t5x's standard rules do not name (needs t5x).

  For `partitioning.standard_logical_axis_rules.additional_rules`, so our mixers' weights shard in t5x as they
  do here (all of them replicated today)."""
  from t5x import partitioning as t5x_partitioning

  # additional_rules=None explicitly: were the function gin-decorated, its binding (this function) would recurse.
  known = {name for name, _ in t5x_partitioning.standard_logical_axis_rules(additional_rules=None)}
  return [(name, axis) for name, axis in partitioning.DEFAULT_RULES if name not in known]
