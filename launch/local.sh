#!/usr/bin/env bash
# Run a remixer-t5 command on the local host with the repository's .venv.
#   launch/local.sh [--dry-run] [--] train --gin_file=runs/demo.gin --gin.MODEL_DIR="'runs/x'"
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-}" in
  -h|--help)
    echo "Usage: launch/local.sh [--dry-run] [--] REMIXER_T5_ARGS...  (runs .venv/bin/remixer-t5; --dry-run prints it)"
    exit 0 ;;
esac
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi  # same separator as tpu_vm.sh and slurm.sh
if [ $# -eq 0 ]; then
  echo "local.sh: error: missing remixer-t5 arguments, e.g. train --gin_file=runs/demo.gin (see local.sh --help)" >&2
  exit 2
fi
cmd=("$repo/.venv/bin/remixer-t5" "$@")
if [ "$dry" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
[ -x "$repo/.venv/bin/remixer-t5" ] || make -C "$repo" install
exec "${cmd[@]}"
