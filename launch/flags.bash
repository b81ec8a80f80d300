# Shared by launch/*.sh (sourced, not run): error exit and "--flag VALUE | --flag=VALUE" parsing.
# The sourcing script sets $prog first.

die() { echo "$prog: error: $* (see $prog --help)" >&2; exit 2; }  # one line, exit 2

# take FLAG WHAT "$@": sets $val and how many words were used in $used.
take() {
  local flag="$1" what="$2"; shift 2
  if [[ "$1" == *=* ]]; then val="${1#*=}"; used=1
  elif [ $# -ge 2 ] && [[ "$2" != -* ]]; then val="$2"; used=2
  else die "$flag needs a value ($what); write $flag=VALUE for a value that starts with '-'"; fi
  [ -n "$val" ] || die "$flag needs a non-empty value ($what)"
}
