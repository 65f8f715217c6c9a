"""Where a decoding cycle's time goes on this machine: the embedded pair with `dblast demo`'s
fastest exact settings, greedy-branch and trie verification, the demo's prompts and seeds, each
phase timed by wrapping the function that does it (the target's LM head by hooks on its
module). Prints milliseconds per cycle and per target-only step for each phase.

    python recipes/smollm2/measure/cycle_profile.py >> recipes/smollm2/logs/cycle-profile-<date>.log

Timings: run it on idle cores (nothing else multi-threaded beside it).
"""
import argparse
import collections
import functools
import sys
import time

import torch

from measuring import encode_prompts, load_pair_at_cpu_fastest


class PhaseClock:
    """Seconds spent in each wrapped callable (outermost call only, so nested phases do not
    count twice under one name; inner ones are read as parts of the outer)."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()

    def wrap(self, owner, name: str, label) -> None:
        """`label`: a name, or a function of the call's arguments that returns one."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                name = label(*args, **kwargs) if callable(label) else label
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        setattr(owner, name, timed)

    def hook_module(self, module, label: str) -> None:
        started = []
        module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))

        def done(*_):
            self.seconds[label] += time.perf_counter() - started.pop()
            self.calls[label] += 1
        module.register_forward_hook(done)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="dblast-k4")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify", nargs="+", default=["branch", "tree"], choices=["branch", "tree"])
    parser.add_argument("--max-tree-nodes", type=int, default=None,
                        help="branch nodes per trie (default: the CPU fastest settings' budget; 0: every node)")
    args = parser.parse_args()

    from dblast_ext.decoding import trie, trie_loop
    from dblast_ext.prompts import DEMO_PROMPTS
    from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
    from dblast_ext.target.loading import stop_token_ids

    target, tokenizer, drafter, settings = load_pair_at_cpu_fastest(args.drafter)
    dtype = settings.dtype
    sampling = SamplingParams(1.0, 20, 0.95)  # the demo's defaults
    stops = stop_token_ids(target, tokenizer)
    prompts = encode_prompts(tokenizer, DEMO_PROMPTS[:args.prompts])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.drafter}, {dtype}, block "
          f"{settings.block_size}, draft vocabulary {settings.draft_vocab}, T 1.0 top-p 0.95 top-k 20, "
          f"{args.max_new_tokens} new tokens, {args.prompts} demo prompts, {torch.get_num_threads()} threads",
          flush=True)

    clock = PhaseClock()
    # shared by both decoders: wrapped once
    clock.hook_module(target.lm_head, "target LM head (in the forwards)")
    clock.wrap(drafter, "forward", "propose: drafter layers")
    clock.wrap(trie_loop, "build_trie", "trie: build")
    clock.wrap(trie_loop, "add_alternative_leaves", "trie: extra leaves")
    clock.wrap(trie.DraftTrie, "attention_mask", "trie: attention mask")
    clock.wrap(trie.DraftTrie, "walk", "trie: walk")
    for verify in args.verify:
        budget = settings.max_tree_nodes if args.max_tree_nodes is None else (args.max_tree_nodes or None)
        decoder = SpeculativeDecoder(target, drafter, verify=verify, draft_vocab=settings.draft_vocab,
                                     max_tree_nodes=budget if verify == "tree" else None)
        proposer, adapter = decoder.proposer, decoder.target
        clock.wrap(proposer, "propose", "propose")
        clock.wrap(proposer, "ranked_tokens", "propose: ranked tokens (head, softmax, top-m)")
        clock.wrap(proposer, "draft_tokens", "propose: branch argmax op")
        clock.wrap(adapter, "forward", lambda *a, last_logits_only=False, **k:
                   "target prefill (once per prompt)" if last_logits_only else "target forward (branch rule)")
        clock.wrap(adapter, "forward_tree", "target forward (trie)")
        # sample also draws each prompt's first token, after the prefill (no query tokens there)
        clock.wrap(decoder.chain_cycle, "sample", lambda logits, uniforms, query_tokens, *a, **k:
                   "first token after the prefill" if query_tokens is None else "trie: sample every node")
        clock.wrap(decoder.chain_cycle, "verify", "branch rule: verify op")
        clock.wrap(adapter, "keep_rows", "trie: keep the walked rows")
        clock.wrap(adapter, "crop", "branch rule: crop the cache")
        decoder.warm_up(prompts[0], sampling, target_only=True, stop_token_ids=stops)

        steps = target_time = 0.0
        for i, ids in enumerate(prompts):
            start = time.perf_counter()
            base = decoder.generate_autoregressive(ids, sampling, max_new_tokens=args.max_new_tokens,
                                                   stop_token_ids=stops, seed=i)
            target_time += time.perf_counter() - start
            steps += len(base.token_ids)
        step = target_time / steps
        clock.reset()
        cycles = tokens = 0
        wall = 0.0
        for i, ids in enumerate(prompts):
            start = time.perf_counter()
            out = decoder.generate(ids, sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=i)
            wall += time.perf_counter() - start
            cycles += len(out.cycles)
            tokens += len(out.token_ids)
        nodes = f" ({'every node' if budget is None else f'{budget} branch nodes'})" if verify == "tree" else ""
        print(f"\n== {verify}{nodes}: {cycles} cycles, {tokens / cycles:.2f} tokens per cycle, target-only step "
              f"{step * 1e3:.1f} ms, cycle {wall / cycles * 1e3:.1f} ms = {wall / cycles / step:.2f} steps, "
              f"speed-up {tokens / wall * step:.2f}x")
        for label, seconds in sorted(clock.seconds.items(), key=lambda item: -item[1]):
            per_cycle = seconds / cycles
            print(f"  {label:48s} {per_cycle * 1e3:7.2f} ms/cycle {per_cycle / step:5.2f} steps "
                  f"({clock.calls[label] / cycles:.1f} calls/cycle)")
        print("  (indented phases nest: 'propose: ...' inside 'propose', the LM head inside the target forwards)")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
