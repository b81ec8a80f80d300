"""The context in which a model's FLOPs are counted (`mfu.model_flops_per_step`), for the code that must know.

XLA's cost analysis counts a while loop's body once, a recomputed forward twice and a custom call (an FFI
kernel, a Pallas kernel) not at all. So the model's FLOPs are counted on a lowering of the step traced inside
`counting_model_flops()`, where each such piece takes its plain XLA form: `mixers.base.scan` unrolls its chunks
without their checkpoint, and every operation of kernels/ takes its `xla` implementation. Nothing else runs inside it: a
real step keeps its loops and kernels. It sits below layers and mixers so that both can ask.
"""

from __future__ import annotations

import contextlib
import contextvars

_COUNTING = contextvars.ContextVar("remixer_t5_counting_model_flops", default=False)


@contextlib.contextmanager
def counting_model_flops():
  """Trace inside this to count the model's FLOPs: loops unrolled, kernels and custom calls in XLA's form."""
  token = _COUNTING.set(True)
  try:
    yield
  finally:
    _COUNTING.reset(token)


def counting() -> bool:
  """Whether code is being traced inside `counting_model_flops()`."""
  return _COUNTING.get()
