"""Side-by-side speed of the training-data sampler (dblast_ext.training.data.sample_batch) in
two source trees, e.g. before and after a change: the same prompts (the first N of the kept
math prompt list), seeds and settings as recipes/smollm2/make_data/data.sh, each tree in its own
process, alternating, R rounds. Prints response tokens per second per tree and whether the
trees drew the same tokens.
    python recipes/smollm2/measure/data_speed.py --tree OLD_CHECKOUT --tree . [--prompts 32] [--rounds 2]
A tree is a source checkout with dblast_ext built in place (copy _C*.so when csrc/ is the same).
"""
import argparse
import json
import os
import subprocess
import sys

from measuring import RECIPE

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from dblast_ext.prompts import chat_messages
from dblast_ext.eval.datasets import load_dataset_list
from dblast_ext.sampling import SamplingParams
from dblast_ext.target.loading import encode_messages, load_target, stop_token_ids
from dblast_ext.training.data import sample_batch, sample_seed
model, tokenizer = load_target("default", device="cpu", dtype="float32", progress=False)
prompts = load_dataset_list(sys.argv[1], limit=int(sys.argv[2]))
ids = [encode_messages(tokenizer, chat_messages(p, 0)) for p in prompts]
generators = [torch.Generator().manual_seed(sample_seed(0, p.dataset, p.prompt_id, 0)) for p in prompts]
start = time.perf_counter()
out = sample_batch(model, ids, generators, SamplingParams(0.7, 20, 0.8), int(sys.argv[4]),
                   stop_token_ids(model, tokenizer), tokenizer.pad_token_id or 0)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": sum(len(r[0]) for r in out), "responses": [r[0] for r in out],
                  "prompt_tokens": sum(map(len, ids))}))
"""


def run_tree(tree: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS=str(args.threads))
    prompts = os.path.join(RECIPE, "data", "prompts", "math.jsonl")
    proc = subprocess.run([sys.executable, "-c", WORKER, prompts, str(args.prompts), str(args.threads),
                           str(args.max_new_tokens)], env=env, cwd="/", capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"tree {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="a source checkout (give two or more)")
    p.add_argument("--prompts", type=int, default=32, help="prompts, all in one batch (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    args = p.parse_args()
    results = {tree: [] for tree in args.tree}
    for r in range(args.rounds):
        for tree in args.tree:
            out = run_tree(tree, args)
            results[tree].append(out)
            print(f"round {r + 1} {tree}: {out['tokens']} tokens in {out['seconds']:.1f} s = "
                  f"{out['tokens'] / out['seconds']:.1f} tok/s ({out['prompt_tokens']} prompt tokens)", flush=True)
    best = {tree: min(o["seconds"] for o in runs) for tree, runs in results.items()}
    first = args.tree[0]
    for tree in args.tree:
        same = results[tree][0]["responses"] == results[first][0]["responses"]
        print(f"{tree}: best {results[tree][0]['tokens'] / best[tree]:.1f} tok/s, "
              f"{best[first] / best[tree]:.2f}x of {first}; same tokens as {first}: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
