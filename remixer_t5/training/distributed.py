"""Joining a multi-process run: `jax.distributed.initialize` from flags or the environment.

- explicit: `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`, or the same from
  `$REMIXER_T5_COORDINATOR`, `$REMIXER_T5_NUM_PROCESSES`, `$REMIXER_T5_PROCESS_ID` (launch/slurm.sh sets these);
- automatic: `$REMIXER_T5_DISTRIBUTED=auto` (or `--distributed`) lets JAX detect the cluster (Cloud TPU VM slices,
  SLURM, Open MPI).
On CPU the processes talk through gloo. Without any of these the run is single-process and nothing happens.
"""

from __future__ import annotations

import os

import jax

_initialized = False


def maybe_initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  auto: bool = False,
) -> bool:
  """Initializes JAX's distributed runtime when asked to; returns whether this is a multi-process run."""
  global _initialized
  if _initialized:
    return True
  coordinator_address = coordinator_address or os.environ.get("REMIXER_T5_COORDINATOR")
  auto = auto or os.environ.get("REMIXER_T5_DISTRIBUTED", "").lower() == "auto"
  if not coordinator_address and not auto:
    return False
  # CPU collectives across processes (tests, CPU clusters); no effect on TPU/GPU backends.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if coordinator_address:
    num_processes = num_processes if num_processes is not None else _env_int("REMIXER_T5_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("REMIXER_T5_PROCESS_ID")
    if num_processes is None or process_id is None:
      raise ValueError(
        f"coordinator {coordinator_address!r} given without the number of processes and this "
        "process's id: pass --num_processes and --process_id (or $REMIXER_T5_NUM_PROCESSES and "
        "$REMIXER_T5_PROCESS_ID)"
      )
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must lie in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  else:
    jax.distributed.initialize()
  _initialized = True
  print(
    f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
    f"{jax.device_count()} in all",
    flush=True,
  )
  return True


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} is not an integer") from None
