"""A tiny finetune end to end: pretrain a few steps, finetune on COGS rows from INIT_CHECKPOINT, decode with the
seqio Evaluator during training and with `remixer-t5 eval`, metrics written as JSON, TensorBoard and metrics.jsonl."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from remixer_t5.training import checkpoints
from remixer_t5 import cli

TINY = [
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin.network.T5Config.emb_dim=32",
  "--gin.network.T5Config.mlp_dim=48",
  "--gin.network.T5Config.num_encoder_layers=1",
  "--gin.network.T5Config.num_decoder_layers=1",
]
COGS = [
  *TINY,
  "--gin_file=runs/cogs.gin",
  "--gin.VOCABULARY=@vocab.get_vocabulary()",
  "--gin.BATCH_SIZE=2",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 24}",
  "--gin.LOG_PERIOD=2",
  "--gin.EVAL_PERIOD=4",
  "--gin.CHECKPOINT_PERIOD=4",
  "--gin.EVAL_STEPS=1",
  "--gin.TRAIN_STEPS=4",
]
ROWS = {
  "train.tsv": [
    ("A cat smiled .", "cat ( x _ 1 ) AND smile . agent ( x _ 2 , x _ 1 )", "in_distribution"),
    ("Emma slept .", "sleep . agent ( x _ 1 , Emma )", "in_distribution"),
    ("The dog ran .", "* dog ( x _ 1 ) ; run . agent ( x _ 2 , x _ 1 )", "in_distribution"),
  ],
  "dev.tsv": [
    ("Liam slept .", "sleep . agent ( x _ 1 , Liam )", "in_distribution"),
    ("A boy ran .", "boy ( x _ 1 ) AND run . agent ( x _ 2 , x _ 1 )", "in_distribution"),
    ("Mia smiled .", "smile . agent ( x _ 1 , Mia )", "in_distribution"),
  ],
  "test.tsv": [("Noah ran .", "run . agent ( x _ 1 , Noah )", "in_distribution")],
  "gen.tsv": [
    ("A hedgehog slept .", "hedgehog ( x _ 1 ) AND sleep . agent ( x _ 2 , x _ 1 )", "subj_to_obj_common"),
    ("Paula slept .", "sleep . agent ( x _ 1 , Paula )", "prim_to_subj_proper"),
    ("Paula ran .", "run . agent ( x _ 1 , Paula )", "prim_to_subj_proper"),
  ],
}


def _rows(model_dir):
  return [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_cache):
  root = tmp_path_factory.mktemp("finetune")
  data = root / "data" / "cogs"
  data.mkdir(parents=True)
  for name, rows in ROWS.items():
    (data / name).write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
  mp = pytest.MonkeyPatch()
  mp.setenv("REMIXER_T5_CACHE_DIR", str(embedded_cache.root))
  mp.delenv("REMIXER_T5_DATA_DIR", raising=False)
  pre = [
    *TINY,
    "--gin_file=runs/demo.gin",
    "--gin.BATCH_SIZE=2",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
    "--gin.EVAL_PERIOD=0",
    "--gin.CHECKPOINT_PERIOD=2",
    "--gin.TRAIN_STEPS=2",
  ]
  assert cli.main(["train", *pre, f"--gin.MODEL_DIR='{root / 'pre'}'"]) == 0
  assert (
    cli.main(
      [
        "train",
        *COGS,
        f"--gin.MODEL_DIR='{root / 'ft'}'",
        f"--gin.DATA_DIR='{root / 'data'}'",
        f"--gin.INIT_CHECKPOINT='{root / 'pre'}'",
      ]
    )
    == 0
  )
  yield root
  mp.undo()


def test_finetune_decodes_and_scores_validation_during_training(runs):
  infer = [r for r in _rows(runs / "ft") if r["split"].startswith("infer/")]
  assert [r["step"] for r in infer] == [4]
  assert infer[0]["split"].startswith("infer/cogs") and 0 <= infer[0]["exact_match"] <= 100
  assert 0 <= infer[0]["accuracy_in_distribution"] <= 100
  out = runs / "ft" / "inference_eval"
  metrics_files = list(out.glob("*-metrics.jsonl"))
  assert len(metrics_files) == 1
  logged = json.loads(metrics_files[0].read_text().splitlines()[-1])
  logged_em = logged["exact_match"]
  logged_em = logged_em["value"] if isinstance(logged_em, dict) else logged_em
  assert logged["step"] == 4 and logged_em == pytest.approx(infer[0]["exact_match"])
  predictions = [json.loads(line) for line in next(out.glob("*-000004.jsonl")).read_text().splitlines()]
  assert len(predictions) == len(ROWS["dev.tsv"])
  assert {p["input"]["inputs_pretokenized"] for p in predictions} == {r[0] for r in ROWS["dev.tsv"]}
  assert all(isinstance(p["prediction"], str) for p in predictions)
  assert any(out.rglob("events.out.tfevents*"))


def test_eval_command_scores_the_gen_split_per_category(runs, capsys):
  rc = cli.main(
    [
      "eval",
      *COGS,
      f"--gin.MODEL_DIR='{runs / 'ft'}'",
      f"--gin.DATA_DIR='{runs / 'data'}'",
      "--gin.trainer.evaluate_checkpoint.infer_split='gen'",
    ]
  )
  assert rc == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  (task,) = [k for k in result if k.startswith("cogs")]
  scores = result[task]
  assert set(scores) == {"exact_match", "accuracy_subj_to_obj_common", "accuracy_prim_to_subj_proper"}
  # The overall score is the example-weighted mean of the per-category scores (1 and 2 examples).
  assert scores["exact_match"] == pytest.approx(
    (scores["accuracy_subj_to_obj_common"] + 2 * scores["accuracy_prim_to_subj_proper"]) / 3
  )
  assert np.isfinite(result["validation"]["loss"])


def test_finetune_started_from_the_pretrained_params_with_a_fresh_step(runs):
  pre = checkpoints.restore_any_params(runs / "pre")
  abstract = jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), pre
  )
  again = checkpoints.restore_init_params(runs / "pre", abstract)
  jax.tree_util.tree_map(np.testing.assert_array_equal, pre, again)
  steps = [r["step"] for r in _rows(runs / "ft") if r["split"] == "train"]
  assert steps == [2, 4]  # counted from 0, not from the pretraining run's step 2
  bad = dict(abstract)
  bad["extra"] = abstract["encoder"] if "encoder" in abstract else next(iter(abstract.values()))
  with pytest.raises(ValueError, match="missing"):
    checkpoints.restore_init_params(runs / "pre", bad)


def test_rerunning_a_finetune_resumes_it_instead_of_reinitialising(runs, capsys):
  args = [a if a != "--gin.TRAIN_STEPS=4" else "--gin.TRAIN_STEPS=6" for a in COGS]
  rc = cli.main(
    [
      "train",
      *args,
      f"--gin.MODEL_DIR='{runs / 'ft'}'",
      f"--gin.DATA_DIR='{runs / 'data'}'",
      f"--gin.INIT_CHECKPOINT='{runs / 'pre'}'",
      "--gin.run_config.Schedule.infer_eval_period=0",
    ]
  )
  assert rc == 0
  out = capsys.readouterr().out
  assert f"resumed from {runs / 'ft' / 'checkpoints'}/4" in out and "initialised params" not in out
  assert [r["step"] for r in _rows(runs / "ft") if r["split"] == "train"] == [2, 4, 6]


def test_predict_fn_groups_batches_by_length_and_keeps_each_output_with_its_example(monkeypatch):
  """make_predict_fn decodes examples sorted by input length (batches of like lengths) but every output is
  returned with its own example index, and the generated-token count covers exactly the real examples."""
  import tensorflow as tf
  from remixer_t5.training import evaluation

  class Echo:  # "decodes" its input: the output is the input tokens (EOS included), so pairing is checkable
    pass

  batches = []

  def fake_jit(model, beam):
    def predict(params, enc, length):
      batches.append(np.count_nonzero(np.asarray(enc), axis=1))
      return np.asarray(enc)[:, :length]

    return predict

  monkeypatch.setattr(evaluation.programs, "jit_decode", fake_jit)
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 12, size=23)
  enc = np.zeros((23, 12), np.int32)
  for i, n in enumerate(lengths):
    enc[i, : n - 1] = rng.integers(3, 50, size=n - 1)
    enc[i, n - 1] = 1
  ds = tf.data.Dataset.from_tensor_slices(
    (np.arange(23), {"encoder_input_tokens": enc, "decoder_target_tokens": np.zeros((23, 12), np.int32)})
  )
  stats = {}
  decoding = evaluation.Decoding(5, put=np.asarray, fetch=np.asarray, stats=stats)
  out = evaluation.make_predict_fn(Echo(), None, decoding)(ds)
  assert sorted(i for i, _ in out) == list(range(23))
  for i, ids in out:
    np.testing.assert_array_equal(ids, enc[i])
  # Batches hold like lengths: each batch's shortest real row is no shorter than the previous batch's longest.
  real = [b[b > 0] for b in batches]
  assert all(a.max() <= b.min() for a, b in zip(real, real[1:]))
  assert stats["examples"] == 23 and stats["tokens"] == int(lengths.sum())
