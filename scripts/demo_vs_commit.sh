#!/usr/bin/env bash
# `make demo`'s run (T5.1.1 tiny, runs/demo.gin) at HEAD against another commit's, on this host: both commits
# installed from `git archive` (committed files only, so a dirty work tree is not measured) into folders of
# their own and run with this venv's interpreter, in ABBA order ROUNDS times (both see the same drift in load).
#   scripts/demo_vs_commit.sh BASE_COMMIT        (ROUNDS=1 by default: base, here, here, base)
# Prints each run's wall seconds and last validation line, then the medians and here/base.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: scripts/demo_vs_commit.sh BASE_COMMIT}
PY=${PYTHON:-$PWD/.venv/bin/python}
ROUNDS=${ROUNDS:-1}
export JAX_PLATFORMS=cpu
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
for side in base here; do
  rev=$([ "$side" = base ] && echo "$BASE" || echo HEAD)
  mkdir -p "$WORK/$side-src"
  git archive "$rev" | tar -x -C "$WORK/$side-src"
  "$PY" -m pip install --quiet --no-deps --no-build-isolation --target "$WORK/$side" "$WORK/$side-src" >/dev/null
  echo "$side: $(git rev-parse --short "$rev")"
done
declare -A secs=([base]="" [here]="")
run() {  # side, run number
  local dir="$WORK/run-$1-$2" start s
  start=$(date +%s%N)
  (cd "$WORK" && PYTHONPATH="$WORK/$1" "$PY" -m remixer_t5 train --gin_file=models/t5_1_1/tiny.gin \
     --gin_file=runs/demo.gin --gin.MODEL_DIR="'$dir'" > "$dir.log" 2>&1) || { tail -n 20 "$dir.log"; exit 1; }
  s=$(( ($(date +%s%N) - start) / 1000000 )); s="${s%???}.${s: -3}"
  secs[$1]="${secs[$1]} $s"
  echo "$1 run $2: $s s; $(grep '^\[validation\]' "$dir.log" | tail -n 1)"
}
for r in $(seq "$ROUNDS"); do
  run base "$r.1"; run here "$r.1"; run here "$r.2"; run base "$r.2"
done
"$PY" - "${secs[base]}" "${secs[here]}" <<'PYEOF'
import statistics, sys
b, h = ([float(x) for x in s.split()] for s in sys.argv[1:3])
print(f"demo: base median {statistics.median(b):.1f} s, here {statistics.median(h):.1f} s, "
      f"here/base {statistics.median(h) / statistics.median(b):.3f}")
PYEOF
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(nproc) cores); load: $(cut -d' ' -f1-3 /proc/loadavg)"
