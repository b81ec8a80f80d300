"""Co-training mixtures across task families (each family's own mixture lives beside its tasks).

``mt_cotrain``: the Remixer paper's "MT" setup (§3.2, after Raffel et al. 2019 §3.7): C4 span corruption
co-trained with GLUE, SuperGLUE (with DPR, as T5's SuperGLUE mixture) and SQuAD, examples-proportional with
T5's artificial dataset-size limit K = 2^19: a task's rate is min(#train examples, K); C4 (365M documents) gets
K. Like T5's ``en_mix`` but with the limit applied to every task. The example counts are fixed numbers, as T5's
(GLUE and SuperGLUE: t5/data/glue_utils.py's weight mappings, ``glue.MIXTURE_RATES`` and
``super_glue.MIXTURE_RATES``; SQuAD: ``SQUAD_TRAIN_EXAMPLES``), so the rates need no data on disk.
"""

from __future__ import annotations

import seqio
from remixer_t5.tasks import c4, glue, squad, super_glue

MT_COTRAIN = "mt_cotrain"
EXAMPLES_LIMIT = 2**19  # T5 §3.7: examples-proportional mixing with K = 2^19
# SQuAD v1.1's training questions (TFDS squad/v1.1 train split): what T5's rate_num_examples reads for
# squad_v010_allanswers in en_mix (t5/data/glue_utils.py has no fixed count for SQuAD).
SQUAD_TRAIN_EXAMPLES = 87_599.0


def mt_cotrain_tasks(maximum: float = EXAMPLES_LIMIT) -> list[tuple[str, float]]:
  """(task, rate) pairs of mt_cotrain: C4 at the limit, each supervised task's training examples (T5's fixed
  counts, no data read) capped at it."""
  counts = {f"glue_{b}": r for b, r in glue.MIXTURE_RATES.items() if r > 0}
  counts.update(super_glue.mixture_rates())
  counts[squad.TASK_NAME] = SQUAD_TRAIN_EXAMPLES
  return [(c4.TASK_NAME, float(maximum))] + [(name, float(min(n, maximum))) for name, n in counts.items()]


def register_mt_cotrain(name: str = MT_COTRAIN, maximum: float = EXAMPLES_LIMIT) -> str:
  """Registers the MT co-training mixture (idempotent)."""
  if name not in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.add(name, mt_cotrain_tasks(maximum))
  return name


register_mt_cotrain()
