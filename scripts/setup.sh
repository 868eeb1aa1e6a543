#!/usr/bin/env bash
# Set up dsv4 in the current Python environment (use a venv if you like: python3 -m venv .venv && . .venv/bin/activate).
#   bash scripts/setup.sh          # the package and its runtime dependencies
#   bash scripts/setup.sh --test   # plus the test dependencies (pytest, ruff, triton for the interpreter tests, transformers)
# An existing torch (e.g. a CUDA build) is kept as it is; with no torch, the CPU build is installed.
# pip installs without byte-compiling; what it wrote is compiled afterwards on every core at once (pip compiles
# one file at a time: 37 of torch's 51 s install on 2 cores, against 21 s in parallel; the same .pyc files).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=$(mktemp)  # what pip writes from here on is newer than this file
trap 'rm -f "$stamp"' EXIT

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: no torch found, installing the CPU build"
  "$PY" -m pip install -q --no-compile "torch==2.13.0" \
    || "$PY" -m pip install -q --no-compile torch --index-url https://download.pytorch.org/whl/cpu
else
  echo "setup: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi

extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
fi
"$PY" -m pip install -q --no-compile -e ".${extras}"
# byte-compile the packages pip wrote in this run (the entries of site-packages changed since the stamp; a
# file that only a newer Python parses fails here as it does under pip: ignored)
while IFS= read -r site; do
  changed=()  # (a read loop, not mapfile: bash 3.2 has none)
  while IFS= read -r -d '' entry; do changed+=("$entry"); done < <(find "$site" -mindepth 1 -maxdepth 1 -newer "$stamp" -print0 2>/dev/null)
  if [ "${#changed[@]}" -gt 0 ] && [ -w "$site" ]; then
    "$PY" -m compileall -q -j 0 "${changed[@]}" >/dev/null 2>&1 || true
  fi
done < <("$PY" -c 'import sysconfig as s; print(*sorted({s.get_path("purelib"), s.get_path("platlib")}), sep="\n")')
echo "setup: done ($("$PY" -c 'import dsv4, torch; print("dsv4", dsv4.__version__, "torch", torch.__version__)'))"
