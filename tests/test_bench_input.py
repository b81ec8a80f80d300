"""`remixer-t5 bench input`: the trainer's input function measured per process, with a restore at --position."""

import json

import pytest

from remixer_t5 import cli

ARGS = [
  "bench",
  "input",
  "--gin_file=models/t5_1_1/tiny.gin",
  "--gin_file=runs/demo.gin",
  "--gin.BATCH_SIZE=4",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
  "--batches=4",
  "--warmup=1",
  "--hosts=2",
]


def test_json_report_fields(embedded_env, capsys):
  assert cli.main([*ARGS, "--position=5", "--steps_per_s=9", "--json"]) == 0
  r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert r["task"] == "embedded_span_corruption" and r["feature_lengths"] == {"inputs": 32, "targets": 8}
  assert r["process_index"] == 0 and r["process_count"] == 2 and r["hosts"] == 2
  assert r["rows_per_batch"] == 2 and r["batches"] == 4 and r["pack"] is True
  assert r["rows_per_s"] == pytest.approx(r["batches_per_s"] * 2)
  assert r["examples_per_s"] >= r["rows_per_s"]  # packed rows hold one or more examples
  assert 0 < r["tokens_per_s"] <= r["padded_tokens_per_s"]
  assert r["padded_tokens_per_s"] == pytest.approx(r["rows_per_s"] * (32 + 8))
  assert r["rows_per_s_needed"] == pytest.approx(9 * 4 / 2)  # steps/s x global batch / hosts
  assert r["keeps_up"] == (r["rows_per_s"] >= r["rows_per_s_needed"])
  assert r["headroom"] == pytest.approx(r["rows_per_s"] / r["rows_per_s_needed"])
  assert r["position"] == 5 and r["restored_batch_matches"] is True
  assert r["state_bytes"] > 0 and r["restore_s"] > 0 and r["reach_s"] > 0 and r["first_batch_s"] > 0


def test_text_report_says_whether_a_host_keeps_up(embedded_env, capsys):
  assert cli.main([*ARGS, "--steps_per_s=1e9"]) == 0  # no pipeline feeds a billion steps a second
  out = capsys.readouterr().out
  assert "embedded_span_corruption" in out and "rows/s" in out and "DOES NOT keep up" in out
