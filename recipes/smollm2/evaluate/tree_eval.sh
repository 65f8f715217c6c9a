#!/usr/bin/env bash
# Trie verification against greedy-branch verification on the embedded pair (issue: verify all K
# branches in one target pass): `dblast eval` of dblast-k4 with --verify branch and --verify tree
# on the same prompts and seeds (GSM8K and MT-Bench, the first PROMPTS of each, at most
# MAX_NEW_TOKENS new tokens) at temperature 0.7 / top-p 0.8, 1.0 / top-p 0.95 and 1.5 / top-p 0.95,
# top-k 20, Z_T as eval.sh calibrated it (0.5 at T 0.7, else 1.0; in tree mode the prior only ranks
# nodes for a budget, and there is none here). Then `dblast compare` (paired bootstrap of tokens
# per target pass, tree against branch) per temperature, and a speed pass (--measure-speedup, one
# process with every core) on the first SPEED_PROMPTS prompts at T 1.0, at block 8 (the drafter's
# training block) with the whole vocabulary and with the 8,192-id draft vocabulary (the branch
# rule's fastest exact CPU setting), and there with the trie cut to 12 branch nodes; then
# tree_collect.py writes results/smollm2/tree/.
# Resumable: rerun to continue (each run resumes from its records).
# Environment (defaults): OUT (runs/smollm2-tree), PROMPTS (10), SPEED_PROMPTS (4; 0: no speed pass),
# MAX_NEW_TOKENS (128), WORKERS (2: acceptance runs at once, one thread each), TEMPS ("1.0 0.7 1.5": the
# temperatures of the acceptance runs), EXTRA_LEAVES (the trie's; dblast eval's default when unset).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/smollm2-tree} PROMPTS=${PROMPTS:-10} SPEED_PROMPTS=${SPEED_PROMPTS:-4}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128} WORKERS=${WORKERS:-2} TEMPS=${TEMPS:-1.0 0.7 1.5}
LEAVES=()
[[ -n ${EXTRA_LEAVES:-} ]] && LEAVES=(--extra-leaves "$EXTRA_LEAVES")
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
mkdir -p "$OUT"

sampling() {
  case $1 in
    0.7) echo "--temperature 0.7 --top-p 0.8 --top-k 20 --category-temperature 0.5" ;;
    *) echo "--temperature $1 --top-p 0.95 --top-k 20 --category-temperature 1.0" ;;
  esac
}

run() {  # run NAME ARGS...: one dblast eval on one thread, skipped once finished
  local name=$1
  shift
  [[ -f $OUT/$name/summary.json ]] && { echo "done $name (finished before)"; return 0; }
  OMP_NUM_THREADS=1 dblast eval --drafter dblast-k4 --datasets gsm8k,mtbench --num-prompts "$PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --out "$OUT/$name" --no-progress "$@" > "$OUT/$name.log" 2>&1 \
    && echo "done $name ($(date -u +%T))" || { echo "FAILED $name: see $OUT/$name.log"; return 1; }
}

echo "== acceptance ($(date -u +%T))"
jobs_running() { jobs -rp | wc -l; }
for t in $TEMPS; do
  for verify in branch tree; do
    leaves=()
    [[ $verify == tree ]] && leaves=("${LEAVES[@]}")
    # shellcheck disable=SC2046  # one flag per word
    run "$verify-T$t" --verify "$verify" "${leaves[@]}" $(sampling "$t") &
    while (( $(jobs_running) >= WORKERS )); do sleep 5; done
  done
done
wait

echo "== compare ($(date -u +%T))"
for t in $TEMPS; do
  dblast compare "$OUT/branch-T$t" "$OUT/tree-T$t" --all-responses --out "$OUT/compare-T$t.md"
done

if (( SPEED_PROMPTS == 0 )); then  # acceptance only (speed later, on idle cores: rerun with SPEED_PROMPTS)
  python recipes/smollm2/evaluate/tree_collect.py --runs "$OUT"
  exit 0
fi
echo "== speed ($(date -u +%T))"
# block 8 with the whole vocabulary, and the fastest exact CPU setting of the branch rule (block 8,
# draft vocabulary 8192)
for config in "B8" "B8-V8192"; do
  extra=(--block-size 8)
  [[ $config == B8-V8192 ]] && extra+=(--draft-vocab 8192)
  for verify in branch tree; do
    leaves=()
    [[ $verify == tree ]] && leaves=("${LEAVES[@]}")
    name=speed-$verify-$config-T1.0
    [[ -f $OUT/$name/summary.json ]] && { echo "done $name (finished before)"; continue; }
    # shellcheck disable=SC2046
    dblast eval --drafter dblast-k4 --datasets gsm8k,mtbench --num-prompts "$SPEED_PROMPTS" \
      --max-new-tokens "$MAX_NEW_TOKENS" --out "$OUT/$name" --no-progress --measure-speedup --verify "$verify" \
      "${leaves[@]}" "${extra[@]}" $(sampling 1.0) > "$OUT/$name.log" 2>&1 && echo "done $name ($(date -u +%T))" \
      || { echo "FAILED $name: see $OUT/$name.log"; exit 1; }
  done
done
# the trie cut to its 12 nodes of highest prior mass, at the cheaper setting: a smaller pass
name=speed-tree12-B8-V8192-T1.0
if [[ ! -f $OUT/$name/summary.json ]]; then
  # shellcheck disable=SC2046
  dblast eval --drafter dblast-k4 --datasets gsm8k,mtbench --num-prompts "$SPEED_PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --out "$OUT/$name" --no-progress --measure-speedup --verify tree \
    --max-tree-nodes 12 "${LEAVES[@]}" --block-size 8 --draft-vocab 8192 $(sampling 1.0) > "$OUT/$name.log" 2>&1 \
    && echo "done $name ($(date -u +%T))" || { echo "FAILED $name: see $OUT/$name.log"; exit 1; }
fi
python recipes/smollm2/evaluate/tree_collect.py --runs "$OUT"
