#!/usr/bin/env bash
# A model's train step at this tree against another commit's, on this machine: `remixer-t5 bench train` in fresh
# processes, the two trees alternating ROUNDS times (so both see the same drift in load), medians per tree.
#   scripts/bench_step_vs_commit.sh BASE_COMMIT [MODEL ...]     (default models: t5_1_1 remixer)
# Each model runs its COGS config (models/<model>/cogs.gin + runs/cogs_scratch.gin: batch 4, 64/320, dropout
# 0.1) on random tokens; STEPS (default 20) timed steps after WARMUP (3). The base commit is checked out in a
# temporary git worktree and run with this venv. Prints one line per round and a summary per model.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: scripts/bench_step_vs_commit.sh BASE_COMMIT [MODEL ...]}; shift
MODELS=${*:-t5_1_1 remixer}
PY=${PYTHON:-$PWD/.venv/bin/python}
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-20}; WARMUP=${WARMUP:-3}
export JAX_PLATFORMS=cpu
WT=$(mktemp -d); trap 'git worktree remove --force "$WT" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$WT" "$BASE"
step() {  # tree, model -> seconds per step
  (cd "$1" && PYTHONPATH="$1" "$PY" -m remixer_t5.cli bench train --gin_file="models/$2/cogs.gin" \
     --gin_file=runs/cogs_scratch.gin --steps="$STEPS" --warmup="$WARMUP" --rounds=1 --json 2>/dev/null \
   | tail -n 1 | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read())["ours_s_per_step"])')
}
for m in $MODELS; do
  here=(); base=()
  for r in $(seq "$ROUNDS"); do
    b=$(step "$WT" "$m"); h=$(step "$PWD" "$m"); base+=("$b"); here+=("$h")
    echo "$m round $r: base $(git rev-parse --short "$BASE") $b s, here $(git rev-parse --short HEAD)$( [ -n "$(git status --porcelain --untracked-files=no)" ] && echo +dirty) $h s"
  done
  "$PY" - "$m" "${base[*]}" "${here[*]}" <<'PYEOF'
import statistics, sys
m, b, h = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
print(f"{m}: base median {statistics.median(b)*1e3:.1f} ms, here {statistics.median(h)*1e3:.1f} ms, "
      f"here/base {statistics.median(h)/statistics.median(b):.3f}")
PYEOF
done
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(nproc) cores); load: $(cut -d' ' -f1-3 /proc/loadavg)"
