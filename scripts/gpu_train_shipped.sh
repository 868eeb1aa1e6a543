#!/usr/bin/env bash
# Train the larger shipped-model candidate (dsv4/train/recipes/pycode-base.toml) on one GPU in stages, each
# short enough for a command limit, every stage resuming from the last one's checkpoint on this machine.
#   RUN=/some/dir MINUTES=25 bash scripts/gpu_train_shipped.sh probe   # corpus, tokenized data, speed -> steps
#   RUN=/some/dir STAGE_S=420 bash scripts/gpu_train_shipped.sh stage  # one stage (repeat until it says done)
#   RUN=/some/dir OUT=/dir bash scripts/gpu_train_shipped.sh finish    # export, FP8 + MXFP4 copy, evaluations
# probe: writes $RUN/corpus.json (stdlib + installed packages), $RUN/functions (its documented functions in
# the completion prompts' form, `dsv4.train.functions`) and $RUN/chat (the public ones as V4 chat exchanges:
# asked for by signature and docstring, answered with the code; `--chat`), tokenizes all three into
# $RUN/cache, times 30 steps and writes $RUN/steps: the steps that fill MINUTES of training at that speed.
# stage: trains for STAGE_S seconds (`--stop-after-s`) from the run's latest checkpoint and prints the
# stage's summary; the stage that reaches the last step exports $RUN/export (bf16). finish: `dsv4 convert
# --to fp8 --expert-dtype fp4` into $OUT/model (the shipped layout) and `dsv4 eval heldout` / `completions`
# / `chat` on it and on the shipped model (held-out loss and completions also on the run's own held-out
# split of corpus.json, besides the stdlib's that the shipped model was measured on); $OUT/record.tar.gz
# holds the evaluations' JSON, metrics.jsonl, loss.png and the summary (so $OUT is eight files: the model's
# seven and the record). EVAL=candidate evaluates the candidate alone, EVAL=0 neither. Where --cuda-graph
# training fails in the probe, the stages train eagerly. SMOKE=1 runs every part at toy sizes (a CPU check
# of the pipeline, not a training run). INIT=dir continues training a model (e.g. an earlier run's export or
# its FP8 + MXFP4 copy) instead of starting from random weights: the recipe's schedule runs again from its
# start (give it EXTRA="--lr ... --warmup ..." for a gentler one). EXTRA: more `dsv4 train` flags for the probe
# and every stage. STEPS=N makes the probe write the corpus and set the steps to N without timing any (the
# first stage then tokenizes the data). EX_COPIES=N (default 4; 0: none): the probe also writes $RUN/exercises
# (`dsv4.train.exercises`: everyday functions from templates, each run, none solving a held-out task, each
# written N times) and $RUN/ex-chat (the same as chat exchanges), and every stage trains on them too.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RUN=${RUN:-runs/pycode}
OUT=${OUT:-$RUN/out}
MINUTES=${MINUTES:-25}
STAGE_S=${STAGE_S:-420}  # (+ start-up, a checkpoint and, last, the export: under 10 minutes)
RECIPE=dsv4/train/recipes/pycode-base.toml
TOK=dsv4/assets/stdlib-v4-mini
mkdir -p "$RUN" "$OUT"
HELD=2.0  # the recipe's held_out_pct (the function examples leave out the same documents)
[ "${SMOKE:-0}" = 1 ] && HELD=20
EX_COPIES=${EX_COPIES:-4}
EXERCISES=()
[ "$EX_COPIES" != 0 ] && EXERCISES=("$RUN/exercises" "$RUN/ex-chat")
COMMON=(--train-config "$RECIPE" --data "$RUN/corpus.json" "$RUN/functions" "$RUN/chat" ${EXERCISES[@]+"${EXERCISES[@]}"}
  --held-out-pct "$HELD" --tokenizer "$TOK" --cache-dir "$RUN/cache" --no-progress)
[ -n "${INIT:-}" ] && COMMON+=(--model "$INIT")
# shellcheck disable=SC2206  # EXTRA is a list of flags, split on spaces on purpose
[ -n "${EXTRA:-}" ] && COMMON+=($EXTRA)
if [ "${SMOKE:-0}" = 1 ]; then  # toy sizes: the pipeline on a CPU
  COMMON+=(--max-docs 40 --batch-size 2 --seq-len 128 --eval-every 2 --eval-windows 2
    --diag-every 0 --save-every 2 --sample-prompt "")
  PACKAGES=(--packages)  # the standard library alone
  PROBE_STEPS=3
  GRAPH=
  HOPTS=(--token-budget 4000); COPTS=(--prompts 2 --samples 1 --max-new-tokens 8)  # evaluations: a glance
  STAGE_S=1  # a step or so per stage: the resume path
else
  GRAPH=--cuda-graph
  PACKAGES=()
  PROBE_STEPS=30
  HOPTS=(); COPTS=()
fi

case "${1:-}" in
  probe)
    [ -f "$RUN/corpus.json" ] || "$PY" -m dsv4.train.corpus --out "$RUN/corpus.json" "${PACKAGES[@]}"
    [ -d "$RUN/functions" ] || "$PY" -m dsv4.train.functions --data "$RUN/corpus.json" --held-out-pct "$HELD" \
      --out "$RUN/functions"
    [ -d "$RUN/chat" ] || "$PY" -m dsv4.train.functions --data "$RUN/corpus.json" --held-out-pct "$HELD" \
      --out "$RUN/chat" --chat
    if [ "$EX_COPIES" != 0 ] && [ ! -d "$RUN/exercises" ]; then
      EX_COUNT=30000; [ "${SMOKE:-0}" = 1 ] && EX_COUNT=200
      "$PY" -m dsv4.train.exercises --out "$RUN/exercises" --count "$EX_COUNT" --copies "$EX_COPIES"
      "$PY" -m dsv4.train.functions --data "$RUN/exercises" --held-out-pct "$HELD" --out "$RUN/ex-chat" --chat
    fi
    probe() { "$PY" -m dsv4 train "${COMMON[@]}" "$@" --steps "$PROBE_STEPS" --save-every -1 --eval-every 0 \
      --sample-prompt "" --out "$RUN/probe" --json | tail -1 > "$RUN/probe.json"; }
    : > "$RUN/flags"
    if [ -n "${STEPS:-}" ]; then  # steps known from an earlier probe (the first stage tokenizes the data)
      echo "$STEPS" > "$RUN/steps"; echo "probe: $STEPS steps (given, not timed)"; exit 0
    fi
    if ! probe $GRAPH; then  # CUDA-graph training refused or failed here: the stages train eagerly
      [ -n "$GRAPH" ] || exit 1
      echo "probe: --cuda-graph failed (above); training without it" >&2
      rm -rf "$RUN/probe"; echo "eager" > "$RUN/flags"
      probe
    fi
    "$PY" - "$RUN" "$MINUTES" "$RECIPE" "${SMOKE:-0}" <<'EOF'
import json, sys, tomllib
run, minutes, recipe, smoke = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
r = tomllib.load(open(recipe, "rb"))
tokens = 2 * 128 if smoke else r["batch_size"] * r["seq_len"]
# the steps' own speed (the median after the first three), not the probe's mean: its first steps include the
# compilation and the graph capture (a minute here), which a stage pays once and a step never again
rates = [x for x in (json.loads(line).get("tokens_per_s") for line in open(f"{run}/probe/metrics.jsonl")) if x]
rates = sorted(rates[3:] or rates)
tps = rates[len(rates) // 2]
steps = max(4, int(minutes * 60 * tps / tokens * 0.93))  # (evaluations and checkpoints: about 7%)
if smoke:
    steps = min(steps, 6)
open(f"{run}/steps", "w").write(f"{steps}\n")
print(f"probe: {tps:,.0f} tokens/s -> {steps} steps of {tokens} tokens in {minutes:g} minutes")
EOF
    ;;
  stage)
    [ -f "$RUN/steps" ] || { echo "error: no $RUN/steps: run the probe first" >&2; exit 2; }
    args=(--steps "$(cat "$RUN/steps")" --out "$RUN/train" --resume --stop-after-s "$STAGE_S")
    grep -q eager "$RUN/flags" 2>/dev/null || args+=($GRAPH)
    [ -e "$RUN/export" ] || args+=(--export "$RUN/export")
    "$PY" -m dsv4 train "${COMMON[@]}" "${args[@]}" --json | tail -1 | tee "$RUN/stage.json"
    if grep -q '"stopped"' "$RUN/stage.json"; then echo "stage: more to do"; else echo "stage: done"; fi
    ;;
  finish)
    [ -d "$RUN/export" ] || { echo "error: no $RUN/export: the last stage has not run" >&2; exit 2; }
    [ -e "$OUT/model" ] || "$PY" -m dsv4 convert --model "$RUN/export" --to fp8 --expert-dtype fp4 --shard-gb 0.015 \
      "$OUT/model"
    du -b "$OUT/model"/* | sort -n | tail -3
    rec="$RUN/record"; mkdir -p "$rec"  # the run's record, packed into one file beside the model's seven
    for f in metrics.jsonl loss.png summary.json; do cp "$RUN/train/$f" "$rec/" 2>/dev/null || true; done
    cp "$RUN/steps" "$RUN/probe.json" "$rec/" 2>/dev/null || true
    case "${EVAL:-1}" in 1) models="shipped candidate" ;; candidate) models=candidate ;; *) models= ;; esac
    split=(--data "$RUN/corpus.json" --held-out-pct "$HELD")  # the run's own held-out split (not the stdlib's)
    for m in $models; do  # the shipped model and the candidate, measured the same way, here
      model=(); [ "$m" = candidate ] && model=(--model "$OUT/model")
      "$PY" -m dsv4 eval heldout "${model[@]}" "${HOPTS[@]}" --json > "$rec/heldout-$m.json" || true
      "$PY" -m dsv4 eval completions "${model[@]}" "${COPTS[@]}" --json > "$rec/completions-$m.json" || true
      "$PY" -m dsv4 eval chat "${model[@]}" "${COPTS[@]}" --json > "$rec/chat-$m.json" || true
      "$PY" -m dsv4 eval heldout "${model[@]}" "${split[@]}" "${HOPTS[@]}" --json \
        > "$rec/heldout-corpus-$m.json" || true
      "$PY" -m dsv4 eval completions "${model[@]}" "${split[@]}" "${COPTS[@]}" --json \
        > "$rec/completions-corpus-$m.json" || true
      for f in heldout completions chat heldout-corpus completions-corpus; do tail -c 400 "$rec/$f-$m.json"; done
    done
    tar -czf "$OUT/record.tar.gz" -C "$RUN" record
    ;;
  *)
    sed -n 2,12p "$0"; exit 2 ;;
esac
