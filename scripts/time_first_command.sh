#!/usr/bin/env bash
# README's first command on a fresh machine, timed: a clone of this checkout's HEAD, a new virtual environment
# (no torch: the setup installs the CPU build), then README's first command exactly as README.md writes it.
# Prints each run's wall time, then the median with min and max. Needs the package registries (or pip's cache).
#   bash scripts/time_first_command.sh            # 3 runs
#   RUNS=5 SETUP=/path/to/setup.sh bash scripts/time_first_command.sh   # SETUP: another setup.sh to compare
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-3}
PY=${PYTHON:-python3}
cmd=$(awk '/^```bash/ { getline; print; exit }' "$ROOT/README.md" | sed 's/ *#.*$//')
if [ -z "$cmd" ]; then
  echo "time_first_command: no bash block in $ROOT/README.md" >&2
  exit 2
fi
case "$RUNS" in
  '' | *[!0-9]* | 0) echo "time_first_command: RUNS must be a whole number >= 1, got '$RUNS'" >&2; exit 2 ;;
esac
if [ -n "${SETUP:-}" ] && [ ! -f "$SETUP" ]; then
  echo "time_first_command: SETUP=$SETUP is not a file" >&2
  exit 2
fi
echo "command: $cmd"
echo "commit $(git -C "$ROOT" rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores${SETUP:+, setup.sh from $SETUP}"
times=()
for i in $(seq "$RUNS"); do
  work=$(mktemp -d)
  git clone -q "$ROOT" "$work/repo"
  if [ -n "${SETUP:-}" ]; then cp "$SETUP" "$work/repo/scripts/setup.sh"; fi
  "$PY" -m venv "$work/venv"
  start=$("$PY" -c 'import time; print(time.time())')
  if ! (source "$work/venv/bin/activate" && cd "$work/repo" && env -u PYTHONPATH bash -c "$cmd") >"$work/log" 2>&1; then
    echo "run $i failed; its output: $work/log" >&2
    exit 1
  fi
  t=$("$PY" -c "import time; print(time.time() - $start)")
  printf 'run %d: %.1f s\n' "$i" "$t"
  times+=("$t")
  rm -rf "$work"
done
printf '%s\n' "${times[@]}" | sort -n | awk '{ v[NR] = $1 } END { printf "median %.1f s (min %.1f, max %.1f) of %d runs\n", v[int((NR + 1) / 2)], v[1], v[NR], NR }'
