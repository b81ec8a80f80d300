"""The registry as users meet it: every task and mixture the spec names, `remixer-t5 tasks`, mixtures'
composition and rates, and vocabulary-swapped copies (remixer_t5.data.task_lookup)."""

import pytest
import seqio

import remixer_t5.tasks  # noqa: F401
from remixer_t5 import cli
from remixer_t5.tasks import lookup as task_lookup
from remixer_t5.tasks import mixtures

SPEC_TASKS = (
  [
    "c4_span_corruption",
    "cogs",
    "mnli_matched",
    "mnli_mismatched",
    "anli_r1",
    "anli_r2",
    "anli_r3",
    "conjnli",
    "abductive_nli",
    "qnli",
    "squad",
  ]
  + [f"super_glue_{t}" for t in ("boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc", "axb", "axg")]
  + ["dpr"]
)
SPEC_MIXTURES = ["super_glue_proportional", "mt_cotrain", "mnli"]


def test_every_task_and_mixture_the_spec_names_is_registered(capsys):
  assert cli.main(["tasks"]) == 0
  out = capsys.readouterr().out
  for name in SPEC_TASKS + SPEC_MIXTURES:
    assert f"  {name} " in out, name
  assert set(SPEC_TASKS) <= set(seqio.TaskRegistry.names())
  assert set(SPEC_MIXTURES) <= set(seqio.MixtureRegistry.names())


def test_tasks_command_shows_preprocessed_examples_as_text_and_ids(tmp_path, capsys, embedded_env):
  cogs = tmp_path / "cogs"
  cogs.mkdir()
  for split in ("train", "dev", "test", "gen"):
    (cogs / f"{split}.tsv").write_text(
      "A cat smiled .\tcat ( x _ 1 ) AND smile . agent ( x _ 2 , x _ 1 )\tin_distribution\n", encoding="utf-8"
    )
  from remixer_t5.data import vocab
  from remixer_t5.tasks import cogs as cogs_module

  cogs_module.register_cogs_task("cogs_registry_test", vocab.get_vocabulary())
  assert cli.main(["tasks", "cogs_registry_test", "--data_dir", str(tmp_path), "-n", "1"]) == 0
  out = capsys.readouterr().out
  assert "-- example 0" in out and "-- example 1" not in out
  assert "inputs_pretokenized: A cat smiled ." in out
  ids_line = next(line for line in out.splitlines() if line.strip().startswith("inputs ids:"))
  ids = [int(t) for t in ids_line.split(":", 1)[1].strip(" []").split(",")]
  assert ids[-1] == 1 and vocab.get_vocabulary().decode(ids) == "A cat smiled ."


def test_tasks_command_names_an_unknown_task(capsys):
  assert cli.main(["tasks", "no_such_task"]) == 2
  err = capsys.readouterr().err
  assert "no_such_task" in err and "cogs" in err


# The reference: T5's fixed example counts, copied from t5/data/glue_utils.py (google-research/
# text-to-text-transfer-transformer) GLUE_WEIGHT_MAPPING and SUPER_GLUE_WEIGHT_MAPPING (rate-0 eval-only entries
# left out); SQuAD v1.1's 87,599 training questions (TFDS squad/v1.1, what T5's rate_num_examples reads for it).
T5_COUNTS = {
  "glue_cola_v002": 8_551.0,
  "glue_sst2_v002": 67_349.0,
  "glue_mrpc_v002": 3_668.0,
  "glue_qqp_v002": 363_849.0,
  "glue_stsb_v002": 5_749.0,
  "glue_mnli_v002": 392_702.0,
  "glue_qnli_v002": 104_743.0,
  "glue_rte_v002": 2_490.0,
  "dpr_v001_simple": 1_322.0,
  "super_glue_wsc_v102_simple_train": 259.0,
  "super_glue_boolq_v102": 9_427.0,
  "super_glue_cb_v102": 250.0,
  "super_glue_copa_v102": 400.0,
  "super_glue_multirc_v102": 27_243.0,
  "super_glue_record_v102": 138_854.0,
  "super_glue_rte_v102": 2_490.0,
  "super_glue_wic_v102": 5_428.0,
  "squad_v010_allanswers": 87_599.0,
}


def _our_name(t5_name):
  if t5_name == "dpr_v001_simple":
    return "dpr"
  if t5_name == "squad_v010_allanswers":
    return "squad"
  if t5_name == "super_glue_wsc_v102_simple_train":
    return "super_glue_wsc"
  return t5_name.rsplit("_v", 1)[0]  # glue_cola_v002 -> glue_cola, super_glue_boolq_v102 -> super_glue_boolq


def test_mt_cotrain_rates_are_t5s_counts_with_the_limit(tmp_path, monkeypatch):
  from remixer_t5.tasks import sources

  monkeypatch.setattr(sources, "_data_dir_override", None)
  monkeypatch.setenv("REMIXER_T5_DATA_DIR", str(tmp_path / "nothing_here"))  # the rates need no data
  mix = seqio.get_mixture_or_task("mt_cotrain")
  rates = {t.name: mix.get_rate(t) for t in mix.tasks}
  expected = {_our_name(k): min(v, 2**19) for k, v in T5_COUNTS.items()}
  expected["c4_span_corruption"] = 2**19  # T5 §3.7's K
  assert rates == expected
  assert mixtures.EXAMPLES_LIMIT == 2**19
  assert "glue_mnli_matched" not in rates and "super_glue_axb" not in rates  # eval-only tasks are not mixed
  # C4's share: K over K + the supervised examples (ReCoRD counted per answer, as T5, not per query).
  share = rates["c4_span_corruption"] / sum(rates.values())
  assert share == pytest.approx(2**19 / (2**19 + sum(T5_COUNTS.values())))
  capped = dict(mixtures.mt_cotrain_tasks(maximum=100_000))
  assert capped["glue_mnli"] == capped["c4_span_corruption"] == 100_000 and capped["glue_rte"] == 2_490
  assert (
    mix.output_features["targets"].vocabulary
    == seqio.get_mixture_or_task("squad").output_features["targets"].vocabulary
  )


def test_a_mixture_with_another_vocabulary_is_a_registered_copy_with_the_same_rates(embedded_env):
  from remixer_t5.data import vocab

  v = vocab.get_vocabulary()
  name = task_lookup.with_vocabulary("mnli", v)
  assert name != "mnli" and name.startswith("mnli#")
  copy, original = seqio.get_mixture_or_task(name), seqio.get_mixture_or_task("mnli")
  assert len(copy.tasks) == len(original.tasks) == 2
  for task in copy.tasks:
    assert task.output_features["targets"].vocabulary == v
    assert task.name.split("#")[0] in {t.name for t in original.tasks}
    assert copy.get_rate(task) == original.get_rate(seqio.get_mixture_or_task(task.name.split("#")[0]))
  assert task_lookup.with_vocabulary("mnli", v) == name  # asking again reuses the copy
  assert task_lookup.with_vocabulary("mnli", None) == "mnli"


def test_mt_cotrain_gin_uses_dropout_and_decodes_super_glue_like_the_finetune_runs():
  import gin

  from remixer_t5 import gin_utils

  def bound(name):  # a binding's value, its macro resolved
    value = gin.query_parameter(name)
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
      return gin_utils.macro(value.config_key[0])
    return value

  gin_utils.parse_gin(["models/t5_1_1/base.gin", "runs/mt_cotrain.gin"], ["MODEL_DIR='/tmp/unused'"])
  assert bound("remixer_t5.training.run_config.Data.task") == "mt_cotrain"
  assert bound("remixer_t5.model.network.T5Config.dropout_rate") == 0.1  # Remixer paper §3.2; pretraining's is 0.0
  assert bound("remixer_t5.training.run_config.Schedule.infer_eval_task") == "super_glue_proportional"
  assert (
    bound("remixer_t5.training.run_config.Schedule.infer_eval_period")
    == bound("remixer_t5.training.run_config.Schedule.eval_period")
    > 0
  )
  assert (
    bound("remixer_t5.training.run_config.Schedule.infer_examples") is None
  )  # every validation example, as finetune.gin
  assert bound("remixer_t5.training.run_config.Schedule.train_steps") == 1_000_000
  gin_utils.parse_gin(["models/t5_1_1/base.gin", "runs/pretrain.gin"], ["MODEL_DIR='/tmp/unused'"])
  assert bound("remixer_t5.model.network.T5Config.dropout_rate") == 0.0  # what mt_cotrain.gin used to inherit
  gin.clear_config()
