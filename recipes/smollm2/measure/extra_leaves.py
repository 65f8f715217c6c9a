"""How many extra leaves trie verification should add (dblast_ext.decoding.decoder.TREE_EXTRA_LEAVES),
measured on held-out training prompts, never an evaluation set: the embedded drafter's
committed tokens per target pass with greedy-branch verification and with trie verification
at each count of extra leaves, the same prompts and seeds for every setting.

    python recipes/smollm2/measure/extra_leaves.py --counts 0 2 4 8 --prompts 8 \
        >> recipes/smollm2/logs/extra-leaves-<date>.log

Tokens per pass do not depend on timing, so this may share the cores with other work.
"""
import argparse
import sys
import time

import torch

from measuring import HELDOUT_SETS, add_heldout_run_args, heldout_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[0, 2, 4, 8], help="extra leaves to try")
    add_heldout_run_args(parser, sets=["math", "chat"], prompts=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
    from dblast_ext.drafting.drafter_io import checkpoint_digest, load_drafter
    from dblast_ext.target.loading import load_target, resolve_dtype, stop_token_ids

    torch.manual_seed(0)
    target, tokenizer = load_target("default", device="cpu", dtype=args.dtype, progress=False)
    drafter = load_drafter(args.drafter, target=target).to(dtype=resolve_dtype(args.dtype, "cpu")).eval()
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    stops = stop_token_ids(target, tokenizer)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.drafter} "
          f"(digest {checkpoint_digest(args.drafter)}), {args.dtype}, T {args.temperature} top-p {args.top_p} "
          f"top-k {args.top_k}, {args.max_new_tokens} new tokens, first {args.prompts} prompts of "
          f"{', '.join(HELDOUT_SETS[s] for s in args.sets)}, seed = prompt index", flush=True)
    settings = [("branch", 0)] + [("tree", n) for n in args.counts]
    for name in args.sets:
        ids = heldout_prompts(tokenizer, [name], args.prompts)
        base = None
        for verify, count in settings:
            decoder = SpeculativeDecoder(target, drafter, verify=verify,
                                         extra_leaves=count if verify == "tree" else None)
            tokens = passes = nodes = 0
            start = time.perf_counter()
            for seed, prompt in enumerate(ids):
                out = decoder.generate(prompt, sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                                       seed=seed)
                tokens += sum(c.num_accepted + 1 for c in out.cycles)
                passes += len(out.cycles)
                nodes += sum(c.tree_nodes for c in out.cycles)
            per_pass = tokens / passes
            base = base or per_pass
            label = "branch" if verify == "branch" else f"tree + {count} extra leaves"
            print(f"{name:5s} {label:26s} {per_pass:.3f} tokens per pass ({per_pass / base - 1:+.1%} vs branch; "
                  f"{tokens} tokens, {passes} passes, {nodes / passes:.1f} nodes per pass, "
                  f"{time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
