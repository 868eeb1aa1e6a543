#!/usr/bin/env bash
# A DSpark draft for the shipped model, trained and measured on one GPU (one command of under 10 minutes):
#   OUT=/some/dir bash scripts/gpu_dspark.sh [STEPS]
# 1. `dsv4 train` trains a DSpark draft (3 window-only stages over the last three layers, blocks of 5) on
#    the shipped model with the main model frozen (--freeze-main: the draft learns the main model's own
#    predictions, `dsv4.train.dspark_loss`), STEPS steps (default 300) of 128 x 512 tokens of the running
#    Python's standard library, and exports it beside the main model's weights to $WORK/dspark-mini;
# 2. `scripts/bench_speculative.py` times batch-1 greedy decoding of the shipped model plain, with its MTP
#    draft (k = 2, 3) and with the DSpark draft (k = 3, 4; confidence threshold 0 and 0.5), 256 tokens per
#    prompt, the median of 5 runs with min and max, and checks that every setting's tokens are plain
#    decoding's.
# Writes under $OUT: train.log, train-metrics.jsonl, loss.png, spec.jsonl. WORK (default /tmp/dspark-work)
# holds the run and the exported checkpoint (about 25 MB).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-dspark}
WORK=${WORK:-/tmp/dspark-work}
STEPS=${1:-300}
DEVICE=${DEVICE:-cuda}  # (DEVICE=cpu: a smoke test of the script)
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
rm -rf "$WORK/run" "$WORK/dspark-mini"  # (ours: made by the last run of this script)

"$PY" -m dsv4 train --model dsv4/assets/stdlib-v4-mini --draft dspark --freeze-main --device "$DEVICE" \
  --max-docs 0 --seq-len 512 --batch-size 128 --lr 2.5e-3 --warmup 30 --schedule cosine --steps "$STEPS" \
  --eval-every 100 --save-every -1 --out "$WORK/run" --export "$WORK/dspark-mini" --no-progress 2>&1 |
  tee "$OUT/train.log" | grep -vE "^step [0-9]+/" || true
cp "$WORK/run/metrics.jsonl" "$OUT/train-metrics.jsonl" 2>/dev/null
cp "$WORK/run/loss.png" "$OUT/loss.png" 2>/dev/null
[ -d "$WORK/dspark-mini" ] || { echo "error: training did not export the draft"; exit 1; }

"$PY" scripts/bench_speculative.py --device "$DEVICE" --tokens 256 --k 2 3 --dspark "$WORK/dspark-mini" \
  --dspark-k 3 4 --threshold 0 0.5 --repeats 5 | tee "$OUT/spec.jsonl"
