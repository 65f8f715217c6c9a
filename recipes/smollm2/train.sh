#!/usr/bin/env bash
# The SmolLM2-135M-Instruct drafters from the 5x data set that data.sh keeps in
# recipes/smollm2/data/ (about 1.8M response tokens, the target's own samples at T 0.7, top-p 0.8,
# top-k 20). The data are read where they are kept, shard by shard (gzipped JSONL); the target
# features and top-32 log-probabilities are cached per shard in FEATURES, so the cache is built a
# shard at a time and a shard's cache survives an interruption.
#   1. pilots: base drafters (K = 1, NLL with distillation) of LAYERS_CHOICES layers at each
#      block of BLOCK_CHOICES, PILOT_STEPS steps each on the same data; choose_pilot.py picks
#      the size and block by held-out top-1 agreement with the target's argmax;
#   2. the base at the chosen size and block, trained until its held-out loss stops improving
#      (PATIENCE checkpoints of SAVE_EVERY steps without a lower loss; MAX_STEPS at most);
#   3. the two arms from that base, each to its own plateau: dflash-k1 (K = 1, NLL with
#      distillation) and dblast-k4 (K = 4 head added, accepted-length surrogate, tau 0.1);
#   4. both packaged as bf16 safetensors into dblast_ext/drafters/ (PACKAGE=0 skips it).
# Every run resumes from its newest checkpoint: rerun the script to continue after an
# interruption (a finished step is skipped). Logs of each run: WORK/NAME/{train,eval}_log.jsonl.
#   bash recipes/smollm2/train.sh
#   STORE=runs/smoke-data WORK=runs/smoke-train PARTIAL=1 PILOT_STEPS=4 SAVE_EVERY=2 PATIENCE=1 MAX_STEPS=6 \
#     BATCH=2 ANCHORS=4 PACKAGE=0 bash recipes/smollm2/train.sh
# The list of shards is taken once, into WORK/data.json, and kept: a resumed run must see the
# same data (the trainer refuses another list), so shards that land later need a new WORK.
# Environment: STORE (data.sh's store), WORK (runs, default runs/smollm2-5x), FEATURES (feature
# caches, default WORK/features), PARTIAL=1 (train on the shards there are, before data.sh has
# made them all; its held-out shard must exist), SHARD and CODE_SAMPLES (data.sh's, to count the
# shards it makes), LAYERS_CHOICES ("2 3"), BLOCK_CHOICES ("8 16"), PILOT_STEPS, SAVE_EVERY, PATIENCE,
# MAX_STEPS, BATCH (sequences per step), ANCHORS (blocks per sequence), DISTILL (weight of the
# target's top-32 in the NLL objectives), TARGET_LAYERS, PACKAGE.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
STORE=${STORE:-recipes/smollm2/data} WORK=${WORK:-runs/smollm2-5x}
FEATURES=${FEATURES:-$WORK/features} PARTIAL=${PARTIAL:-0} SHARD=${SHARD:-200} CODE_SAMPLES=${CODE_SAMPLES:-3}
LAYERS_CHOICES=${LAYERS_CHOICES:-2 3} BLOCK_CHOICES=${BLOCK_CHOICES:-8 16}
PILOT_STEPS=${PILOT_STEPS:-300} SAVE_EVERY=${SAVE_EVERY:-150} PATIENCE=${PATIENCE:-3} MAX_STEPS=${MAX_STEPS:-8000}
BATCH=${BATCH:-4} ANCHORS=${ANCHORS:-16} DISTILL=${DISTILL:-0.5}
TARGET_LAYERS=${TARGET_LAYERS:-1, 8, 14, 21, 27} PACKAGE=${PACKAGE:-1}
MASK=16   # <empty_output>: a special token chat text never contains, used as the drafter's mask
mkdir -p "$WORK"

echo "== data ($(date -u +%T))"
# the shards data.sh keeps, in its order (math, code, chat), as a JSON list for the configs
python - "$STORE" "$PARTIAL" "$WORK/data.json" "$SHARD" "$CODE_SAMPLES" <<'PY'
import glob, gzip, json, os, sys
store, partial, out, shard, code_samples = sys.argv[1], sys.argv[2] == "1", sys.argv[3], *map(int, sys.argv[4:])
def expected_shards():
    """data.sh cuts every prompt list into shards of about SHARD sequences (code: CODE_SAMPLES a prompt)."""
    count = 0
    for kind, samples in (("math", 1), ("code", code_samples), ("chat", 1)):
        path = os.path.join(store, "prompts", f"{kind}.jsonl")
        prompts = sum(1 for line in open(path) if line.strip()) if os.path.isfile(path) else 0
        count += -(-prompts // -(-shard // samples))
    return count
expected = expected_shards()
if os.path.isfile(out):
    kept = json.load(open(out))
    print(f"{len(kept['data'])} shards of {expected}, as this WORK was started with ({out})")
    if len(kept["data"]) < expected and not partial:
        print(f"warning: this WORK trains on {len(kept['data'])} of the {expected} shards (it was started with "
              "PARTIAL=1); a new WORK trains on all of them", file=sys.stderr)
    sys.exit(0)
shards = [p for kind in ("math", "code", "chat")
          for p in sorted(glob.glob(os.path.join(store, "responses", f"{kind}-[0-9][0-9][0-9].jsonl.gz")))]
heldout = os.path.join(store, "responses", "heldout.jsonl.gz")
if not os.path.isfile(heldout):
    sys.exit(f"{heldout} is missing: data.sh writes it after the training shards; run it to the end")
if len(shards) < expected and not partial:
    sys.exit(f"{len(shards)} of {expected} data shards in {store}: run data.sh to the end (or PARTIAL=1)")
tokens = sequences = 0
for path in shards:
    with gzip.open(path, "rt") as f:
        for line in f:
            sequences += 1
            tokens += sum(json.loads(line)["loss_mask"])
json.dump({"data": shards, "eval_data": [heldout]}, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
print(f"{len(shards)} shards (of {expected}): {sequences} sequences, {tokens} response tokens; held out: {heldout}")
PY

# config NAME INIT LAYERS BLOCK BRANCHES OBJECTIVE LR STEPS PATIENCE: one training config (INIT and
# PATIENCE may be null); every run shares the data, features, batch, anchors, position weights,
# feature scaling and the distillation weight of its objective
config() {
  local distill=0
  [[ $6 == nll ]] && distill=$DISTILL
  python - "$WORK" "$FEATURES" "$TARGET_LAYERS" "$MASK" "$ANCHORS" "$BATCH" "$SAVE_EVERY" "$distill" "$@" <<'PY'
import json, sys
work, features, layers, mask, anchors, batch, save_every, distill = sys.argv[1:9]
name, init, num_layers, block, branches, objective, lr, steps, patience = sys.argv[9:18]
config = {"target": "default", **json.load(open(f"{work}/data.json")), "out": f"{work}/{name}",
          "init_from": None if init == "null" else init,
          "drafter": {"num_hidden_layers": int(num_layers), "mask_token_id": int(mask),
                      "target_layer_ids": [int(i) for i in layers.split(",")]},
          "num_branches": int(branches), "block_size": int(block), "objective": objective, "tau": 0.1,
          "distill_weight": float(distill), "decay": 7, "feature_scaling": "rms", "num_anchors": int(anchors),
          "batch_size": int(batch), "lr": float(lr), "warmup_ratio": 0.04, "max_steps": int(steps),
          "patience": None if patience == "null" else int(patience), "save_every": min(int(save_every), int(steps)),
          "log_every": 10, "seed": 0, "feature_cache": features, "autocast": "auto", "recompute_logits": False}
json.dump(config, open(f"{work}/{name}.json", "w"), indent=1)
PY
}
# run NAME: trains WORK/NAME.json unless WORK/NAME/final exists
run() {
  if [[ -f $WORK/$1/final/model.safetensors ]]; then echo "== $1: done before"; return; fi
  echo "== train $1 ($(date -u +%T))"
  dblast train --config "$WORK/$1.json" --no-progress
}

pilots=()
for layers in $LAYERS_CHOICES; do
  for block in $BLOCK_CHOICES; do
    name=pilot-L$layers-B$block
    config "$name" null "$layers" "$block" 1 nll 1e-3 "$PILOT_STEPS" null
    run "$name"
    pilots+=(--pilot "L$layers-B$block=$WORK/$name")
  done
done
echo "== choose ($(date -u +%T))"
python recipes/smollm2/choose_pilot.py "${pilots[@]}" --out "$WORK/choice.json" | tee "$WORK/choice.md"
read -r LAYERS BLOCK < <(python -c "import json, sys; c = json.load(open(sys.argv[1])); print(c['layers'], c['block'])" \
  "$WORK/choice.json")

config base null "$LAYERS" "$BLOCK" 1 nll 1e-3 "$MAX_STEPS" "$PATIENCE"
run base
config dflash-k1 "$WORK/base/final" "$LAYERS" "$BLOCK" 1 nll 3e-4 "$MAX_STEPS" "$PATIENCE"
config dblast-k4 "$WORK/base/final" "$LAYERS" "$BLOCK" 4 al 3e-4 "$MAX_STEPS" "$PATIENCE"
run dflash-k1
run dblast-k4
if [[ $PACKAGE == 1 ]]; then
  echo "== package ($(date -u +%T))"
  python recipes/smollm2/package.py --run-dir "$WORK"
fi
echo "== done ($(date -u +%T))"
