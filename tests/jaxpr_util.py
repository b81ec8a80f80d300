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


# A device of each platform a test lowers for, as a topology's mesh carries it (`remixer-t5 compile`).
_DEVICES = {"tpu": ("TPU v4", "tpu"), "cuda": ("NVIDIA H100 80GB HBM3", "gpu")}


def lowered_for(platform: str, fn, *args) -> str:
  """The StableHLO of `jax.jit(fn)` traced for `platform` ('cpu', 'cuda', 'tpu') and lowered for it: for a TPU or
  a GPU under an abstract mesh of one such device, as a program compiled on this host for a slice or a GPU is
  traced (kernels' `auto` reads the platform at trace time); for the CPU as JAX's default backend."""
  import jax

  traced = lambda: jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  if platform not in _DEVICES:
    return traced()
  from jax._src.mesh import AbstractDevice  # (no public constructor in jax 0.10)

  kind, kind_platform = _DEVICES[platform]
  mesh = jax.sharding.AbstractMesh((1,), ("data",), abstract_device=AbstractDevice(kind, None, kind_platform))
  with jax.sharding.use_abstract_mesh(mesh):
    return traced()
