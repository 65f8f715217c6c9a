#!/usr/bin/env bash
# The DFlash2 candidate (recipes/smollm2/train_drafters/dflash2_train.py's package) measured with eval.sh next
# to the embedded dflash-k1 and dblast-k4, then written into results/smollm2/README.md by
# dflash2_results.py. Phases (each resumable, a finished run is skipped):
#   accept   eval.sh's acceptance runs (float32, one chain per pass; at T > 0 the selector samples
#            its chain and sparse_verify checks it) at T 0 / 0.7 / 1.0 / 1.5 on the first PROMPTS
#            prompts of each dataset (the embedded drafters' kept records cover the first 45; the
#            comparison is paired on the prompts both cover)
#   speed    eval.sh's speed runs at the settings dflash-k1 runs at on a CPU (bfloat16, block 8,
#            8,192 draft ids, the adaptive controller): the sampled chain (`dflash2`), a trie of
#            the greedy chain and the selector's 3 best paths (`dflash2-tree`), and the embedded
#            dflash-k1 at its own CPU defaults in the same sitting (`dflash-k1-now`)
#   collect  dflash2_results.py
# Environment (defaults): CANDIDATE (runs/smollm2-dflash2/candidate), OUT (runs/smollm2-dflash2-eval),
# PROMPTS (20), SPEED_PROMPTS (10; 3 in the committed run, to fit a sitting), PHASES ("accept speed collect").
set -euo pipefail
cd "$(dirname "$0")/../../.."
CANDIDATE=${CANDIDATE:-runs/smollm2-dflash2/candidate} OUT=${OUT:-runs/smollm2-dflash2-eval}
PROMPTS=${PROMPTS:-20} SPEED_PROMPTS=${SPEED_PROMPTS:-10} PHASES=${PHASES:-accept speed collect}
[[ -f $CANDIDATE/config.json ]] || { echo "no DFlash2 candidate in $CANDIDATE: run recipes/smollm2/train_drafters/dflash2_train.py"; exit 2; }
export OUT PROMPTS SPEED_PROMPTS
for phase in $PHASES; do
  case $phase in
    accept) ARMS="dflash2=$CANDIDATE" PHASES=accept bash recipes/smollm2/evaluate/eval.sh ;;
    speed)
      ARMS="dflash2=$CANDIDATE" SPEED_FLAGS="--draft-vocab 8192" PHASES=speed bash recipes/smollm2/evaluate/eval.sh
      ARMS="dflash2-tree=$CANDIDATE" SPEED_FLAGS="--draft-vocab 8192 --verify tree" PHASES=speed \
        bash recipes/smollm2/evaluate/eval.sh
      ARMS="dflash-k1-now=dflash-k1" PHASES=speed bash recipes/smollm2/evaluate/eval.sh ;;
    collect) python recipes/smollm2/evaluate/dflash2_results.py --runs "$OUT" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
