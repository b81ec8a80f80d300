"""launch/*.sh: dry runs print the right gcloud/sbatch commands, arguments survive quoting, bad flags exit 2.

Nothing here runs gcloud or sbatch: every launcher call is a --dry-run, or runs with an empty PATH (where
the launcher must refuse for lack of gcloud/sbatch). The printed remote command and sbatch script are
executed by bash against stub programs, so quoting is checked by bash itself, not by string matching.
"""
import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
BASH = shutil.which("bash")
# A gin binding with shell quotes, and an argument with spaces, quotes and a dollar sign.
ARGS = ["train", "--gin_file=runs/pretrain.gin", "--gin.MODEL_DIR='gs://b/run'",
        "--gin.RUN_NAME=\"it's a $HOME test\""]


def launch(script, *argv, cwd=None, env=None):
  return subprocess.run([BASH, str(LAUNCH / script), *argv], capture_output=True, text=True, cwd=cwd,
                        env=env, timeout=30)


def tpu(*argv, **kw):
  return launch("tpu_vm.sh", "--name=r5", "--zone=europe-west4-a", *argv, **kw)


def commands(stdout):
  """The printed command lines, each split as a POSIX shell would."""
  return [shlex.split(line) for line in stdout.splitlines() if line.strip()]


def ssh_commands(cmds):
  return [next(a.split("=", 1)[1] for a in c if a.startswith("--command=")) for c in cmds if c[4:5] == ["ssh"]]


def make_exe(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


def jax_pin():
  return re.search(r'"jax==([^"]+)"', (REPO / "setup.py").read_text()).group(1)


def test_the_gpu_extra_is_jaxs_cuda_plugin_at_the_pinned_jax():
  text = (REPO / "setup.py").read_text()
  assert re.search(r'GPU_REQUIRES = \["jax\[cuda12\]==([^"]+)"\]', text).group(1) == jax_pin()
  assert '"gpu": GPU_REQUIRES' in text


# --- all launchers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", sorted(p.name for p in LAUNCH.glob("*.sh")))
def test_syntax(script):
  res = subprocess.run([BASH, "-n", str(LAUNCH / script)], capture_output=True, text=True)
  assert res.returncode == 0, res.stderr


def test_shellcheck():
  if not shutil.which("shellcheck"):
    pytest.skip("shellcheck not installed; bash -n still checks the syntax")
  res = subprocess.run(["shellcheck", "-S", "warning", *map(str, sorted(LAUNCH.glob("*.sh")))],
                       capture_output=True, text=True)
  assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", ["tpu_vm.sh", "slurm.sh", "local.sh"])
def test_help(script):
  res = launch(script, "--help")
  assert res.returncode == 0 and "Usage" in res.stdout and "--dry-run" in res.stdout


# --- TPU VM ----------------------------------------------------------------------------------------------
def test_tpu_all_creates_installs_runs_on_every_worker_then_deletes():
  res = tpu("--accelerator=v3-32", "--dry-run", "all", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  cmds = commands(res.stdout)
  gcloud = [c for c in cmds if c[0] == "gcloud"]
  assert [c[4] for c in gcloud] == ["create", "scp", "ssh", "ssh", "ssh", "delete"]
  create = gcloud[0]
  assert create[5] == "r5" and "--accelerator-type=v3-32" in create
  assert "--version=tpu-ubuntu2204-base" in create and "--zone=europe-west4-a" in create
  assert all("--worker=all" in c for c in gcloud if c[4] in ("scp", "ssh"))
  assert gcloud[-1][4:6] == ["delete", "r5"] and "--quiet" in gcloud[-1]
  install, run = ssh_commands(cmds)[1:]
  assert f"jax[tpu]=={jax_pin()}" in shlex.split(install.split("pip install -q", 2)[2])
  assert "remixer-t5" in run and "exec" in run


def test_tpu_run_passes_arguments_through_with_quoting_intact(tmp_path):
  """bash runs the printed remote command against a stub remixer-t5 that lists its arguments."""
  res = tpu("--dry-run", "--env=TFDS_DATA_DIR=gs://b/tfds dir", "run", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  (run,) = ssh_commands(commands(res.stdout))
  (tmp_path / "remixer-t5").mkdir()
  make_exe(tmp_path / "remixer-t5-venv" / "bin" / "remixer-t5",
           '#!/usr/bin/env bash\necho "cwd=$PWD"\necho "TFDS_DATA_DIR=$TFDS_DATA_DIR"\nprintf "%s\\n" "$@"\n')
  out = subprocess.run([BASH, "-c", run], capture_output=True, text=True, check=True, timeout=30,
                       env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]}).stdout.splitlines()
  assert out[0] == f"cwd={tmp_path / 'remixer-t5'}"
  assert out[1] == "TFDS_DATA_DIR=gs://b/tfds dir"
  assert out[2:] == ARGS


def test_tpu_run_deletes_only_when_asked_and_tees_the_log():
  plain = commands(tpu("--dry-run", "run", "--", *ARGS).stdout)
  assert [c[4] for c in plain] == ["ssh"]
  res = tpu("--dry-run", "--delete", "--log=logs/run 1.log", "run", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  ssh_line, delete_line = res.stdout.strip().splitlines()
  assert ssh_line.endswith("2>&1 | tee -a logs/run\\ 1.log")
  assert shlex.split(delete_line)[4] == "delete"


def test_tpu_all_keep_skips_the_delete():
  cmds = commands(tpu("--dry-run", "--keep", "all", "--", *ARGS).stdout)
  assert [c[4] for c in cmds if c[0] == "gcloud"][-1] == "ssh"


@pytest.mark.parametrize("source, expected", [
    (["--repo=https://github.com/me/remixer_t5.git@v1"], "git+https://github.com/me/remixer_t5.git@v1"),
    (["--wheel=https://example.org/remixer_t5-0.1.0-py3-none-any.whl"],
     "https://example.org/remixer_t5-0.1.0-py3-none-any.whl"),
])
def test_tpu_install_from_git_or_wheel_url(source, expected):
  res = tpu("--dry-run", *source, "install")
  assert res.returncode == 0, res.stderr
  cmds = commands(res.stdout)
  assert [c[4] for c in cmds] == ["ssh"]  # nothing copied from this checkout
  (install,) = ssh_commands(cmds)
  assert shlex.split(install.split("pip install -q", 2)[2]) == [f"jax[tpu]=={jax_pin()}", expected]


def test_tpu_install_local_wheel_is_copied_to_every_worker():
  cmds = commands(tpu("--dry-run", "--wheel=dist/remixer_t5-0.1.0-py3-none-any.whl", "install").stdout)
  scp = next(c for c in cmds if c[4] == "scp")
  assert scp[5:7] == ["dist/remixer_t5-0.1.0-py3-none-any.whl", "r5:remixer-t5/"] and "--worker=all" in scp
  assert ssh_commands(cmds)[-1].endswith("$HOME/remixer-t5/remixer_t5-0.1.0-py3-none-any.whl")


def test_tpu_single_host_accepts_a_local_model_dir_and_project_reaches_every_command():
  res = tpu("--dry-run", "--project=my-proj", "all", "--", "train", "--gin.MODEL_DIR='/tmp/run'")
  assert res.returncode == 0, res.stderr
  assert all("--project=my-proj" in c for c in commands(res.stdout) if c[0] == "gcloud")


def test_tpu_multi_host_without_model_dir_binding_warns():
  res = tpu("--dry-run", "--accelerator=v3-32", "run", "--", "train", "--gin_file=runs/pretrain.gin")
  assert res.returncode == 0 and "warning" in res.stderr and "gs://" in res.stderr


@pytest.mark.parametrize("argv, flag", [
    (["--accelerator=v3-32", "run", "--", "train", "--gin.MODEL_DIR='/tmp/run'"], "--gin.MODEL_DIR"),
    (["--bogus", "run"], "--bogus"),
    (["--accelerator=v3", "create"], "--accelerator"),
    (["--accelerator=tpu-8", "create"], "--accelerator"),
    (["--zone"], "--zone"),
    (["--version", "--dry-run", "create"], "--version"),
    (["--wheel=a.whl", "--repo=https://x/y.git", "install"], "--wheel"),
    (["--keep", "run", "--", "train"], "--keep"),
    (["--env=1X=2", "run", "--", "train"], "--env"),
    (["run"], "after --"),
    (["create", "--", "train"], "after --"),
    ([], "subcommand"),
    (["launch"], "subcommand"),
])
def test_tpu_bad_flags_exit_2_naming_the_flag(argv, flag):
  res = tpu("--dry-run", *argv)
  assert res.returncode == 2, res.stdout
  assert flag in res.stderr and "error" in res.stderr and not res.stdout


@pytest.mark.parametrize("missing", ["--name", "--zone"])
def test_tpu_requires_name_and_zone(missing):
  given = [a for a in ("--name=r5", "--zone=europe-west4-a") if not a.startswith(missing)]
  res = launch("tpu_vm.sh", *given, "--dry-run", "delete")
  assert res.returncode == 2 and f"{missing} is required" in res.stderr


# --- SLURM -----------------------------------------------------------------------------------------------
def slurm_dry_run(tmp_path, *flags):
  res = launch("slurm.sh", *flags, "--dry-run", "--", *ARGS, cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  lines = res.stdout.splitlines()
  assert lines[0] == "cat > remixer-t5.sbatch <<'SBATCH_SCRIPT'"
  end = lines.index("SBATCH_SCRIPT")
  assert lines[end + 1:] == ["sbatch remixer-t5.sbatch"]
  assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
  return lines[1:end]


def test_slurm_script_has_directives_and_one_srun_task_per_node(tmp_path):
  script = slurm_dry_run(tmp_path, "--nodes", "4", "--gpus-per-node=8", "--partition=gpu", "--time=2-00:00:00",
                         "--sbatch-arg=--exclusive")
  assert script[0] == "#!/bin/bash"
  for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu",
                    "--time=2-00:00:00", "--job-name=remixer-t5", "--exclusive"):
    assert f"#SBATCH {directive}" in script
  text = "\n".join(script)
  assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
  for var in ("REMIXER_T5_COORDINATOR", "REMIXER_T5_NUM_PROCESSES", "REMIXER_T5_PROCESS_ID",
              "JAX_COORDINATOR_ADDRESS"):
    assert var in text
  srun = shlex.split(script[-1])
  assert srun[0] == "srun" and srun[-len(ARGS):] == ARGS


def test_slurm_script_runs_one_process_per_node_with_coordinator_env(tmp_path):
  """bash runs the printed script with stub scontrol/srun and a venv whose remixer-t5 records its env."""
  work = tmp_path / "work"
  work.mkdir()
  script = slurm_dry_run(work, "--nodes=2", "--gpus-per-node=4", f"--venv={tmp_path / 'my venv'}",
                         "--env=REMIXER_T5_DATA_DIR=/data/a b")
  (tmp_path / "job.sbatch").write_text("\n".join(script) + "\n")
  stubs, out = tmp_path / "stubs", tmp_path / "out"
  out.mkdir()
  make_exe(stubs / "scontrol", '#!/usr/bin/env bash\n[ "$*" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
  # srun: drop its own options, then start the command once per task, as SLURM would on each node.
  make_exe(stubs / "srun", '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
           'for i in 0 1; do SLURM_NTASKS=2 SLURM_PROCID=$i "$@" || exit; done\n')
  make_exe(tmp_path / "my venv" / "bin" / "remixer-t5",
           '#!/usr/bin/env bash\nenv | grep -E "^(REMIXER_T5_|JAX_COORDINATOR)" | sort > "$OUT/$SLURM_PROCID.env"\n'
           'printf "%s\\n" "$@" > "$OUT/$SLURM_PROCID.args"\n')
  (tmp_path / "my venv" / "bin" / "activate").write_text(f'export PATH={shlex.quote(str(tmp_path / "my venv" / "bin"))}:"$PATH"\n')
  env = {"PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out), "SLURM_JOB_NODELIST": "gpu[07-08]",
         "SLURM_JOB_ID": "4097", "SLURM_JOB_NUM_NODES": "2"}
  res = subprocess.run([BASH, str(tmp_path / "job.sbatch")], capture_output=True, text=True, env=env, timeout=30)
  assert res.returncode == 0, res.stderr
  assert "coordinator gpu07:61441" in res.stdout  # 4097 % 4096 + 61440
  for i in (0, 1):
    assert (out / f"{i}.args").read_text().splitlines() == ARGS
    assert (out / f"{i}.env").read_text().splitlines() == [
        "JAX_COORDINATOR_ADDRESS=gpu07:61441", "REMIXER_T5_COORDINATOR=gpu07:61441",
        "REMIXER_T5_DATA_DIR=/data/a b", "REMIXER_T5_NUM_PROCESSES=2", f"REMIXER_T5_PROCESS_ID={i}"]


def test_slurm_default_coordinator_matches_jax_slurm_autodetection(monkeypatch):
  """With no --port, the script's coordinator is the one a bare jax.distributed.initialize() would pick."""
  slurm_cluster = pytest.importorskip("jax._src.clusters.slurm_cluster")
  monkeypatch.setenv("SLURM_JOB_ID", "123457")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
  assert slurm_cluster.SlurmCluster.get_coordinator_address(None, None) == f"gpu07:{123457 % 4096 + 61440}"


def test_slurm_explicit_port(tmp_path):
  assert "port=29500" in slurm_dry_run(tmp_path, "--port=29500")


@pytest.mark.parametrize("argv, flag", [
    (["--nodes=0", "--", "train"], "--nodes"),
    (["--nodes=two", "--", "train"], "--nodes"),
    (["--gpus-per-node=", "--", "train"], "--gpus-per-node"),
    (["--time=tomorrow", "--", "train"], "--time"),
    (["--job-name=a/b", "--", "train"], "--job-name"),
    (["--port=80", "--", "train"], "--port"),
    (["--partition", "--", "train"], "--partition"),
    (["--gpus", "--", "train"], "--gpus"),
    (["train"], "after --"),
    ([], "after --"),
])
def test_slurm_bad_flags_exit_2_naming_the_flag(argv, flag, tmp_path):
  res = launch("slurm.sh", "--dry-run", *argv, cwd=tmp_path)
  assert res.returncode == 2, res.stdout
  assert flag in res.stderr and "error" in res.stderr and not res.stdout


# --- refusing to run for real without the cloud tools ----------------------------------------------------
@pytest.mark.parametrize("script, argv, tool", [
    ("tpu_vm.sh", ["--name=r5", "--zone=europe-west4-a", "delete"], "gcloud"),
    ("slurm.sh", ["--", "train"], "sbatch"),
])
def test_refuses_to_run_without_the_tool(script, argv, tool, tmp_path):
  empty = tmp_path / "bin"
  empty.mkdir()  # PATH with nothing on it: no gcloud/sbatch can be reached
  res = launch(script, *argv, cwd=tmp_path, env={"PATH": str(empty)})
  assert res.returncode == 127 and f"{tool} not found" in res.stderr
  assert list(tmp_path.iterdir()) == [empty]


# --- local -----------------------------------------------------------------------------------------------
def test_local_dry_run_accepts_the_separator_and_keeps_quoting():
  res = launch("local.sh", "--dry-run", "--", *ARGS)
  assert res.returncode == 0, res.stderr
  printed = shlex.split(res.stdout)
  assert printed[0].endswith("/.venv/bin/remixer-t5") and printed[1:] == ARGS


@pytest.mark.parametrize("accelerator,joins", [("v3-8", False), ("v3-32", True)])
def test_multi_host_slices_join_one_jax_runtime(accelerator, joins):
  out = subprocess.run(["bash", str(LAUNCH / "tpu_vm.sh"), "--name=x", "--zone=z", f"--accelerator={accelerator}",
                        "--dry-run", "run", "--", "train", "--gin.MODEL_DIR='gs://b/r'"],
                       capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
  assert out.returncode == 0, out.stderr
  assert ("REMIXER_T5_DISTRIBUTED=auto" in out.stdout) == joins
