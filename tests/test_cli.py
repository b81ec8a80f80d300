"""The CLI's info numbers, t5x-style flags, and clear errors for bad input."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from remixer_t5 import cli, gin_utils

REPO = Path(__file__).resolve().parents[1]


def _info(capsys, config):
  assert cli.main(["info", f"--gin_file=models/t5_1_1/{config}.gin", "--json"]) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("config,params", [("small", 76_961_152), ("base", 247_577_856)])
def test_info_reports_exact_t5_1_1_parameter_counts(capsys, config, params):
  report = _info(capsys, config)
  assert report["params"] == params
  assert sum(report["modules"].values()) == params
  # Training FLOPs per token are at least 6 x the parameters used per token, minus the embedding gather.
  assert report["flops_per_token"] > 2 * (params - 32128 * {"small": 512, "base": 768}[config])


@pytest.mark.parametrize("config,approx", [("large", 783.2e6), ("xl", 2.85e9)])
def test_info_large_and_xl_sizes(capsys, config, approx):
  assert _info(capsys, config)["params"] == pytest.approx(approx, rel=2e-3)


def test_gin_bindings_override_files(capsys):
  report_a = _info(capsys, "small")
  assert (
    cli.main(["info", "--gin_file", "models/t5_1_1/small.gin", "--gin.network.T5Config.num_decoder_layers=4", "--json"])
    == 0
  )
  report_b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report_b["params"] < report_a["params"]


@pytest.mark.parametrize(
  "args,needle",
  [
    (["--gin.network.T5Config.emb_dimm=3"], "emb_dimm"),
    (["--gin.TRAIN_STEPZ=3"], "TRAIN_STEPZ"),
    (["--gin.nosuchmodule.Thing.x=3"], "nosuchmodule"),
  ],
)
def test_unknown_gin_binding_is_one_clear_error(capsys, args, needle):
  assert cli.main(["info", "--gin_file=models/t5_1_1/tiny.gin", *args]) == 2
  err = capsys.readouterr().err
  assert needle in err and "Traceback" not in err


def test_missing_gin_file_names_it_and_where_it_looked(capsys):
  assert cli.main(["info", "--gin_file=models/t5_1_1/nope.gin"]) == 2
  err = capsys.readouterr().err
  assert "models/t5_1_1/nope.gin" in err and "looked in" in err


@pytest.mark.parametrize(
  "body,line,needle",
  [
    ("network.T5Config.emb_dim = (128\n", 3, "unclosed '('"),
    ("network.T5Config.emb_dim = [1,\n  2,\n", 3, "unclosed '['"),
    ("network.T5Config.emb_dim = 128 +\n", 3, "Expected newline"),
    ("network.T5Config.emb_dim = 'abc\n", 3, "Unable to parse value"),
  ],
)
@pytest.mark.parametrize("included", [False, True])
def test_gin_syntax_error_is_one_line_naming_the_file_and_line(tmp_path, capsys, body, line, needle, included):
  bad = tmp_path / "bad.gin"
  bad.write_text("# a comment\ninclude 'models/t5_1_1/tiny.gin'\n" + body)
  given = bad
  if included:  # the error is in a file the given one includes
    given = tmp_path / "outer.gin"
    given.write_text(f"include '{bad}'\n")
  assert cli.main(["info", f"--gin_file={given}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "Traceback" not in err, err
  assert f"{bad}, line {line}" in err and needle in err, err


def test_gin_binding_with_a_syntax_error_names_the_binding(capsys):
  assert cli.main(["info", "--gin_file=models/t5_1_1/tiny.gin", "--gin.network.T5Config.emb_dim=@foo("]) == 2
  err = capsys.readouterr().err
  assert "--gin.network.T5Config.emb_dim=@foo(" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["(3", "[1, 2", "'abc"])
def test_gin_binding_with_a_broken_literal_is_an_error_not_a_string(capsys, value):
  # A bare word becomes a string (a path); an unclosed bracket or quote is a broken value, not a path.
  assert cli.main(["info", "--gin_file=models/t5_1_1/tiny.gin", f"--gin.network.T5Config.emb_dim={value}"]) == 2
  err = capsys.readouterr().err
  assert f"--gin.network.T5Config.emb_dim={value}" in err and "not a gin value" in err and "Traceback" not in err


@pytest.mark.parametrize("registered", [False, True])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_train_or_eval_without_a_run_file_names_what_is_missing(capsys, command, registered):
  if registered:  # an earlier parse in this process registered the run functions with gin (as in a test session)
    from remixer_t5 import gin_utils

    gin_utils.parse_gin(["models/t5_1_1/tiny.gin", "runs/demo.gin", "runs/finetune.gin"], ["MODEL_DIR='unused'"])
  assert cli.main([command, "--gin_file=models/t5_1_1/tiny.gin"]) == 2
  err = capsys.readouterr().err
  assert "binds no run_config." in err and "runs/pretrain.gin" in err and "demo.gin" in err, err
  assert "Traceback" not in err and "Gin registry" not in err


def test_missing_vocabulary_says_where_it_looked(tmp_path, capsys):
  missing = tmp_path / "no_such.model"
  code = cli.main(
    [
      "train",
      "--gin_file=models/t5_1_1/small.gin",
      "--gin_file=runs/pretrain.gin",
      f"--gin.vocab.t5_vocabulary.path='{missing}'",
      f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
    ]
  )
  assert code == 2
  assert str(missing) in capsys.readouterr().err


def test_missing_hf_checkpoint_is_a_clear_error(tmp_path, capsys):
  assert cli.main(["import-hf", str(tmp_path / "absent"), str(tmp_path / "out")]) == 2
  assert str(tmp_path / "absent") in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_python_dash_m_entry_point():
  out = subprocess.run(
    [sys.executable, "-m", "remixer_t5", "info", "--gin_file=models/t5_1_1/tiny.gin", "--json"],
    capture_output=True,
    text=True,
    cwd=REPO,
    check=True,
  ).stdout
  assert json.loads(out.strip().splitlines()[-1])["params"] > 0


def test_every_gin_file_parses(tmp_path):
  files = sorted(p.relative_to(gin_utils.gin_dir()) for p in gin_utils.gin_dir().rglob("*.gin"))
  assert len(files) >= 8
  import remixer_t5.tasks  # noqa: F401
  import seqio

  (tmp_path / "dev.tsv").write_text("inputs\ttargets\na b\tc\n")
  for f in files:
    if str(f).startswith("t5x/"):  # for t5x's own trainer: tests/test_t5x_interop.py loads them
      continue
    if str(f) == "runs/custom.gin":  # an add-on: your own files as the task of any run file
      gin_utils.parse_gin(
        ["models/t5_1_1/tiny.gin", "runs/demo.gin", str(f)],
        ["MODEL_DIR='/tmp/unused'", f"custom.register.validation='{tmp_path / 'dev.tsv'}'"],
      )
      assert gin_utils.macro("MIXTURE_OR_TASK_NAME") == "custom"
      seqio.TaskRegistry.remove("custom")
    elif str(f).startswith("runs/"):  # run files pair with a model file
      gin_utils.parse_gin(["models/t5_1_1/tiny.gin", str(f)], ["MODEL_DIR='/tmp/unused'"])
      assert gin_utils.macro("TRAIN_STEPS") > 0
      assert seqio.get_mixture_or_task(gin_utils.macro("MIXTURE_OR_TASK_NAME")) is not None, f
    elif str(f).startswith("partitioning/"):  # mesh files pair with a model and a run
      gin_utils.parse_gin(["models/t5_1_1/tiny.gin", "runs/pretrain.gin", str(f)], ["MODEL_DIR='/tmp/unused'"])
    elif str(f).startswith("commands/"):  # what a command loads before a model and a run
      gin_utils.parse_gin(
        [str(f), "models/t5_1_1/tiny.gin", "runs/pretrain.gin"],
        ["MODEL_DIR='/tmp/unused'", "trainer.evaluate_checkpoint.beam_size=2"],
      )
    else:
      gin_utils.parse_gin([str(f)], [])
    assert gin_utils.macro("MODEL") is not None


@pytest.mark.integration
def test_wheel_installs_and_runs_outside_the_repo():
  out = subprocess.run(
    ["bash", str(REPO / "scripts" / "wheel_check.sh"), sys.executable], capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])["params"] == 76_961_152


def test_gin_search_paths_find_user_configs(tmp_path, capsys):
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "model.gin").write_text(
    "include 'models/t5_1_1/tiny.gin'\nfrom __gin__ import dynamic_registration\n"
    "from remixer_t5.model import network\nnetwork.T5Config.num_encoder_layers = 1\n"
  )
  assert cli.main(["info", "--gin_file=mine/model.gin", f"--gin_search_paths={tmp_path}", "--json"]) == 0
  one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["params"]
  assert one < _info(capsys, "tiny")["params"]


@pytest.mark.parametrize(
  "old, new",
  [
    ("network", "from remixer_t5.model import network"),
    ("trainer", "from remixer_t5.training import trainer"),
    ("t5x_compat", "from remixer_t5.interop import t5x as t5x_compat"),
  ],
)
def test_a_gin_file_with_an_old_import_is_told_the_new_one(tmp_path, capsys, old, new):
  """Modules moved into model/, training/, interop/: a user's gin file written before fails with the line to
  write instead (the bindings keep their short names)."""
  (tmp_path / "old.gin").write_text(f"from __gin__ import dynamic_registration\nfrom remixer_t5 import {old}\n")
  assert cli.main(["info", f"--gin_file={tmp_path / 'old.gin'}"]) == 2
  err = capsys.readouterr().err
  assert f"remixer_t5.{old} has moved" in err and new in err


def test_local_launcher_dry_run_prints_the_command():
  out = subprocess.run(
    ["bash", str(REPO / "launch" / "local.sh"), "--dry-run", "train", "--gin_file=runs/demo.gin"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert "remixer-t5 train --gin_file=runs/demo.gin" in out


def test_show_sharding_lists_each_parameter_with_its_partition_spec(capsys):
  assert cli.main(["info", "--gin_file=models/t5_1_1/tiny.gin", "--show-sharding"]) == 0
  out = capsys.readouterr().out
  line = next(l for l in out.splitlines() if "['encoder']['layers_0']['attention']['query']['kernel']" in l)
  assert "(128, 128)" in line and "'model'" in line
  assert sum("['kernel']" in l for l in out.splitlines()) == 2 * 7 + 2 * 11 + 1


def test_remixer_counts_are_t5_plus_h_per_layer(capsys):
  """Remixer_Base/SBase = the T5.1.1 of the same depth + an L x L H (and a scalar alpha) per layer."""

  def params(*args):
    assert cli.main(["info", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["params"]

  assert params("--gin_file=models/remixer/base.gin") == 247_577_856 + 12 * (512**2 + 1) + 12 * (114**2 + 1)
  t5_18_3 = params(
    "--gin_file=models/t5_1_1/base.gin",
    "--gin.network.T5Config.num_encoder_layers=18",
    "--gin.network.T5Config.num_decoder_layers=3",
  )
  assert params("--gin_file=models/remixer/sbase.gin") == t5_18_3 + 18 * (512**2 + 1) + 3 * (114**2 + 1)


@pytest.mark.parametrize(
  "argv, needle",
  [
    (["bench", "mixing", "--reference", "hf"], "unrecognized arguments: --reference hf"),
    (["bench", "mixing", "--hf-denormals=keep"], "unrecognized arguments: --hf-denormals=keep"),
    (["bench", "input", "--reference=hf"], "unrecognized arguments: --reference=hf"),
    (["bench", "train", "--modes", "greedy"], "unrecognized arguments: --modes greedy"),
    (["bench", "decode", "--repeats", "3"], "unrecognized arguments: --repeats 3"),
    (["bench", "train", "--position", "3"], "unrecognized arguments: --position 3"),
    (["bench", "decode", "--lengths=16,8"], "unrecognized arguments: --lengths=16,8"),
    (["bench", "train", "--ref", "hf"], "unrecognized arguments: --ref hf"),  # no abbreviations to slip past
    (["infer", "--beam", "2"], "unrecognized arguments: --beam 2"),
  ],
)
def test_a_bench_flag_its_kind_would_ignore_is_an_error(capsys, argv, needle):
  """Each kind parses only its own flags, so another kind's is a usage error (one line, exit 2) before any model is
  built: e.g. `bench mixing --reference hf` cannot time ours alone without a word. No flag is abbreviated."""
  try:
    code = cli.main(argv)
  except SystemExit as e:
    code = e.code
  assert code == 2
  assert needle in capsys.readouterr().err


def test_each_bench_kind_lists_only_its_own_flags():
  """`bench KIND --help` shows the flags KIND reads and no other kind's (each kind's module adds its own)."""
  flags = {
    kind: set(cli.parser(["bench", kind])[0]._option_string_actions)  # noqa: SLF001
    for kind in cli.COMMANDS["bench"]
  }
  owners = {
    "--beam_size": {"decode"},
    "--mixers": {"mixing"},
    "--hosts": {"input"},
    "--peak_flops": {"train"},
    "--field": {"drift"},
    "--workloads": {"kernels", "drift"},
    "--reference": {"train", "decode"},
    "--lengths": {"mixing", "train"},
    "--json": set(flags),
  }
  assert {flag: {k for k, own in flags.items() if flag in own} for flag in owners} == owners


def test_a_command_imports_only_its_own_module():
  """Dispatch imports the command given: `tasks --help` needs seqio, `compile` must not load TensorFlow."""
  code = (
    "import sys; from remixer_t5 import cli; cli.parser(['compile']); cli.parser(['bench', 'mixing']); "
    "print(sorted(m for m in ('tensorflow', 'seqio', 'torch', 'remixer_t5.commands.train', "
    "'remixer_t5.bench.input') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == "[]"


def test_every_command_builds_its_parser_and_says_what_it_takes():
  """Each entry of the table names a module with add_arguments and main; --help shows the gin flags exactly
  where the command takes them."""
  from remixer_t5.commands import COMMANDS

  entries = [([name], c) for name, c in COMMANDS.items() if not isinstance(c, dict)]
  entries += [([group, name], c) for group, t in COMMANDS.items() if isinstance(t, dict) for name, c in t.items()]
  assert len(entries) == 20
  for words, command in entries:
    p, found, rest = cli.parser(words)
    assert found is command and rest == [] and p.prog == " ".join(["remixer-t5", *words])
    assert ("--gin_file=F" in p.format_help()) is command.gin, words
    assert callable(importlib.import_module(command.module).main), words
