"""seqio task registrations for remixer_t5 (installed as ``remixer_t5.tasks``).

Importing registers the tasks and mixtures and does no other I/O (vocabularies and data are read when a
dataset is built); registering again (a second import or a module reload) is a no-op.

    embedded_span_corruption                 the embedded corpus (smoke tests, `make demo`)
    c4_span_corruption                       C4 (TFDS c4/en:3.1.0 or local shards)
    super_glue_* / super_glue_proportional   SuperGLUE (the mixture with DPR, as T5's)
    dpr                                      DPR (T5's dpr_v001_simple, WSC-format training data)
    glue_* / glue_proportional, squad        GLUE and SQuAD (for the MT co-training mixture)
    mnli, anli_r1..3, conjnli, abductive_nli, qnli   entailment
    cogs                                     COGS
    mt_cotrain                               C4 + GLUE + SuperGLUE + DPR + SQuAD (the Remixer paper's "MT")

Where the data comes from: tasks/sources.py (local release files under $REMIXER_T5_DATA_DIR, else TFDS).
"""

# Each module registers its tasks on import; mixtures imports the tasks it mixes first.
from remixer_t5.tasks import c4, cogs, embedded, glue, mixtures, nli, squad, super_glue  # noqa: F401
from remixer_t5.tasks.embedded import TASK_NAME, register_span_corruption_task  # noqa: F401
