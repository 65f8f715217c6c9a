#!/usr/bin/env bash
# A quick look at a newly shipped drafter between training rounds, on idle cores: its committed
# length per target pass on GSM8K against the drafter it replaced, same prompts and seeds, then
# `dblast demo` with it. The drafter it replaced is read from git: HEAD's copy while the new one is
# not committed yet, else the copy before the commit that last changed it (OLD_REV overrides).
# Not the evaluation (recipes/smollm2/evaluate/eval.sh): fewer prompts, one temperature, every response
# counted, both drafters at the inference block of the fastest settings (8).
#   bash recipes/smollm2/train_drafters/check_shipped.sh dflash-k1 > recipes/smollm2/logs/check-shipped-<date>.log
# Then both again at the new one's CPU defaults (dblast_ext.decoding.fastest_settings: bfloat16 where native, the
# measured verification rule, node budget and draft vocabulary; one prompt at a time), unless FASTEST=0.
# Environment: PROMPTS (20), T (0.7, with top-p 0.8 and top-k 20), MAX_NEW_TOKENS (256), FASTEST (1), DEMO
# (1; 0: no demo), OUT (runs/check-shipped), OLD_REV (a git revision holding the old drafter).
# Needs the source tree importable (PYTHONPATH=. with the compiled library beside it, or an
# editable install): the new drafter is the working tree's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
ARM=${1:?which embedded drafter: dflash-k1 or dblast-k4}
PROMPTS=${PROMPTS:-20} T=${T:-0.7} OUT=${OUT:-runs/check-shipped} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
FOLDER=dblast_ext/drafters/smollm2-135m-instruct/$ARM
[[ -d $FOLDER ]] || { echo "no embedded drafter $ARM in $FOLDER"; exit 2; }
if [[ -z ${OLD_REV:-} ]]; then
  if git diff --quiet HEAD -- "$FOLDER"; then
    OLD_REV=$(git log -n1 --format=%H -- "$FOLDER")^
  else
    OLD_REV=HEAD
  fi
fi
OLD_DRAFTER=$OUT/old-$ARM-checkpoint
rm -rf "$OLD_DRAFTER" && mkdir -p "$OLD_DRAFTER"
for f in config.json model.safetensors; do
  git show "$OLD_REV:$FOLDER/$f" > "$OLD_DRAFTER/$f"
done
OLD_DRAFTER=$(cd "$OLD_DRAFTER" && pwd)
echo "# bash recipes/smollm2/train_drafters/check_shipped.sh $ARM; $(nproc) cores, $(date -u +%Y-%m-%dT%H:%M)Z"
echo "# old: $ARM at $(git rev-parse --short "$OLD_REV"); new: the working tree's"
args=(eval --datasets gsm8k --num-prompts "$PROMPTS" --temperature "$T" --top-p 0.8 --top-k 20
      --max-new-tokens "$MAX_NEW_TOKENS" --block-size 8 --all-responses --no-progress)
# the two acceptance runs share the cores (no timings), one thread each
run_pair() {  # run_pair SUFFIX FLAGS...: the old and the new drafter side by side, then their GSM8K figures
  local suffix=$1
  shift
  OMP_NUM_THREADS=1 PYTHONPATH=. dblast "${args[@]}" "$@" --drafter "$OLD_DRAFTER" --out "$OUT/old-$ARM$suffix" \
    > "$OUT-old$suffix.log" 2>&1 &
  OMP_NUM_THREADS=1 PYTHONPATH=. dblast "${args[@]}" "$@" --drafter "$ARM" --out "$OUT/new-$ARM$suffix" \
    > "$OUT-new$suffix.log" 2>&1
  wait
  for which in old new; do
    echo "== $which $ARM: GSM8K, T $T, $PROMPTS prompts${suffix:+ (${*})}"
    python -c "import json, sys; s = json.load(open(sys.argv[1])); g = s['datasets']['gsm8k']
print({'drafter_digest': s['settings']['drafter_digest'],
       **{k: g[k] for k in ('tau', 'tau_ci', 'expected_accepted', 'histogram', 'n_responses', 'n_eos_terminated')}})" \
      "$OUT/$which-$ARM$suffix/summary.json"
  done
}
run_pair "" --batch-size 8
if [[ ${FASTEST:-1} == 1 ]]; then
  # the new drafter's CPU defaults as flags: the old one, a checkpoint folder, would not get them by name
  read -r -a fastest < <(python -c "import sys; from dblast_ext.decoding.fastest_settings import fastest_exact_settings
s = fastest_exact_settings('cpu', sys.argv[1])
print('--dtype', s.dtype, '--verify', s.verify, *(['--draft-vocab', s.draft_vocab] if s.draft_vocab else []),
      *(['--max-tree-nodes', s.max_tree_nodes] if s.max_tree_nodes else []))" "$ARM")
  run_pair -fastest "${fastest[@]}"
fi
[[ ${DEMO:-1} == 1 ]] || exit 0
echo "== dblast demo --drafter $ARM (the new one; idle cores)"
PYTHONPATH=. dblast demo --drafter "$ARM"
