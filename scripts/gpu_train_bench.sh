#!/usr/bin/env bash
# The training step's figures on one GPU, each the median of REPS timed steps (default 3) with min and max:
#   1. the full training step at `small`, 1 x 2048 tokens (fp32 master weights, bf16 autocast, all losses,
#      clipping, Muon + AdamW, router bias; forward + backward and the update each replayed from a CUDA graph)
#   2. the optimizer part alone at `small` (clipping, Muon + AdamW, router bias; the update from a CUDA graph)
#      and its share of step 1
#   3. the full step and its MFU at `medium`, ACCUM (default 8; 2 on the CPU) micro-batches of 1 x 4096 tokens a step
#      (gradient accumulation: one update per 32,768 tokens), with activation checkpointing
# Prints the commit and date first; every figure comes from `dsv4 bench train` (its JSON rows are kept under
# $OUT, default out/gpu-train-bench).
#   bash scripts/gpu_train_bench.sh                          # one GPU
#   bash scripts/gpu_train_bench.sh --device cpu --preset tiny   # the same commands on the CPU, a smoke run
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
REPS=${REPS:-3}
OUT=${OUT:-out/gpu-train-bench}
DEVICE=cuda
PRESET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --preset) PRESET=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (takes --device DEV, --preset NAME)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [ "$DEVICE" = cpu ]; then       # a smoke run: small shapes, no CUDA graphs
  SMALL=${PRESET:-tiny}; BIG=${PRESET:-tiny}; SEQ=64; BIG_SEQ=64; DEV=(--device cpu --allow-cpu); GRAPH=()
  ACCUM=${ACCUM:-2}
else
  SMALL=${PRESET:-small}; BIG=${PRESET:-medium}; SEQ=2048; BIG_SEQ=4096; DEV=(--device "$DEVICE"); GRAPH=(--cuda-graph)
  ACCUM=${ACCUM:-8}
fi

echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (uncommitted changes)')"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
"$PY" -c 'import torch; print("torch", torch.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'

bench() {  # NAME ARGS...: one `dsv4 bench train` run, its rows kept as $OUT/NAME.jsonl
  local name=$1; shift
  "$PY" -m dsv4 bench train "${DEV[@]}" --reps "$REPS" --no-reference --jsonl "$@" > "$OUT/$name.jsonl"
}
bench full --preset "$SMALL" --batch 1 --seq-len "$SEQ" --optimizer "${GRAPH[@]}"
bench optimizer --preset "$SMALL" --optimizer-only "${GRAPH[@]}"
bench mfu --preset "$BIG" --batch 1 --seq-len "$BIG_SEQ" --grad-accum "$ACCUM" --optimizer --activation-checkpointing \
  "${GRAPH[@]}"

"$PY" - "$OUT" "$SMALL" "$SEQ" "$BIG" "$BIG_SEQ" <<'PYEOF'
import json, statistics, sys
out, small, seq, big, big_seq = sys.argv[1:]

def row(name):
    rows = [json.loads(line) for line in open(f"{out}/{name}.jsonl") if '"path"' in line]
    return rows[0]

def spread(r, scale=1e3, unit="ms"):
    t = [x * scale for x in r["s_reps"]]
    return f"{statistics.median(t):.2f} {unit} (min {min(t):.2f}, max {max(t):.2f}, {len(t)} steps)"

full, opt, mfu = row("full"), row("optimizer"), row("mfu")
tok = lambda r, t: r.get("grad_accum", 1) * r["batch"] * r["seq"] / t
print(f"full step, {small} 1 x {seq}: {spread(full)}; {tok(full, full['s']):,.0f} tokens/s; "
      f"optimizer {full['optimizer']}")
print(f"optimizer only, {small}: {spread(opt)}; muon {opt['muon']}, adamw {opt['adamw']}, "
      f"cuda graph {opt['cuda_graph']}; {100 * opt['s'] / full['s']:.1f}% of the full step's median")
m = f"MFU {100 * mfu['mfu']:.1f}% of {mfu['peak_tflops']} TFLOP/s" if "mfu" in mfu else \
    f"{mfu['model_tflops']} model TFLOP/s (no peak known for this device)"
print(f"full step, {big} {mfu.get('grad_accum', 1)} x 1 x {big_seq} (micro-batches), activation checkpointing: "
      f"{spread(mfu)}; "
      f"{tok(mfu, mfu['s']):,.0f} tokens/s; {m}")
PYEOF
