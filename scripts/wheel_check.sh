#!/usr/bin/env bash
# Build a wheel, install it into a fresh venv and run `remixer-t5 info` from outside the repository.
# Usage: scripts/wheel_check.sh [PYTHON_WITH_DEPS] [--full]
#   default: the fresh venv borrows the dependencies of PYTHON_WITH_DEPS's environment (a .pth file), so the
#            check takes seconds; --full installs the wheel with its pinned dependencies from the registry.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${1:-$repo/.venv/bin/python}"
full="${2:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$repo"
wheel="$(ls "$work"/dist/remixer_t5-*.whl)"
python3 -m venv "$work/venv"
if [ "$full" = "--full" ]; then
  "$work/venv/bin/pip" install --quiet "$wheel"
else
  deps="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$deps" > "$site/_remixer_t5_deps.pth"
  "$work/venv/bin/pip" install --quiet --no-deps "$wheel"
fi
cd "$work"  # outside the repository: only the installed wheel can provide the package, tasks and gin files
"$work/venv/bin/python" - <<'PY'
import pathlib, remixer_t5, remixer_t5.tasks, remixer_t5.gin_utils
where = pathlib.Path(remixer_t5.__file__).resolve()
assert "site-packages" in str(where), f"imported {where}, not the installed wheel"
assert (remixer_t5.gin_utils.gin_dir() / "models/t5_1_1/small.gin").is_file(), remixer_t5.gin_utils.gin_dir()
csrc = where.parent / "kernels" / "cpu" / "csrc"
for name, what in [("hypermixing.cc", "the HyperMixing handlers'"), ("materialize.cc", "dropout's mask handler's"),
                   ("for_each.h", "the handlers' shared header's")]:
  assert (csrc / name).is_file(), f"{what} source {name} is not in the wheel ({csrc})"
print("installed package:", where.parent)
PY
"$work/venv/bin/remixer-t5" info --gin_file=models/t5_1_1/small.gin --json | tail -n 1
