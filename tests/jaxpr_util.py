"""Walking jaxprs in tests (imported by the test modules beside it)."""


def eqns_in(jaxpr):
  """Every equation of a jaxpr, nested jaxprs (scan, cond, remat, pjit) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from eqns_in(sub)
