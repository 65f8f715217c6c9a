"""How many branch nodes trie verification should score per cycle on a CPU
(dblast_ext.decoding.fastest_settings), measured on held-out training prompts, never an evaluation set:
the embedded drafter with `dblast demo`'s fastest exact settings, greedy-branch verification and
trie verification under each node budget (the nodes the drafter expects a walk to reach most
often, plus the default extra leaves), against the target alone on the same prompts and seeds.

    python recipes/smollm2/measure/tree_budget.py --budgets 0 24 16 12 8 \
        >> recipes/smollm2/logs/tree-budget-<date>.log

A target pass costs more the more rows it scores, so fewer nodes can be faster even though each
pass commits fewer tokens. Timings: run it on idle cores (nothing else multi-threaded beside it).
"""
import argparse
import sys
import time

import torch

from measuring import HELDOUT_SETS, add_heldout_run_args, heldout_prompts, load_pair_at_cpu_fastest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 24, 16, 12, 8],
                        help="branch nodes per trie (0: all of them)")
    parser.add_argument("--extra-leaves", type=int, default=None,
                        help="extra leaves per trie (default: dblast_ext.decoding.decoder.TREE_EXTRA_LEAVES)")
    parser.add_argument("--no-branch", action="store_true", help="leave out greedy-branch verification")
    add_heldout_run_args(parser, sets=["math", "chat"], prompts=8)
    args = parser.parse_args()

    from dblast_ext.decoding.decoder import TREE_EXTRA_LEAVES, SamplingParams, SpeculativeDecoder
    from dblast_ext.drafting.drafter_io import checkpoint_digest
    from dblast_ext.target.loading import stop_token_ids

    target, tokenizer, drafter, settings = load_pair_at_cpu_fastest(args.drafter)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    stops = stop_token_ids(target, tokenizer)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.drafter} "
          f"(digest {checkpoint_digest(args.drafter)}), {settings.dtype}, block {drafter.config.block_size}, "
          f"draft vocabulary {settings.draft_vocab}, T {args.temperature} top-p {args.top_p} top-k {args.top_k}, "
          f"{args.max_new_tokens} new tokens, {TREE_EXTRA_LEAVES if args.extra_leaves is None else args.extra_leaves} "
          f"extra leaves, first {args.prompts} prompts of "
          f"{', '.join(HELDOUT_SETS[s] for s in args.sets)}, seed = prompt index, {torch.get_num_threads()} threads",
          flush=True)
    prompts = heldout_prompts(tokenizer, args.sets, args.prompts)

    def run(decoder, speculative: bool):
        tokens = passes = nodes = 0
        start = time.perf_counter()
        for seed, ids in enumerate(prompts):
            kwargs = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=seed)
            if speculative:
                out = decoder.generate(ids, sampling, **kwargs)
                passes += len(out.cycles)
                nodes += sum(c.tree_nodes or 0 for c in out.cycles)
            else:
                out = decoder.generate_autoregressive(ids, sampling, **kwargs)
            tokens += len(out.token_ids)
        return tokens, passes, nodes, time.perf_counter() - start

    decoders = [("branch", SpeculativeDecoder(target, drafter, draft_vocab=settings.draft_vocab))]
    decoders += [(f"tree, {'all' if n == 0 else n} branch nodes",
                  SpeculativeDecoder(target, drafter, draft_vocab=settings.draft_vocab, verify="tree",
                                     max_tree_nodes=n or None, extra_leaves=args.extra_leaves))
                 for n in args.budgets]
    decoders[0][1].warm_up(prompts[0], sampling, target_only=True, stop_token_ids=stops)
    for _, decoder in decoders[1:]:
        decoder.warm_up(prompts[0], sampling, target_only=False, stop_token_ids=stops)
    alone_tokens, _, _, alone_time = run(decoders[0][1], speculative=False)
    if args.no_branch:
        decoders = decoders[1:]
    print(f"target alone: {alone_tokens} tokens in {alone_time:.1f} s ({alone_tokens / alone_time:.1f} tok/s)",
          flush=True)
    for label, decoder in decoders:
        tokens, passes, nodes, seconds = run(decoder, speculative=True)
        speedup = (tokens / seconds) / (alone_tokens / alone_time)
        trie = f", {nodes / passes:.1f} nodes per pass" if decoder.verify == "tree" else ""
        print(f"{label:26s} {tokens / passes:.3f} tokens per pass, {seconds / passes * 1e3:.1f} ms per pass{trie}, "
              f"{tokens / seconds:.1f} tok/s, speed-up {speedup:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
