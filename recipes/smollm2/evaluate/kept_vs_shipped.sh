#!/usr/bin/env bash
# A drafter the scaled campaign kept against the shipped one of its arm, by the evaluation's own
# measure: `dblast eval` acceptance of both on the same prompts and seeds (float32, one branch per
# cycle, no timings: the two runs share the cores, one thread each), then `dblast compare`'s paired
# delta tau with bootstrap intervals. A quicker look than evaluate/eval.sh, before shipping.
#   bash recipes/smollm2/evaluate/kept_vs_shipped.sh >> recipes/smollm2/logs/kept-vs-shipped-$(date -u +%F).log 2>&1
# Environment (defaults): ARM (dflash-k1), KEPT (runs/smollm2-scaled/kept/$ARM), OUT
# (runs/smollm2-kept-vs-shipped), PROMPTS (20 per dataset), DATASETS (gsm8k,mtbench,humaneval),
# T (0.7; top-p 0.8, top-k 20 as eval.sh), MAX_NEW_TOKENS (256), BATCH (8).
set -euo pipefail
cd "$(dirname "$0")/../../.."
ARM=${ARM:-dflash-k1} KEPT=${KEPT:-runs/smollm2-scaled/kept/${ARM:-dflash-k1}} OUT=${OUT:-runs/smollm2-kept-vs-shipped}
PROMPTS=${PROMPTS:-20} DATASETS=${DATASETS:-gsm8k,mtbench,humaneval} T=${T:-0.7}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256} BATCH=${BATCH:-8}
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
[[ -f $KEPT/config.json ]] || { echo "no drafter in $KEPT (KEPT=...)"; exit 2; }
case $T in
  0) filter=(--temperature 0) ;;
  0.7) filter=(--temperature 0.7 --top-p 0.8 --top-k 20) ;;
  *) filter=(--temperature "$T" --top-p 0.95 --top-k 20) ;;
esac
echo "== $ARM: shipped against $KEPT, $DATASETS, $PROMPTS prompts each, T $T, float32 ($(date -u +%F\ %T) UTC)"
lscpu | grep -m1 "Model name" || true
run() {  # run NAME DRAFTER: one acceptance run, one thread (resumes where it stopped)
  OMP_NUM_THREADS=1 dblast eval --drafter "$2" --dtype float32 --datasets "$DATASETS" --num-prompts "$PROMPTS" \
    "${filter[@]}" --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$BATCH" --no-progress --out "$OUT/$1-T$T" | tail -2
}
run shipped "$ARM" & shipped=$!
run kept "$KEPT" & kept=$!
wait "$shipped" && wait "$kept"
dblast compare "$OUT/shipped-T$T" "$OUT/kept-T$T"
