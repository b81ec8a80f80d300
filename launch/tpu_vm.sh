#!/usr/bin/env bash
# Cloud TPU VM launcher: create a slice (directly or as a queued resource, Spot or not), install remixer_t5 on
# every worker, start the same remixer-t5 command on all workers as a job that outlives the ssh session (JAX
# needs one process per host), follow it, recreate a preempted slice and rerun the command (which resumes from
# MODEL_DIR), and delete the slice.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh [flags] STEP [-- REMIXER_T5_ARGS...]

Steps:
  create   create the slice and wait until it is READY (--queued: a queued resource, waited for until ACTIVE)
  install  on every worker: Python venv, jax[tpu] at the setup.py pin, and this package (retried)
  run      start remixer-t5 REMIXER_T5_ARGS on every worker as a detached job (it survives the ssh session;
           output in ~/remixer-t5-job/log on each worker); leftover TPU users and libtpu's lock file are
           cleared first; refused while a job started by another `run` is still running
  status   the slice's state and, per worker, the job's (running, exited CODE, stopped, saved, died, none)
  logs     the last --lines lines of every worker's job log
  stop     SIGTERM to the job on every worker (remixer-t5 saves a checkpoint and exits 0), waited for
  watch    follow the job until it ends; when the slice is preempted or the job dies, recreate the slice
           (or restart the job) and rerun the same command, which resumes from MODEL_DIR, at most
           --max-restarts times (takes the flags and arguments of `run`)
  delete   delete the slice (with --queued: the queued resource and its TPU VM)
  all      create, install, run, then follow the job as `watch` does (restarting only with --restart) and
           delete the slice when the job has ended (--keep skips the delete)

Flags (--flag VALUE or --flag=VALUE):
  --name NAME          TPU VM name, also the queued resource's (required)
  --zone ZONE          e.g. europe-west4-a, us-central1-a (required)
  --project PROJECT    default: gcloud's configured project
  --accelerator TYPE   v3-8 (default, one host), v3-32 (4 hosts), v3-128, v4-16, ...
  --version VERSION    TPU software version (default: tpu-ubuntu2204-base for v2-v4,
                       v2-alpha-tpuv5 for v5p, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e for v6e)
  --queued             create the slice as a queued resource (Google's recommended way to get Spot capacity)
  --spot               Spot capacity: cheaper, preemptible at any time, no runtime limit
  --reserved           capacity from your reservation
  --best-effort        with --queued: best-effort capacity (gcloud alpha)
  --active-timeout S   longest wait for the slice to become ACTIVE/READY, seconds (default 43200)
  --create-arg ARG     extra argument for the create command, repeatable (e.g. --create-arg=--network=my-net)
  --wheel FILE|URL     install this wheel (local file copied to the workers, or http(s)/gs:// URL)
  --repo GIT_URL[@REF] pip install from git (e.g. https://github.com/you/remixer_t5.git@main)
                       default for both: the committed HEAD of this checkout (git archive), copied over
  --python PY          Python on the workers (default python3.11, installed with apt when missing)
  --jax-version V      default: the jax pin in setup.py
  --env NAME=VALUE     exported before remixer-t5 on every worker, repeatable (e.g. TFDS_DATA_DIR=gs://b/tfds)
  --restart            with `all`: recreate a preempted slice / restart a dead job, as `watch` always does
  --max-restarts N     most recreations and job restarts in one `watch` or `all` (default 10)
  --poll S             seconds between checks of the slice and the job while waiting or following
                       (default 60, or $REMIXER_T5_LAUNCH_POLL)
  --lines N            with `logs`: lines per worker (default 100; 0: the whole log)
  --log FILE           also append everything this launcher prints to FILE
  --delete             with `watch`: delete the slice when the job has ended
  --keep               with `all`: keep the slice
  --dry-run            print every command instead of running it
  -h, --help           this help

The slice is deleted only by `delete`, by `watch --delete` or at the end of `all` once the job has ended (or
when a step before the job's start failed). Interrupting `all` or `watch` after the job has started leaves the
slice and its job running: follow it again with `watch`, stop it with `stop`, delete it with `delete`.
Every ssh and scp, the install included, is retried with backoff (5 retries, 5 s doubling to 80 s;
$REMIXER_T5_LAUNCH_BACKOFF sets the first wait): a new slice's first ssh often fails while its key propagates.

Multi-host slices (more than 8 TensorCores/chips, e.g. v3-32) need --gin.MODEL_DIR on gs://: every host
writes its part of each checkpoint there. jax.distributed.initialize() needs no coordinator flags on TPU VMs
(it asks the TPU metadata server).

Example (a Spot v3-32 from the queue, restarted after each preemption):
  launch/tpu_vm.sh --name=r5 --zone=europe-west4-a --accelerator=v3-32 --queued --spot \
    --env=TFDS_DATA_DIR=gs://b/tfds all --restart -- \
    train --gin_file=models/t5_1_1/base.gin --gin_file=runs/pretrain.gin --gin.MODEL_DIR="'gs://b/r5'"
EOF
}

prog="tpu_vm.sh"
launch_dir="${BASH_SOURCE[0]%/*}"
[ "$launch_dir" = "${BASH_SOURCE[0]}" ] && launch_dir=.
# shellcheck source=launch/flags.bash
source "$launch_dir/flags.bash"  # die, take

here="${BASH_SOURCE[0]%/*}"
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
repo="$(cd "$here/.." && pwd)"

name="" zone="" project="" accelerator="v3-8" version="" wheel="" git_url="" python="python3.11"
jax_version="" log="" dry=0 delete=0 keep=0 step="" queued=0 tier="" restart=0 max_restarts=10
poll="${REMIXER_T5_LAUNCH_POLL:-60}" active_timeout=43200 lines=100
create_args=() envs=() args=() val="" used=1

while [ $# -gt 0 ]; do
  used=1
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --delete) delete=1 ;;
    --keep) keep=1 ;;
    --queued) queued=1 ;;
    --restart) restart=1 ;;
    --spot|--reserved|--best-effort)
      [ -z "$tier" ] || [ "$tier" = "$1" ] || die "$tier and $1: give at most one"
      tier="$1" ;;
    --name|--name=*) take --name "the TPU VM name" "$@"; name="$val" ;;
    --zone|--zone=*) take --zone "a zone, e.g. europe-west4-a" "$@"; zone="$val" ;;
    --project|--project=*) take --project "a Google Cloud project id" "$@"; project="$val" ;;
    --accelerator|--accelerator=*) take --accelerator "a TPU type, e.g. v3-8 or v3-32" "$@"; accelerator="$val" ;;
    --version|--version=*) take --version "a TPU software version, e.g. tpu-ubuntu2204-base" "$@"; version="$val" ;;
    --active-timeout|--active-timeout=*) take --active-timeout "seconds" "$@"; active_timeout="$val" ;;
    --create-arg|--create-arg=*) take --create-arg "an argument for the create command" "$@"; create_args+=("$val") ;;
    --wheel|--wheel=*) take --wheel "a wheel file or URL" "$@"; wheel="$val" ;;
    --repo|--repo=*) take --repo "a git URL, optionally @REF" "$@"; git_url="$val" ;;
    --python|--python=*) take --python "a Python executable on the workers" "$@"; python="$val" ;;
    --jax-version|--jax-version=*) take --jax-version "a jax version, e.g. 0.10.2" "$@"; jax_version="$val" ;;
    --env|--env=*) take --env "NAME=VALUE" "$@"; envs+=("$val") ;;
    --max-restarts|--max-restarts=*) take --max-restarts "a count" "$@"; max_restarts="$val" ;;
    --poll|--poll=*) take --poll "seconds" "$@"; poll="$val" ;;
    --lines|--lines=*) take --lines "a line count" "$@"; lines="$val" ;;
    --log|--log=*) take --log "a local file" "$@"; log="$val" ;;
    create|install|run|status|logs|stop|watch|delete|all)
      [ -z "$step" ] || die "one step at a time; got '$step' and '$1'"
      step="$1" ;;
    --) shift; args=("$@"); break ;;
    -*) die "unknown flag '$1'" ;;
    *) die "unknown step '$1'; expected create, install, run, status, logs, stop, watch, delete or all" \
         "(remixer-t5 arguments go after --)" ;;
  esac
  shift "$used"
done

[ -n "$step" ] || die "missing step: expected create, install, run, status, logs, stop, watch, delete or all"
[ -n "$name" ] || die "--name is required (the TPU VM name, e.g. --name=remixer-v3-32)"
[ -n "$zone" ] || die "--zone is required (e.g. --zone=europe-west4-a)"
[[ "$name" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] \
  || die "--name: expected lowercase letters, digits and '-', starting with a letter; got '$name'"
[[ "$accelerator" =~ ^v[0-9]+[a-z]*-([0-9]+)$ ]] \
  || die "--accelerator: expected a TPU type like v3-8, v3-32 or v4-16; got '$accelerator'"
cores="${BASH_REMATCH[1]}"
[ -z "$wheel" ] || [ -z "$git_url" ] || die "--wheel and --repo: give at most one"
[ "$keep" = 0 ] || [ "$step" = all ] || die "--keep only applies to 'all'"
[ "$delete" = 0 ] || [ "$step" = watch ] || die "--delete only applies to 'watch' ('all' deletes unless --keep)"
[ "$restart" = 0 ] || [ "$step" = all ] || die "--restart only applies to 'all' ('watch' always restarts)"
[ "$tier" != --best-effort ] || [ "$queued" = 1 ] || die "--best-effort needs --queued (a queued-resource tier)"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "--max-restarts: expected a whole number; got '$max_restarts'"
[[ "$active_timeout" =~ ^[0-9]+$ ]] || die "--active-timeout: expected whole seconds; got '$active_timeout'"
[[ "$poll" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--poll: expected seconds, e.g. 60 or 0.5; got '$poll'"
[[ "$lines" =~ ^[0-9]+$ ]] || die "--lines: expected a whole number; got '$lines'"
backoff="${REMIXER_T5_LAUNCH_BACKOFF:-5}"
[[ "$backoff" =~ ^[0-9]+$ ]] || die "\$REMIXER_T5_LAUNCH_BACKOFF: expected whole seconds; got '$backoff'"
for e in ${envs[@]+"${envs[@]}"}; do
  [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env: expected NAME=VALUE; got '$e'"
done
if [ -z "$version" ]; then
  case "$accelerator" in
    v2-*|v3-*|v4-*) version="tpu-ubuntu2204-base" ;;
    v5p-*) version="v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) version="v2-alpha-tpuv5-lite" ;;
    v6e-*) version="v2-alpha-tpuv6e" ;;
    *) die "--version is required for --accelerator=$accelerator (see the Cloud TPU software versions page)" ;;
  esac
fi
if [ -z "$jax_version" ]; then  # the pin in setup.py, read with builtins only
  while IFS= read -r line; do
    if [[ "$line" =~ \"jax==([^\"]+)\" ]]; then jax_version="${BASH_REMATCH[1]}"; break; fi
  done < "$repo/setup.py"
  [ -n "$jax_version" ] || die "no jax==VERSION pin found in $repo/setup.py; pass --jax-version"
fi
case "$step" in
  run|watch|all)
    [ ${#args[@]} -gt 0 ] || die "'$step' needs the remixer-t5 arguments after --, e.g. -- train --gin_file=..."
    # More than 8 TensorCores (v2-v4) or chips (v5e, v6e) means several hosts; each writes to MODEL_DIR.
    if [ "$cores" -gt 8 ]; then
      model_dir=""
      for a in "${args[@]}"; do
        [[ "$a" == --gin.MODEL_DIR=* ]] && model_dir="${a#--gin.MODEL_DIR=}"
      done
      model_dir="${model_dir#[\'\"]}" model_dir="${model_dir%[\'\"]}"
      if [ -z "$model_dir" ]; then
        echo "$prog: warning: no --gin.MODEL_DIR among the remixer-t5 arguments; $accelerator has several" \
          "hosts, so the MODEL_DIR your gin files set must be a gs:// path" >&2
      elif [[ "$model_dir" != gs://* ]]; then
        die "--gin.MODEL_DIR must be a gs:// path on a multi-host slice ($accelerator); got '$model_dir'"
      fi
    fi ;;
  *) [ ${#args[@]} -eq 0 ] || die "arguments after -- are for remixer-t5 and only apply to 'run', 'watch' and 'all'" ;;
esac
if [ "$dry" = 0 ]; then
  command -v gcloud >/dev/null 2>&1 \
    || { echo "$prog: gcloud not found on PATH; install the Google Cloud CLI (or use --dry-run)" >&2; exit 127; }
fi

# --- commands ---------------------------------------------------------------------------------------
show() { printf '%q' "$1"; [ $# -lt 2 ] || printf ' %q' "${@:2}"; echo; }
do_cmd() { if [ "$dry" = 1 ]; then show "$@"; else "$@"; fi; }
note() { if [ "$dry" = 1 ]; then echo "# $*"; fi; }      # what a dry run cannot show as a command
say() { echo "$prog: $(date -u '+%F %T') $*"; }           # a progress line
fail() { echo "$prog: error: $*" >&2; exit 1; }            # one line; exit 1 (die, for bad flags, exits 2)
where=(--zone="$zone")
[ -z "$project" ] || where+=(--project="$project")
ssh=(gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all)
qr=(gcloud compute tpus queued-resources)
tier_args=()
[ -z "$tier" ] || tier_args=("$tier")

# retry WHAT CMD...: CMD, run again after 5, 10, 20, 40 and 80 s ($REMIXER_T5_LAUNCH_BACKOFF: the first wait)
# while it fails. For ssh/scp and the install: a new slice's first ssh often fails while its key propagates,
# and every remote command here may run twice.
retries=5
retry() {
  local what="$1" try=0 delay="$backoff" rc; shift
  if [ "$dry" = 1 ]; then show "$@"; return 0; fi
  while :; do
    rc=0; "$@" || rc=$?
    [ "$rc" != 0 ] || return 0
    try=$((try + 1))
    if [ "$try" -gt "$retries" ]; then
      echo "$prog: error: $what failed $try times (last exit $rc); giving up" >&2
      return "$rc"
    fi
    echo "$prog: $what failed (exit $rc); retry $try of $retries in $delay s" >&2
    sleep "$delay"
    delay=$((delay * 2))
  done
}

remote_dir='$HOME/remixer-t5'     # expanded by the workers' shell
venv='$HOME/remixer-t5-venv'
job_dir='$HOME/remixer-t5-job'    # job.sh, token, pid, exit, stopped, log
# The TPU's device files, whose users MaxText's launcher kills before a run: /dev/vfio/* from v5 on.
case "$accelerator" in v5*|v6*) tpu_devices='/dev/vfio/*' ;; *) tpu_devices='/dev/accel*' ;; esac

# --- the slice ----------------------------------------------------------------------------------------
request() {
  if [ "$queued" = 1 ]; then
    local alpha=()
    [ "$tier" != --best-effort ] || alpha=(alpha)  # the best-effort tier is in the alpha command only
    do_cmd gcloud ${alpha[@]+"${alpha[@]}"} compute tpus queued-resources create "$name" --node-id="$name" \
      "${where[@]}" --accelerator-type="$accelerator" --runtime-version="$version" \
      ${tier_args[@]+"${tier_args[@]}"} ${create_args[@]+"${create_args[@]}"}
  else
    do_cmd gcloud compute tpus tpu-vm create "$name" "${where[@]}" --accelerator-type="$accelerator" \
      --version="$version" ${tier_args[@]+"${tier_args[@]}"} ${create_args[@]+"${create_args[@]}"}
  fi
}

# describe_state qr|vm: the queued resource's or the TPU VM's state, or NOT_FOUND; exit 1 when gcloud could
# not say (network, credentials), and the caller asks again at its next check.
errf=""
describe_state() {
  local out rc=0
  [ -n "$errf" ] || errf="$(mktemp "${TMPDIR:-/tmp}/tpu_vm.XXXXXX")"
  if [ "$1" = qr ]; then
    out=$("${qr[@]}" describe "$name" "${where[@]}" --format='value(state.state)' 2>"$errf") || rc=$?
  else
    out=$(gcloud compute tpus tpu-vm describe "$name" "${where[@]}" --format='value(state)' 2>"$errf") || rc=$?
  fi
  if [ "$rc" = 0 ]; then echo "${out##*$'\n'}"; return 0; fi
  if grep -q -e NOT_FOUND -e 'was not found' "$errf"; then echo NOT_FOUND; return 0; fi
  echo "$prog: could not read the state of $name: $(tail -n 1 "$errf")" >&2
  return 1
}

# The slice's state: the queued resource's until it is ACTIVE, then the TPU VM's.
slice_state() {
  local s
  if [ "$queued" = 1 ]; then
    s=$(describe_state qr) || return 1
    if [ "$s" != ACTIVE ]; then echo "$s"; return 0; fi
  fi
  describe_state vm
}

# Poll until the slice is READY: a line at each change of state and every 10 minutes, at most
# --active-timeout seconds.
wait_ready() {
  if [ "$dry" = 1 ]; then
    if [ "$queued" = 1 ]; then
      note "every $poll s, at most $active_timeout s, until the queued resource is ACTIVE and its TPU VM READY:"
    else
      note "every $poll s, at most $active_timeout s, until the TPU VM is READY:"
    fi
    [ "$queued" = 0 ] || show "${qr[@]}" describe "$name" "${where[@]}" --format='value(state.state)'
    show gcloud compute tpus tpu-vm describe "$name" "${where[@]}" --format='value(state)'
    return 0
  fi
  local start=$SECONDS s last="" told=$SECONDS
  while :; do
    s=$(slice_state) || s="$last"
    case "$s" in
      READY) say "$name is READY"; return 0 ;;
      FAILED|SUSPENDING|SUSPENDED|NOT_FOUND|PREEMPTED|TERMINATED|STOPPED|STOPPING)
        local kind="tpu-vm"
        [ "$queued" = 0 ] || kind="queued-resources"
        fail "$name is $s before it was READY; \`gcloud compute tpus $kind describe $name --zone=$zone\` says why" ;;
    esac
    if [ "$s" != "$last" ] || [ $((SECONDS - told)) -ge 600 ]; then
      say "$name: ${s:-state unknown} ($((SECONDS - start)) s waited)"; last="$s" told=$SECONDS
    fi
    if [ $((SECONDS - start)) -ge "$active_timeout" ]; then
      fail "$name not READY after $active_timeout s (still ${s:-unknown}); it may yet be provisioned and billed: delete it, or create again to keep waiting"
    fi
    sleep "$poll"
  done
}

create() { request; wait_ready; }

delete() {
  if [ "$queued" = 1 ]; then
    do_cmd "${qr[@]}" delete "$name" "${where[@]}" --force --quiet
  else
    do_cmd gcloud compute tpus tpu-vm delete "$name" "${where[@]}" --quiet
  fi
}

# --- the workers --------------------------------------------------------------------------------------
install() {
  local pkg
  if [ -n "$git_url" ]; then
    pkg="$(printf %q "git+${git_url#git+}")"
  elif [[ "$wheel" == http://* || "$wheel" == https://* ]]; then
    pkg="$(printf %q "$wheel")"
  elif [[ "$wheel" == gs://* ]]; then
    retry "install (copying the wheel)" "${ssh[@]}" --command="mkdir -p $remote_dir && gcloud storage cp $(printf %q "$wheel") $remote_dir/"
    pkg="$remote_dir/$(printf %q "${wheel##*/}")"
  elif [ -n "$wheel" ]; then
    [ "$dry" = 1 ] || [ -f "$wheel" ] || die "--wheel: no such file '$wheel'"
    retry "install (mkdir)" "${ssh[@]}" --command="mkdir -p $remote_dir"
    retry "install (scp of the wheel)" gcloud compute tpus tpu-vm scp "$wheel" "$name:remixer-t5/" "${where[@]}" --worker=all
    pkg="$remote_dir/$(printf %q "${wheel##*/}")"
  else  # this checkout's committed HEAD; uncommitted changes stay here
    [ -e "$repo/.git" ] || die "$repo is not a git checkout; pass --wheel or --repo"
    if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
      echo "$prog: warning: uncommitted changes in $repo are not copied (git archive HEAD)" >&2
    fi
    local tmp="${TMPDIR:-/tmp}/remixer-t5-XXXXXX"
    [ "$dry" = 1 ] || tmp="$(mktemp -d "$tmp")"
    do_cmd git -C "$repo" archive --format=tar.gz --prefix=remixer-t5/ -o "$tmp/remixer-t5.tar.gz" HEAD
    retry "install (scp of the checkout)" gcloud compute tpus tpu-vm scp "$tmp/remixer-t5.tar.gz" "$name:remixer-t5.tar.gz" "${where[@]}" --worker=all
    do_cmd rm -rf "$tmp"
    retry "install (unpacking)" "${ssh[@]}" --command="rm -rf $remote_dir && tar -xzf remixer-t5.tar.gz && rm remixer-t5.tar.gz"
    pkg="."
  fi
  local py; py="$(printf %q "$python")"
  # Ubuntu 22.04 ships Python 3.10; setup.py wants 3.11 (python3.11 and -venv are in universe).
  local apt="sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $py $py-venv"
  retry install "${ssh[@]}" --command="set -euo pipefail; command -v $py >/dev/null || { $apt; }; mkdir -p $remote_dir && cd $remote_dir &&\
 $py -m venv $venv && $venv/bin/pip install -q -U pip &&\
 $venv/bin/pip install -q $(printf %q "jax[tpu]==$jax_version") $pkg"
}

# The job: on each worker, job.sh runs remixer-t5 in a session of its own (setsid, nohup: no terminal, no
# SIGHUP when ssh goes), records its pid and, when it ends, its exit code, and appends its output to the log.
job_script() {
  local script=("cd $remote_dir || { echo 1 > $job_dir/exit; exit 1; }") e
  # Several hosts: every worker joins one JAX runtime (jax.distributed.initialize() detects the slice).
  if [ "$cores" -gt 8 ]; then script+=("export REMIXER_T5_DISTRIBUTED=auto"); fi
  for e in ${envs[@]+"${envs[@]}"}; do script+=("export ${e%%=*}=$(printf %q "${e#*=}")"); done
  script+=("$venv/bin/remixer-t5$(printf ' %q' "${args[@]}") &"
           "echo \$! > $job_dir/pid"
           "wait \$!"
           "echo \$? > $job_dir/exit.part && mv $job_dir/exit.part $job_dir/exit")
  printf ' %q' "${script[@]}"
}

# start_cmd TOKEN REPLACE: the remote command that starts the job. TOKEN names this start, so that a retried
# ssh finds the job it started and leaves it be; another job still running is refused, or with REPLACE=1
# (a restart) sent SIGTERM and, 120 s later, SIGKILL.
start_cmd() {
  printf '%s\n' "j=$job_dir; token=$1; replace=$2; devices='$tpu_devices'; mkdir -p \"\$j\"; printf '%s\\n'$(job_script) > \"\$j/job.sh.part\""
  cat <<'REMOTE'
h=$(hostname)
alive() { [ -s "$j/pid" ] && kill -0 "$(cat "$j/pid")" 2>/dev/null; }
if alive; then
  if [ "$(cat "$j/token" 2>/dev/null)" = "$token" ]; then echo "$h: job already started (pid $(cat "$j/pid"))"; exit 0; fi
  if [ "$replace" = 0 ]; then echo "REFUSED $h: a job is already running (pid $(cat "$j/pid")); stop it first"; exit 0; fi
  kill -TERM "$(cat "$j/pid")"
  for _ in $(seq 600); do alive || break; sleep 0.2; done
  if alive; then kill -KILL "$(cat "$j/pid")"; sleep 1; fi
fi
mv "$j/job.sh.part" "$j/job.sh"
# An earlier run's processes can hold the TPU, and libtpu's lock file can outlive them.
for p in $(sudo -n lsof -t $devices 2>/dev/null | sort -u); do sudo -n kill -9 "$p" 2>/dev/null || true; done
sudo -n rm -f /tmp/libtpu_lockfile 2>/dev/null || true
rm -f "$j/pid" "$j/exit" "$j/stopped"; echo "$token" > "$j/token"
echo "=== $(date -u '+%F %T') UTC: starting on $h" >> "$j/log"
nohup setsid bash "$j/job.sh" >> "$j/log" 2>&1 < /dev/null &
for _ in $(seq 100); do { [ -s "$j/pid" ] || [ -s "$j/exit" ]; } && break; sleep 0.1; done
echo "$h: started the job (pid $(cat "$j/pid" 2>/dev/null || echo '?')); log $j/log"
REMOTE
}

# One line per worker, fields separated by \037 (not whitespace: an empty field stays a field): a marker, the
# host, the job's state (running; exited, with its code; stopped by `stop`; saved: exit 0 after a SIGTERM that
# `stop` did not send; died: gone without an exit code; none: never started there), the exit code, the last
# error line since its start, its last log line.
status_cmd() {
  echo "j=$job_dir"
  cat <<'REMOTE'
h=$(hostname); code=""; s=""
if [ ! -s "$j/token" ]; then s=none
elif [ -s "$j/pid" ] && kill -0 "$(cat "$j/pid")" 2>/dev/null; then s=running
else
  # Between remixer-t5's end and job.sh's writing of its exit code the job looks dead: look again.
  [ -s "$j/exit" ] || sleep 2
fi
if [ -n "$s" ]; then :
elif [ -s "$j/exit" ]; then
  code=$(cat "$j/exit"); s=exited
  if [ -e "$j/stopped" ]; then s=stopped
  elif [ "$code" = 0 ] && awk '/^=== .* UTC: starting on /{r=0} /rerun the same command to resume/{r=1} END{exit !r}' "$j/log"; then s=saved
  fi
else s=died
fi
err=$(awk '/^=== .* UTC: starting on /{e=""} /error:/{e=$0} END{print e}' "$j/log" 2>/dev/null | tr '\037\r' '  ' | cut -c1-300)
last=$(tail -n 1 "$j/log" 2>/dev/null | tr '\037\r' '  ' | cut -c1-300)
printf 'remixer-t5-job\037%s\037%s\037%s\037%s\037%s\n' "$h" "$s" "$code" "$err" "$last"
REMOTE
}

job_live=0  # a job started by this launcher may be running: an interrupted launcher leaves the slice to it

run_job() {  # run_job [REPLACE]: start the job on every worker
  local token out line refused=""
  token="$(date -u +%Y%m%dT%H%M%S)-$$-$RANDOM"
  if [ "$dry" = 1 ]; then retry run "${ssh[@]}" --command="$(start_cmd "$token" "${1:-0}")"; return 0; fi
  out=$(retry "run (starting the job)" "${ssh[@]}" --command="$(start_cmd "$token" "${1:-0}")")
  job_live=1
  while IFS= read -r line; do
    if [[ "$line" == "REFUSED "* ]]; then refused="${line#REFUSED }"; else echo "$line"; fi
  done <<< "$out"
  [ -z "$refused" ] || { job_live=0; fail "$refused ($prog ... stop), or follow it ($prog ... watch -- ARGS)"; }
}

# job_status: one ssh to every worker. Sets js_hosts (a line per worker), n_workers and the counts n_running,
# n_done (exit 0), n_stopped, n_saved, n_died, n_none; js_codes (the nonzero exit codes), js_err (a failed
# worker's error line), js_last (the first worker's last log line). Exit 1 when a worker did not answer.
job_status() {
  local out rc=0 tag host s code err last
  out=$("${ssh[@]}" --command="$(status_cmd)" 2>&1) || rc=$?
  js_hosts=() js_codes="" js_err="" js_last="" n_workers=0 n_running=0 n_done=0 n_stopped=0 n_saved=0 n_died=0 n_none=0
  while IFS=$'\037' read -r tag host s code err last; do
    [ "$tag" = remixer-t5-job ] || continue
    n_workers=$((n_workers + 1))
    js_hosts+=("$host: $s${code:+ $code}${err:+ ($err)}${last:+; last line: $last}")
    case "$s" in
      running) n_running=$((n_running + 1)) ;;
      stopped) n_stopped=$((n_stopped + 1)) ;;
      saved) n_saved=$((n_saved + 1)) ;;
      died) n_died=$((n_died + 1)) ;;
      none) n_none=$((n_none + 1)) ;;
      exited) if [ "$code" = 0 ]; then n_done=$((n_done + 1)); else js_codes+=" $code"; [ -z "$err" ] || js_err="$host: $err"; fi ;;
    esac
    [ -n "$js_last" ] || js_last="$host: $last"
  done <<< "$out"
  if [ "$rc" != 0 ] || [ "$n_workers" = 0 ]; then
    echo "$prog: no answer from every worker of $name (exit $rc): ${out##*$'\n'}" >&2
    return 1
  fi
}

status() {
  if [ "$dry" = 1 ]; then
    [ "$queued" = 0 ] || show "${qr[@]}" describe "$name" "${where[@]}" --format='value(state.state)'
    show gcloud compute tpus tpu-vm describe "$name" "${where[@]}" --format='value(state)'
    show "${ssh[@]}" --command="$(status_cmd)"
    return 0
  fi
  local s h
  s=$(slice_state) || fail "could not read the state of $name"
  echo "$name: $s"
  [ "$s" = READY ] || return 0
  retry status job_status
  for h in "${js_hosts[@]}"; do echo "  $h"; done
}

logs() {
  local n="+1"
  [ "$lines" = 0 ] || n="$lines"
  retry logs "${ssh[@]}" --command="h=\$(hostname); tail -n $n $job_dir/log 2>/dev/null | while IFS= read -r l; do printf '%s: %s\\n' \"\$h\" \"\$l\"; done; true"
}

stop() {
  # SIGTERM: remixer-t5 saves at the end of its step and exits 0. Its waits on storage end within
  # $REMIXER_T5_STORAGE_TIMEOUT (600 s by default), so 900 s are waited here.
  retry stop "${ssh[@]}" --command="j=$job_dir; h=\$(hostname)
if [ -s \"\$j/pid\" ] && kill -0 \"\$(cat \"\$j/pid\")\" 2>/dev/null; then
  touch \"\$j/stopped\"; kill -TERM \"\$(cat \"\$j/pid\")\"
  for _ in \$(seq 4500); do kill -0 \"\$(cat \"\$j/pid\")\" 2>/dev/null || break; sleep 0.2; done
  if kill -0 \"\$(cat \"\$j/pid\")\" 2>/dev/null; then echo \"\$h: still running 900 s after SIGTERM\"; exit 1; fi
  echo \"\$h: stopped (exit \$(cat \"\$j/exit\" 2>/dev/null || echo '?'))\"
else echo \"\$h: no job running\"; fi"
}

# --- following the job --------------------------------------------------------------------------------
# The lease of MODEL_DIR's lock as the job has it: a rerun on other hosts takes the lock over once it lapses.
lock_lease=120
for e in ${envs[@]+"${envs[@]}"}; do
  if [[ "$e" =~ ^REMIXER_T5_LOCK_LEASE=([0-9]+)$ ]]; then lock_lease="${BASH_REMATCH[1]}"; fi
done

# recreate: the slice deleted (a preempted Spot TPU cannot be restarted, and a suspended queued resource is
# served no more), made again, installed, and the job started on it.
recreate() {
  job_live=0
  local s
  s=$(slice_state 2>/dev/null) || s=""
  if [ "$s" != NOT_FOUND ]; then delete; fi
  create
  install
  run_job
}

# watch_job ALLOWED: follows the job until it ends, with at most ALLOWED restarts. Returns 0 when the job
# exited 0 on every worker (or was stopped by `stop`); the job's exit code when it failed for a reason a rerun
# cannot fix (2: bad input, configuration or a refused MODEL_DIR; 3: NaN; 5: out of memory); 1 when no restart
# was left, the slice vanished or stopped, or the workers stopped answering.
watch_job() {
  local allowed="$1"
  if [ "$dry" = 1 ]; then
    note "every $poll s until the job has ended on every worker:"
    status
    note "when it has ended, the last lines of every worker's log:"
    logs
    if [ "$allowed" -gt 0 ]; then
      note "a slice PREEMPTED, TERMINATED or SUSPENDED: delete, create, install and run again;" \
        "a job that died on a READY slice: run again there (at most $allowed restarts)"
    fi
    job_live=0
    return 0
  fi
  local restarts=0 last="" told=0 fails=0 s why c
  no_restart() {
    if [ "$allowed" = 0 ]; then say "$1; not restarted (all --restart restarts)"
    else say "$1; no restart left (--max-restarts=$max_restarts)"; fi
  }
  while :; do
    if ! s=$(slice_state); then
      fails=$((fails + 1))
      if [ "$fails" -ge 10 ]; then fail "no state of $name in 10 checks; the job may still run: watch again"; fi
      sleep "$poll"; continue
    fi
    why=""
    case "$s" in
      READY)
        if ! job_status; then
          fails=$((fails + 1))
          if [ "$fails" -ge 10 ]; then fail "no answer from $name's workers in 10 checks; the job may still run: watch again"; fi
          sleep "$poll"; continue
        fi
        fails=0
        for c in $js_codes; do
          case "$c" in
            2) [[ "$js_err" == *"is in use by"* ]] \
                 || { say "the job failed (exit 2: bad input, configuration or a refused MODEL_DIR): $js_err"; job_live=0; logs || true; return 2; }
               why="MODEL_DIR's lock is held ($js_err); run again once its lease ($lock_lease s) has lapsed" ;;
            3|5|130) say "the job failed (exit $c${js_err:+: $js_err}); a rerun would fail the same way: not restarted"
                     job_live=0; logs || true; return "$c" ;;
            *) why="the job exited with $c${js_err:+ ($js_err)}" ;;
          esac
        done
        if [ -z "$why" ] && [ $((n_done + n_stopped)) = "$n_workers" ]; then
          if [ "$n_stopped" -gt 0 ]; then say "the job on $name was stopped by \`stop\`: not restarted"
          else say "the job finished on every worker of $name (exit 0)"; fi
          job_live=0; logs || true; return 0
        fi
        if [ -z "$why" ]; then
          if [ "$n_died" -gt 0 ]; then why="the job died on a worker (no exit code: killed)"
          elif [ "$n_none" -gt 0 ]; then why="a worker has no job (a replaced worker, or no run yet)"
          elif [ "$n_saved" -gt 0 ]; then why="the job saved and stopped after a SIGTERM that \`stop\` did not send"
          fi
        fi
        if [ -z "$why" ]; then  # still running
          if [ "$told" = 0 ] || { [ "$js_last" != "$last" ] && [ $((SECONDS - told)) -ge 600 ]; }; then
            say "$name running; $js_last"; last="$js_last" told=$SECONDS
          fi
          sleep "$poll"; continue
        fi
        if [ "$restarts" -ge "$allowed" ]; then no_restart "$why"; job_live=0; logs || true; return 1; fi
        restarts=$((restarts + 1))
        say "restart $restarts of $allowed: $why; running the same command again on $name (it resumes from the latest checkpoint in MODEL_DIR)"
        if [[ "$why" == *"lock is held"* ]]; then sleep "$lock_lease"; fi
        # No job on a worker (a new one), or remixer-t5 not found or not runnable (126, 127): install first.
        if [ "$n_none" -gt 0 ] || [[ " $js_codes " == *" 126 "* || " $js_codes " == *" 127 "* ]]; then install; fi
        run_job 1
        told=0 ;;
      PREEMPTED|TERMINATED|SUSPENDING|SUSPENDED|FAILED)
        job_live=0
        if [ "$restarts" -ge "$allowed" ]; then no_restart "$name is $s"; return 1; fi
        restarts=$((restarts + 1))
        say "restart $restarts of $allowed: $name is $s; recreating the slice and running the same command again (it resumes from the latest checkpoint in MODEL_DIR)"
        recreate
        told=0 ;;
      NOT_FOUND) job_live=0; say "$name no longer exists (deleted outside this launcher): nothing to follow"; return 1 ;;
      STOPPED|STOPPING) say "$name is $s (stopped outside this launcher): not restarted"; return 1 ;;
      *)
        if [ "$s" != "$last" ]; then say "$name: $s"; last="$s"; fi
        sleep "$poll" ;;
    esac
  done
}

# --- steps --------------------------------------------------------------------------------------------
tee_pid=""
if [ "$dry" = 0 ] && [ -n "$log" ]; then exec > >(tee -a "$log") 2>&1; tee_pid=$!; fi

# On the way out: the slice deleted when `all` (or `watch --delete`) armed it and no job of ours may be running
# (it ended, or a step before it failed); an interrupted launcher (Ctrl-C, a closed ssh session) leaves a started
# job and its slice running, as does one that lost contact with them.
armed=0
on_exit() {
  local rc=$?
  trap - EXIT
  if [ "$armed" = 1 ]; then
    if [ "$job_live" = 1 ]; then
      echo "$prog: $name and its job keep running: follow it with watch, stop it with stop, delete the slice with delete" >&2
    else
      delete || echo "$prog: warning: deleting $name failed; delete it yourself (an idle slice is billed)" >&2
    fi
  fi
  [ -z "$errf" ] || rm -f "$errf"
  if [ -n "$tee_pid" ]; then exec >&- 2>&-; wait "$tee_pid" 2>/dev/null || true; fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

case "$step" in
  create) create ;;
  install) install ;;
  run) run_job ;;
  status) status ;;
  logs) logs ;;
  stop) stop ;;
  watch) job_live=1; armed="$delete"; watch_job "$max_restarts" ;;
  delete) delete ;;
  all)
    request
    [ "$keep" = 1 ] || armed=1  # armed once the request is in: never delete a slice this launcher did not make
    wait_ready; install; run_job
    if [ "$restart" = 1 ]; then watch_job "$max_restarts"; else watch_job 0; fi ;;
esac
