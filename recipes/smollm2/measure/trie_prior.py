"""Whether the prior's temperature Z_T should change for trie verification on a CPU: the node
budget keeps the nodes with the largest prior x drafter-probability reach, so a sharper prior
(Z_T < 1) spends it deeper along the likeliest branch, a flatter one across branches. Measured
on held-out training prompts (never an evaluation set): the embedded dblast-k4 at its CPU
fastest settings, committed tokens per target pass and the walk's expected accepted length + 1
per pass, for each Z_T, the same prompts and seeds.

    python recipes/smollm2/measure/trie_prior.py --category-temperatures 1 0.5 0.7 0.3 \
        >> recipes/smollm2/logs/trie-prior-<date>.log

Tokens per pass do not depend on timing, so this may share the cores with other work.
"""
import argparse
import sys
import time

import torch

from measuring import HELDOUT_SETS, add_heldout_run_args, heldout_prompts, load_pair_at_cpu_fastest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--category-temperatures", type=float, nargs="+", default=[1.0, 0.5, 0.7, 0.3])
    add_heldout_run_args(parser, sets=["math", "chat", "code"], prompts=16)
    args = parser.parse_args()

    from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
    from dblast_ext.drafting.drafter_io import checkpoint_digest
    from dblast_ext.target.loading import stop_token_ids

    target, tokenizer, drafter, settings = load_pair_at_cpu_fastest(args.drafter)
    if settings.verify != "tree":
        raise SystemExit(f"{args.drafter}: its CPU fastest settings verify by {settings.verify}, not a trie")
    prompts = heldout_prompts(tokenizer, args.sets, args.prompts)
    stops = stop_token_ids(target, tokenizer)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.drafter} "
          f"(digest {checkpoint_digest(args.drafter)}), {settings.dtype}, block {drafter.config.block_size}, "
          f"draft vocabulary {settings.draft_vocab}, trie of {settings.max_tree_nodes or 'every'} branch nodes, "
          f"T {args.temperature} top-p {args.top_p} top-k {args.top_k}, {args.max_new_tokens} new tokens, first "
          f"{args.prompts} prompts of {', '.join(HELDOUT_SETS[s] for s in args.sets)}, seed = prompt index, "
          f"{torch.get_num_threads()} threads", flush=True)
    for z in args.category_temperatures:
        decoder = SpeculativeDecoder(target, drafter, category_temperature=z, draft_vocab=settings.draft_vocab,
                                     verify="tree", max_tree_nodes=settings.max_tree_nodes)
        tokens = passes = 0
        expected = 0.0
        start = time.perf_counter()
        for seed, ids in enumerate(prompts):
            out = decoder.generate(ids, sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=seed)
            tokens += sum(c.num_accepted + 1 for c in out.cycles)
            expected += sum(c.expected_accepted + 1 for c in out.cycles)
            passes += len(out.cycles)
        print(f"Z_T {z:<4g} {tokens / passes:.3f} tokens per pass, expected {expected / passes:.3f} "
              f"({tokens} tokens, {passes} passes, {time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
