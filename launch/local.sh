#!/usr/bin/env bash
# Run a remixer-t5 command on this machine with the repository's .venv.
#   launch/local.sh [--dry-run] train --gin_file=runs/demo.gin --gin.MODEL_DIR="'runs/x'"
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
cmd=("$repo/.venv/bin/remixer-t5" "$@")
if [ "$dry" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
[ -x "$repo/.venv/bin/remixer-t5" ] || make -C "$repo" install
exec "${cmd[@]}"
