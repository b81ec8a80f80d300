"""seqio task registrations for remixer_t5 (installed as ``remixer_t5.tasks``).

Importing registers the tasks and does no other I/O; registering again (a
second import or a module reload) is a no-op.
"""

from remixer_t5.tasks import embedded  # noqa: F401  (registers the tasks)
from remixer_t5.tasks.embedded import TASK_NAME, register_span_corruption_task  # noqa: F401
from remixer_t5.tasks import cogs  # noqa: F401  (registers the COGS task)
