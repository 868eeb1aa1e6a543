#!/usr/bin/env bash
# The serving figures BENCHMARKS.md records, on one GPU, in stages that each fit a 10-minute command:
#   OUT=/some/dir bash scripts/gpu_serving.sh engine     # dsv4 bench engine at 64 and 256 clients (+ profile)
#   OUT=/some/dir bash scripts/gpu_serving.sh serve64    # dsv4 bench serve at 64 clients, with transformers
#   OUT=/some/dir bash scripts/gpu_serving.sh serve256   # dsv4 bench serve at 256 clients, with transformers
#   OUT=/some/dir bash scripts/gpu_serving.sh spec       # speculative decoding at batch 1 (bench_speculative)
#   OUT=/some/dir bash scripts/gpu_serving.sh specserve  # the server with and without it, 1-4 clients, T = 0 and 1
#                                                        # (TEMPS="0": greedy only; PROMPTS=code: source-code prompts;
#                                                        #  CLIENTS="4": those client counts only; KS="0 2": drafts per
#                                                        #  step, 0 = without; REQUESTS=N per run, default 32)
#   OUT=/some/dir bash scripts/gpu_serving.sh determ     # the price of --deterministic at 64 clients
#   OUT=/some/dir bash scripts/gpu_serving.sh budget     # the engine at 256 clients, 2048 vs 4096 tokens per step
#   OUT=/some/dir bash scripts/gpu_serving.sh stream     # bench serve, 256 clients, Poisson arrivals at 300/s
#   OUT=/some/dir bash scripts/gpu_serving.sh prefill    # steps of prompts alone at 2048 (off) vs 8192 tokens:
#                                                        # the engine and the server at 64 clients (CLIENTS="64 256":
#                                                        # the engine at those too)
#   OUT=/some/dir bash scripts/gpu_serving.sh latency    # the server at 64 and 256 clients (CLIENTS="64": those only)
#                                                        # with a burst's own step off (--max-prefill-tokens 2048)
#                                                        # and on (the default; PREFILLS="8192 16384": those
#                                                        # budgets, 16384 a whole 64-prompt wave in one step);
#                                                        # at 256 also the engine process
#                                                        # with 4 compute threads (its CPU ops are bookkeeping)
# Every figure is the median of 3 or more timed runs with min and max, written as JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-serving}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
COMMON=(--preset small --device cuda --prompt-len 128 --output-len 64)

case "${1:-}" in
  engine)
    "$PY" -m dsv4 bench engine "${COMMON[@]}" --clients 64 256 --repeats 3 --profile "$OUT/prof" --out "$OUT/engine.json" ;;
  serve64)
    "$PY" -m dsv4 bench serve "${COMMON[@]}" --clients 64 --repeats 3 --hf 64 256 --out "$OUT/serve64.json" ;;
  serve256)
    "$PY" -m dsv4 bench serve "${COMMON[@]}" --clients 256 --repeats 3 --hf 64 256 --out "$OUT/serve256.json" ;;
  spec)
    "$PY" scripts/bench_speculative.py --device cuda --tokens 256 --k 2 3 --repeats 5 | tee "$OUT/spec.jsonl" ;;
  specserve)
    for t in ${TEMPS:-0 1}; do  # greedy clients, then sampling ones (each request its own seed; TEMPS="0": greedy only)
      for k in ${KS:-0 2 3}; do  # (32 requests: a run of 8 at 4 clients is two waves, its ramp and drain most of it)
        "$PY" -m dsv4 bench serve --device cuda --clients ${CLIENTS:-1 4} --requests "${REQUESTS:-32}" --output-len 128 --repeats 3 --no-raw \
          --temperature "$t" --speculative "$k" --prompts "${PROMPTS:-random}" --out "$OUT/serve-spec$k-t$t-${PROMPTS:-random}.json"
      done
    done ;;
  determ)
    for flag in "" "--deterministic"; do
      "$PY" -m dsv4 bench engine "${COMMON[@]}" --clients 64 --repeats 3 --no-raw $flag \
        --out "$OUT/engine${flag:+-deterministic}.json"
    done ;;
  budget)
    for n in 2048 4096; do
      "$PY" -m dsv4 bench engine "${COMMON[@]}" --clients 256 --repeats 3 --max-batch-tokens "$n" \
        --out "$OUT/engine-budget$n.json"
    done ;;
  stream)
    "$PY" -m dsv4 bench serve "${COMMON[@]}" --clients 256 --request-rate 300 --repeats 3 --no-raw \
      --out "$OUT/serve-stream.json" ;;
  prefill)
    for n in 2048 8192; do
      "$PY" -m dsv4 bench engine "${COMMON[@]}" --clients ${CLIENTS:-64} --repeats 3 --no-raw --max-prefill-tokens "$n" \
        --out "$OUT/engine-prefill$n.json"
    done
    for n in 2048 8192; do
      "$PY" -m dsv4 bench serve "${COMMON[@]}" --clients 64 --repeats 3 --no-raw --max-prefill-tokens "$n" \
        --out "$OUT/serve64-prefill$n.json"
    done ;;
  latency)
    for c in ${CLIENTS:-64 256}; do
      for n in ${PREFILLS:-2048 8192}; do
        "$PY" -m dsv4 bench serve "${COMMON[@]}" --clients "$c" --repeats 3 --no-raw --max-prefill-tokens "$n" \
          --out "$OUT/latency$c-prefill$n.json"
      done
      if [ "$c" = 256 ]; then
        "$PY" -m dsv4 bench serve "${COMMON[@]}" --clients 256 --repeats 3 --no-raw --threads 4 \
          --out "$OUT/latency256-threads4.json"
      fi
    done ;;
  *)
    sed -n 2,23p "$0"; exit 2 ;;
esac
