#!/usr/bin/env bash
# The SmolLM2-135M-Instruct drafter recipe: regenerate responses with the target, train
# dflash-k1 (K = 1, NLL) and dblast-k4 (K = 4, accepted-length surrogate, tau 0.1) with equal
# data and steps, then evaluate both. Every step is seeded and resumable (rerun to continue).
#   bash recipes/smollm2/run.sh                       # full sizes (hours on a 2-core CPU)
#   PROMPTS=160 STEPS=80 EVAL_PROMPTS=5 bash recipes/smollm2/run.sh   # a smoke run
# Environment: PROMPTS (training prompts), STEPS (optimizer steps per drafter), EVAL_PROMPTS
# (per dataset), WORK (output root, default runs/smollm2), LAYERS (drafter layers).
set -euo pipefail
cd "$(dirname "$0")/../.."
PROMPTS=${PROMPTS:-2000} STEPS=${STEPS:-1500} EVAL_PROMPTS=${EVAL_PROMPTS:-40} LAYERS=${LAYERS:-1}
WORK=${WORK:-runs/smollm2}
MASK=16   # <empty_output>: a special token chat text never contains, used as the drafter's mask
SAMPLING="--temperature 0.7 --top-p 0.8 --top-k 20"   # the DBLast data setting
mkdir -p "$WORK"
echo "== prompts ($(date -u +%T))"
python recipes/smollm2/prompts.py --count "$PROMPTS" --seed 0 --out "$WORK/prompts.jsonl"
python recipes/smollm2/prompts.py --count 64 --seed 1 --out "$WORK/heldout-prompts.jsonl"
echo "== data ($(date -u +%T))"
dblast data generate --prompts "$WORK/prompts.jsonl" --out "$WORK/train.jsonl" $SAMPLING \
  --max-new-tokens 256 --batch-size 16 --seed 0 --no-progress
dblast data generate --prompts "$WORK/heldout-prompts.jsonl" --out "$WORK/heldout.jsonl" $SAMPLING \
  --max-new-tokens 256 --batch-size 16 --seed 1 --no-progress
for arm in dflash-k1 dblast-k4; do
  if [[ $arm == dflash-k1 ]]; then branches=1 objective=nll; else branches=4 objective=al; fi
  cat > "$WORK/$arm.json" <<JSON
{"target": "default", "data": "$WORK/train.jsonl", "eval_data": "$WORK/heldout.jsonl", "out": "$WORK/$arm",
 "init_from": null, "drafter": {"num_hidden_layers": $LAYERS, "mask_token_id": $MASK},
 "num_branches": $branches, "block_size": 16, "objective": "$objective", "tau": 0.1,
 "num_anchors": 16, "batch_size": 4, "lr": 6e-4, "warmup_ratio": 0.04, "max_steps": $STEPS,
 "save_every": $(( STEPS / 4 > 0 ? STEPS / 4 : 1 )), "log_every": 10, "seed": 0}
JSON
  echo "== train $arm ($(date -u +%T))"
  dblast train --config "$WORK/$arm.json" --no-progress
done
for arm in dflash-k1 dblast-k4; do
  echo "== eval $arm ($(date -u +%T))"
  dblast eval --drafter "$WORK/$arm/final" --datasets gsm8k --num-prompts "$EVAL_PROMPTS" $SAMPLING \
    --max-new-tokens 256 --measure-speedup --all-responses --no-progress --out "$WORK/eval-$arm"
done
echo "== done ($(date -u +%T))"
