#!/usr/bin/env bash
# The whole test suite on a machine with a CUDA GPU, plus the checks whose numbers the README quotes.
#   OUT=/some/dir bash scripts/gpu_suite.sh
# Writes under $OUT (default ./out/gpu-suite): junit.xml (every test with its outcome), summary.txt (machine,
# versions, date, the pytest counts, the teacher-forcing numbers), pytest.log (the run's output) and times.tsv
# (each test phase's seconds as it ends, so a run stopped by a time limit still says where its time went); prints
# the failures as they come and the counts. WORKERS=N sets the pytest workers (default: one per core).
# Exit code: pytest's. The serving tests need fastapi, uvicorn and openai: where they are missing and a folder of
# wheels is at hand (WHEELS, default .whl/: theirs and those they need, e.g. from `pip download` elsewhere),
# every wheel there is installed into a folder put on PYTHONPATH (no index, no change to the environment);
# where they are still missing, the suite says so before it starts.
# The tests say which device they mean (the CPU interpreter, gloo on the CPU, or CUDA where a test is about
# CUDA), so the same suite must pass with or without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-suite}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$PY" -c 'import torch, platform; print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"
  nproc | sed 's/^/cpu cores: /'
} > "$OUT/summary.txt"

serving_deps() { "$PY" -c 'import fastapi, uvicorn, openai' 2>/dev/null; }
WHEELS=${WHEELS:-.whl}
if ! serving_deps && compgen -G "$WHEELS/*.whl" >/dev/null; then  # into a folder of their own, on the path
  site="${TMPDIR:-/tmp}/dsv4-suite-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH="$site:$PYTHONPATH"
fi
serving_deps || echo "warning: fastapi / uvicorn / openai are not installed: the serving tests will fail" \
  "(pip install -e '.[test]', or put their wheels, with those they need, in $WHEELS/)" | tee -a "$OUT/summary.txt" >&2

start=$(date +%s)
export DSV4_TEST_TIMES="$OUT/times.tsv"
: > "$DSV4_TEST_TIMES"
# one worker per core (the suite's own default is the 2-core CI machine's); -v names every failure as it
# happens, so a run stopped by a time limit still says which tests failed
# idle workers take queued tests from busy ones (pytest-xdist 3.2+), so a few long tests do not set the run's end
dist=$("$PY" -c 'import xdist; print("worksteal" if tuple(map(int, xdist.__version__.split(".")[:2])) >= (3, 2) else "load")' 2>/dev/null || echo load)
"$PY" -m pytest -p no:cacheprovider -n "${WORKERS:-$(nproc)}" --dist "$dist" -v --durations=40 --junitxml="$OUT/junit.xml" -rfEs 2>&1 |
  tee "$OUT/pytest.log" | grep -E --line-buffered " (FAILED|ERROR) |^(FAILED|ERROR) |[0-9]+ (passed|failed)"
rc=${PIPESTATUS[0]}
{
  echo "pytest exit code: $rc, $(( $(date +%s) - start )) s"
  grep -E "^(=+ )?[0-9]+ (passed|failed)" "$OUT/pytest.log" | tail -1
  echo "longest test phases (seconds, phase, outcome, test):"
  sort -rn "$DSV4_TEST_TIMES" | head -12 | sed 's/^/  /'
  echo "teacher forcing on tiny (CPU, the README's numbers):"
  for flags in "" "--fast-accumulation"; do
    "$PY" -m dsv4 check teacher-forcing --preset tiny --device cpu $flags --json 2>&1 | tail -1 | sed "s/^/  ${flags:-default}: /"
  done
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit "$rc"
