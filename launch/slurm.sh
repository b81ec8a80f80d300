#!/usr/bin/env bash
# SLURM launcher for GPU clusters: writes an sbatch script that starts one remixer-t5 process per node
# (srun, one task per node, each using all GPUs of its node) and submits it.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/slurm.sh [flags] -- REMIXER_T5_ARGS...

Writes SCRIPT (default ./JOB_NAME.sbatch) and submits it with sbatch. In the job, srun starts one
remixer-t5 per node with
  REMIXER_T5_COORDINATOR=FIRST_NODE:PORT  (first host of `scontrol show hostnames $SLURM_JOB_NODELIST`)
  REMIXER_T5_NUM_PROCESSES=$SLURM_NTASKS  REMIXER_T5_PROCESS_ID=$SLURM_PROCID
and JAX_COORDINATOR_ADDRESS=FIRST_NODE:PORT, which jax.distributed.initialize() reads itself (it also
detects SLURM on its own, so a bare initialize() agrees with these variables).

Flags (--flag VALUE or --flag=VALUE):
  --nodes N            hosts (default 1)
  --gpus-per-node G    GPUs per host (default 8)
  --partition P        SLURM partition (default: the cluster's default)
  --account A          SLURM account to charge
  --time T             time limit, e.g. 24:00:00 or 2-00:00:00 (default 24:00:00)
  --job-name NAME      default remixer-t5
  --output PATTERN     job log (default %x-%j.out, in the submission directory)
  --sbatch-arg ARG     extra #SBATCH line, repeatable (e.g. --sbatch-arg=--exclusive)
  --venv DIR           activate DIR/bin/activate in the job (default: remixer-t5 already on PATH)
  --port PORT          coordinator port (default: derived from the job id, as JAX does for SLURM)
  --env NAME=VALUE     exported in the job, repeatable
  --script FILE        where to write the sbatch script (default ./JOB_NAME.sbatch)
  --dry-run            print the script and the sbatch command instead of writing/submitting
  -h, --help           this help

MODEL_DIR must be on a filesystem every node sees (shared storage or gs://).

Example:
  launch/slurm.sh --nodes=2 --gpus-per-node=8 --partition=gpu --venv="$PWD/.venv" -- \
    train --gin_file=models/t5_1_1/base.gin --gin_file=runs/pretrain.gin --gin.MODEL_DIR="'/shared/r5'"
EOF
}

prog="slurm.sh"
launch_dir="${BASH_SOURCE[0]%/*}"
[ "$launch_dir" = "${BASH_SOURCE[0]}" ] && launch_dir=.
# shellcheck source=launch/flags.bash
source "$launch_dir/flags.bash"  # die, take

nodes=1 gpus=8 partition="" account="" time_limit="24:00:00" job="remixer-t5" output="%x-%j.out" val=""  # set by flags.bash take()
venv="" port="" script="" dry=0
sbatch_args=() envs=() args=()


while [ $# -gt 0 ]; do
  used=1
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --nodes|--nodes=*) take --nodes "a positive integer" "$@"; nodes="$val" ;;
    --gpus-per-node|--gpus-per-node=*) take --gpus-per-node "a positive integer" "$@"; gpus="$val" ;;
    --partition|--partition=*) take --partition "a SLURM partition" "$@"; partition="$val" ;;
    --account|--account=*) take --account "a SLURM account" "$@"; account="$val" ;;
    --time|--time=*) take --time "a time limit, e.g. 24:00:00" "$@"; time_limit="$val" ;;
    --job-name|--job-name=*) take --job-name "a job name" "$@"; job="$val" ;;
    --output|--output=*) take --output "a log file pattern, e.g. %x-%j.out" "$@"; output="$val" ;;
    --sbatch-arg|--sbatch-arg=*) take --sbatch-arg "an sbatch option, e.g. --exclusive" "$@"; sbatch_args+=("$val") ;;
    --venv|--venv=*) take --venv "a virtual environment directory" "$@"; venv="$val" ;;
    --port|--port=*) take --port "a port number" "$@"; port="$val" ;;
    --env|--env=*) take --env "NAME=VALUE" "$@"; envs+=("$val") ;;
    --script|--script=*) take --script "a file to write the sbatch script to" "$@"; script="$val" ;;
    --) shift; args=("$@"); break ;;
    -*) die "unknown flag '$1'" ;;
    *) die "unexpected argument '$1'; remixer-t5 arguments go after --" ;;
  esac
  shift "$used"
done

[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes: expected a positive integer; got '$nodes'"
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "--gpus-per-node: expected a positive integer; got '$gpus'"
[[ "$time_limit" =~ ^[0-9]+([-:][0-9]+)*$ ]] \
  || die "--time: expected minutes, HH:MM:SS or D-HH:MM:SS; got '$time_limit'"
[[ "$job" =~ ^[A-Za-z0-9._-]+$ ]] || die "--job-name: expected letters, digits, '.', '_' or '-'; got '$job'"
[ -z "$port" ] || { [[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -ge 1024 ] && [ "$port" -le 65535 ]; } \
  || die "--port: expected an integer in 1024..65535; got '$port'"
for s in "$partition" "$account" "$output" ${sbatch_args[@]+"${sbatch_args[@]}"}; do
  [[ "$s" != *$'\n'* ]] || die "sbatch values cannot contain newlines"
done
for e in ${envs[@]+"${envs[@]}"}; do
  [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env: expected NAME=VALUE; got '$e'"
done
[ ${#args[@]} -gt 0 ] || die "missing remixer-t5 arguments after --, e.g. -- train --gin_file=..."
script="${script:-$job.sbatch}"
if [ "$dry" = 0 ]; then
  command -v sbatch >/dev/null 2>&1 \
    || { echo "$prog: sbatch not found on PATH; run this on a SLURM login node (or use --dry-run)" >&2; exit 127; }
fi

# --- the sbatch script --------------------------------------------------------------------------------
batch_script() {
  echo "#!/bin/bash"
  echo "#SBATCH --job-name=$job"
  echo "#SBATCH --nodes=$nodes"
  echo "#SBATCH --ntasks-per-node=1"
  echo "#SBATCH --gpus-per-node=$gpus"
  echo "#SBATCH --time=$time_limit"
  echo "#SBATCH --output=$output"
  [ -z "$partition" ] || echo "#SBATCH --partition=$partition"
  [ -z "$account" ] || echo "#SBATCH --account=$account"
  for s in ${sbatch_args[@]+"${sbatch_args[@]}"}; do echo "#SBATCH $s"; done
  echo "# Written by launch/slurm.sh: one remixer-t5 process per node, each driving all $gpus GPUs of its node."
  echo "set -euo pipefail"
  [ -z "$venv" ] || echo "source $(printf %q "$venv")/bin/activate"
  for e in ${envs[@]+"${envs[@]}"}; do echo "export ${e%%=*}=$(printf %q "${e#*=}")"; done
  # No `| head -n 1`: with pipefail, scontrol dying of SIGPIPE would fail the job.
  echo "hosts=\"\$(scontrol show hostnames \"\$SLURM_JOB_NODELIST\")\""
  echo "head_node=\"\${hosts%%[[:space:]]*}\"  # the first node runs the coordinator (process 0)"
  if [ -n "$port" ]; then
    echo "port=$port"
  else
    echo "port=\$(( SLURM_JOB_ID % 4096 + 61440 ))  # JAX's own SLURM default port"
  fi
  echo "export REMIXER_T5_COORDINATOR=\"\$head_node:\$port\""
  echo "export JAX_COORDINATOR_ADDRESS=\"\$REMIXER_T5_COORDINATOR\""
  echo "echo \"remixer-t5: \$SLURM_JOB_NUM_NODES node(s), coordinator \$REMIXER_T5_COORDINATOR\""
  # Single quotes: SLURM_NTASKS/SLURM_PROCID are read inside each task, where srun sets them.
  # shellcheck disable=SC2016
  printf '%s' 'srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '\''export' \
    ' REMIXER_T5_NUM_PROCESSES="$SLURM_NTASKS" REMIXER_T5_PROCESS_ID="$SLURM_PROCID";' \
    ' exec remixer-t5 "$@"'\'' remixer-t5'
  printf ' %q' "${args[@]}"
  echo
}

if [ "$dry" = 1 ]; then
  printf 'cat > %q <<'\''SBATCH_SCRIPT'\''\n' "$script"
  batch_script
  echo "SBATCH_SCRIPT"
  printf 'sbatch %q\n' "$script"
else
  batch_script > "$script"
  echo "$prog: wrote $script" >&2
  sbatch "$script"
fi
