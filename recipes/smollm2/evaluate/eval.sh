#!/usr/bin/env bash
# The embedded pair's evaluation (results/smollm2/README.md): `dblast eval` of dflash-k1 and dblast-k4 on GSM8K,
# MT-Bench, HumanEval and MATH-500 (PROMPTS per dataset: a seeded 10% calibration split, the
# rest reported), at most 256 new tokens, at temperature 0 (greedy), 0.7 / top-p 0.8, 1.0 /
# top-p 0.95 and 1.5 / top-p 0.95, top-k 20; Z_T of dblast-k4 calibrated on the split (K = 1
# has no Z_T: its runs hold the same split out, so both arms report on the same prompts).
# Phases (PHASES, default all, in this order; each resumable, rerun to continue):
#   accept   acceptance statistics, WORKERS processes of one thread each, BATCH responses at a
#            time in each (these statistics do not depend on timing, so the runs share the cores)
#   oracle   the committed length of a drafter that always drafts the target's most likely
#            token (`dblast diagnose oracle`), at temperatures 0.7, 1.0, 1.5 on the first
#            ORACLE_PROMPTS prompts of each dataset, at ORACLE_BLOCK (the embedded drafters' block):
#            a drafter-free reference for the arms with the same ceiling
#   speed    speed-up over target-only sampling at the CPU defaults (`dblast eval --fastest-settings`:
#            the settings `dblast demo` picks, e.g. bfloat16, block 8, 8,192 ids, a trie of branch
#            nodes; Z_T 1), with tau there: one process at a time with every core, on the first
#            SPEED_PROMPTS prompts of each dataset (the same prompts and seeds)
#   blocks   speed-up on GSM8K at temperature 0.7 with shorter inference blocks (16, 8, 4) at the
#            calibrated Z_T, each with the whole vocabulary and with each draft vocabulary in VOCABS
#            (--draft-vocab): on a CPU a target pass costs more the more tokens it verifies, and
#            drafting costs in proportion to the vocabulary the drafter's LM head scores
#   determinism  accepted length binned by early determinism, MT-Bench, temperature 1.0, dblast-k4
#            against dflash-k1 on the same truncation points (about half an hour)
#   collect  report files (summary, report, plots; not the records) and results/smollm2/README.md,
#            and the short results table of README.md
# A run is skipped once it has its finishing file (summary.json; oracle.json; determinism.json),
# and every phase resumes from its records (determinism: its responses and points). To keep progress beyond this machine, save the
# records into the repository now and then and commit them (eval.sh restores them first):
#   python recipes/smollm2/evaluate/checkpoint.py save --runs "$OUT" && git add results/smollm2/records
# Developing while it runs: start it from a separate clone built in place (`python setup.py
# build_ext --inplace`, PYTHONPATH=<clone>), since rebuilding an editable checkout replaces
# the compiled library under the running workers and fails the runs they start meanwhile.
# Environment (defaults): OUT (runs/smollm2-eval), PROMPTS (45), SPEED_PROMPTS (10), ORACLE_PROMPTS (20),
# ORACLE_BLOCK (the block_size of the embedded dblast-k4),
# WORKERS (2), BATCH (8), GRID (Z_T, 0,0.5,1), MAX_NEW_TOKENS (256; fewer for a smoke run), TRUNCATIONS (200),
# VOCABS ("full 8192": the draft vocabularies of the blocks phase), ARMS ("dblast-k4 dflash-k1": the
# drafters evaluated, e.g. one whose training is final while the other still trains; NAME=DIR evaluates
# the drafter in DIR under NAME, e.g. ARMS="dflash2=runs/smollm2-dflash2/candidate" PHASES="accept speed"),
# SPEED_FLAGS (none: `dblast eval` flags the speed phase adds after --fastest-settings, which they
# override, e.g. "--draft-vocab 8192 --verify tree" for a drafter the fastest settings do not know).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/smollm2-eval} PROMPTS=${PROMPTS:-45} SPEED_PROMPTS=${SPEED_PROMPTS:-10} WORKERS=${WORKERS:-2}
BATCH=${BATCH:-8}
ORACLE_PROMPTS=${ORACLE_PROMPTS:-20} GRID=${GRID:-0,0.5,1} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
VOCABS=${VOCABS:-full 8192}
PHASES=${PHASES:-accept oracle speed blocks determinism collect}
ARMS=${ARMS:-dblast-k4 dflash-k1}
DATASETS=gsm8k,mtbench,humaneval,math500
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
ORACLE_BLOCK=${ORACLE_BLOCK:-$(python -c 'from dblast_ext.cli.common import read_checkpoint_config
print(read_checkpoint_config("dblast-k4", "ORACLE_BLOCK").block_size)')}
mkdir -p "$OUT"
# runs finished on an earlier machine (results/smollm2/) and records checkpointed into the
# repository (results/smollm2/records/) come back first: nothing kept is run again (but
# nothing another drafter, or the oracle at another block, made)
python recipes/smollm2/evaluate/checkpoint.py restore --runs "$OUT" --oracle-block "$ORACLE_BLOCK"

sampling() {  # the filter of each temperature setting
  case $1 in
    0) echo "--temperature 0 --top-k 20" ;;
    0.7) echo "--temperature 0.7 --top-p 0.8 --top-k 20" ;;
    *) echo "--temperature $1 --top-p 0.95 --top-k 20" ;;
  esac
}

logged() {  # logged NAME LOG COMMAND...: COMMAND on one thread, output to LOG; says done or FAILED
  local name=$1 log=$2
  shift 2
  OMP_NUM_THREADS=1 "$@" > "$log" 2>&1 && echo "done $name ($(date -u +%T))" || { echo "FAILED $name: see $log"; return 1; }
}
finished() {  # finished NAME FILE: true (and says so) when a run's finishing file exists
  [[ -f $2 ]] && echo "done $1 (finished before)"
}
one_run() {  # one_run ARM T: the acceptance run of one arm (NAME or NAME=DIR) at one temperature
  local arm=${1%%=*} drafter=${1#*=} t=$2
  finished "$arm T=$t" "$OUT/accept/$arm-T$t/summary.json" && return
  logged "$arm T=$t" "$OUT/accept-$arm-T$t.log" dblast eval --drafter "$drafter" --datasets "$DATASETS" \
    --num-prompts "$PROMPTS" $(sampling "$t") --max-new-tokens "$MAX_NEW_TOKENS" --category-temperature calibrate \
    --grid "$GRID" --batch-size "$BATCH" --no-progress --out "$OUT/accept/$arm-T$t"
}
one_oracle() {  # one_oracle T: the top-token oracle at one temperature (no timings, so runs share the cores)
  local t=$1
  finished "oracle T=$t" "$OUT/oracle/T$t/oracle.json" && return
  logged "oracle T=$t" "$OUT/oracle-T$t.log" dblast diagnose oracle --datasets "$DATASETS" \
    --num-prompts "$ORACLE_PROMPTS" --block-size "$ORACLE_BLOCK" $(sampling "$t") --max-new-tokens "$MAX_NEW_TOKENS" --no-progress \
    --out "$OUT/oracle/T$t"
}
export -f finished logged one_run one_oracle sampling
export OUT PROMPTS ORACLE_PROMPTS ORACLE_BLOCK DATASETS GRID MAX_NEW_TOKENS BATCH

for phase in $PHASES; do
  echo "== $phase ($(date -u +%T))"
  case $phase in
    accept)
      for t in 0.7 1.0 1.5 0; do for arm in $ARMS; do echo "$arm $t"; done; done \
        | xargs -P "$WORKERS" -L 1 bash -c 'one_run "$0" "$1"' ;;
    oracle)
      printf '%s\n' 0.7 1.0 1.5 | xargs -P "$WORKERS" -L 1 bash -c 'one_oracle "$0"' ;;
    speed)
      for t in 0.7 1.0 1.5 0; do
        for entry in $ARMS; do
          arm=${entry%%=*}
          finished "speed $arm T=$t" "$OUT/speed/$arm-T$t/summary.json" && continue
          dblast eval --drafter "${entry#*=}" --fastest-settings ${SPEED_FLAGS:-} --datasets "$DATASETS" --num-prompts "$SPEED_PROMPTS" \
            $(sampling "$t") --max-new-tokens "$MAX_NEW_TOKENS" --measure-speedup --all-responses --no-progress \
            --out "$OUT/speed/$arm-T$t" | tail -2
        done
      done ;;
    blocks)
      for entry in $ARMS; do
        arm=${entry%%=*}
        for b in 16 8 4; do
          for v in $VOCABS; do
            name=$arm-B$b$([[ $v == full ]] || echo "-V$v")
            finished "blocks $name" "$OUT/blocks/$name/summary.json" && continue
            dblast eval --drafter "${entry#*=}" --block-size "$b" $([[ $v == full ]] || echo "--draft-vocab $v") \
              --datasets gsm8k --num-prompts "$SPEED_PROMPTS" $(sampling 0.7) --max-new-tokens "$MAX_NEW_TOKENS" \
              --category-temperature "$(python recipes/smollm2/evaluate/chosen_zt.py "$OUT/accept/$arm-T0.7")" \
              --measure-speedup --all-responses --no-progress --out "$OUT/blocks/$name" | tail -2
          done
        done
      done ;;
    determinism)
      [[ " $ARMS " == *" dblast-k4 "* && " $ARMS " == *" dflash-k1 "* ]] || { echo "determinism needs both arms: skipped"; continue; }
      # finished once determinism.json holds the baseline too: a run made before --baseline resumes to add it
      grep -qs '"baseline"' "$OUT/determinism/determinism.json" && { echo "done determinism (finished before)"; continue; }
      dblast diagnose determinism --drafter dblast-k4 --baseline dflash-k1 --datasets mtbench --num-prompts 20 $(sampling 1.0) \
        --max-new-tokens "$MAX_NEW_TOKENS" --category-temperature "$(python recipes/smollm2/evaluate/chosen_zt.py "$OUT/accept/dblast-k4-T1.0")" \
        --truncations "${TRUNCATIONS:-200}" --samples 10 --out "$OUT/determinism" | tail -8 ;;
    collect)
      python recipes/smollm2/evaluate/collect.py --runs "$OUT" --out results/smollm2 --readme README.md ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
echo "== done ($(date -u +%T))"
