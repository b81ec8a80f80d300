"""seqio task registrations for remixer_t5 (installed as ``remixer_t5.tasks``).

Importing registers the tasks and mixtures and does no other I/O (vocabularies and data are read when a
dataset is built); registering again (a second import or a module reload) is a no-op. The tasks and mixtures:
docs/data.md, "Tasks" (`remixer-t5 tasks` lists them); where the data comes from: tasks/sources.py.
"""

# Each module registers its tasks on import; mixtures imports the tasks it mixes first.
from remixer_t5.tasks import c4, cogs, embedded, glue, mixtures, nli, squad, super_glue  # noqa: F401
