"""What each of the CPU trie cycle's changes of 2026-12-06 gives, side by side in one process: the
embedded pair at `dblast demo`'s settings (fastest exact CPU settings, T 1.0, top-p 0.95, top-k
20, the demo's four prompts and seeds, 128 new tokens, every cycle verifying the whole block), with
every change, with each one switched back to what the loop did before, and with none; the arms
in turn, round after round, so a drift of the machine spreads over all of them. The changes:

- grouped heads: the target's CPU forwards under a mask hand sdpa the grouped K/V heads
  (`target.grouped_heads_under_masks`) instead of transformers repeating them per layer;
- kept expander: the branch expander converted to the head's dtype once (`DBlastDrafter._expander_as`),
  not every cycle;
- crop: a walk that ends on the trie's first rows (the root alone) is kept by a crop, not a gather.

The outputs of every arm are the same token for token (checked): only the time changes.

    python recipes/smollm2/measure/cycle_changes.py >> recipes/smollm2/logs/cycle-changes-<date>.log

Run it on idle cores.
"""
import argparse
import contextlib
import statistics
import time

import torch

from measuring import encode_prompts, load_pair_at_cpu_fastest

CHANGES = ("grouped heads", "kept expander", "crop")


@contextlib.contextmanager
def without(changes, decoder):
    """The loop with `changes` switched back to their earlier behaviour."""
    from dblast_ext.drafting import drafter as drafter_module
    from dblast_ext.target import adapter as target_module

    saved = []
    if "grouped heads" in changes:
        saved.append((target_module, "grouped_heads_under_masks", target_module.grouped_heads_under_masks))
        target_module.grouped_heads_under_masks = lambda device: contextlib.nullcontext()
    if "kept expander" in changes:
        def converted_every_cycle(self, dtype, held):
            weight, bias = self.branch_expander.weight, self.branch_expander.bias
            return weight.to(dtype).to(held), bias.to(dtype).to(held)
        saved.append((drafter_module.DBlastDrafter, "_expander_as", drafter_module.DBlastDrafter._expander_as))
        drafter_module.DBlastDrafter._expander_as = converted_every_cycle
    if "crop" in changes:
        adapter = decoder.target
        keep_rows = adapter.keep_rows
        saved.append((adapter, "keep_rows", keep_rows))
        adapter.keep_rows = lambda cache, start, rows: keep_rows(cache, start, torch.tensor(rows, dtype=torch.int64))
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from dblast_ext.prompts import DEMO_PROMPTS
    from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
    from dblast_ext.target.loading import stop_token_ids

    target, tokenizer, drafter, settings = load_pair_at_cpu_fastest("dblast-k4")
    decoder = SpeculativeDecoder(target, drafter, verify="tree", draft_vocab=settings.draft_vocab,
                                 max_tree_nodes=settings.max_tree_nodes, controller="off")
    sampling = SamplingParams(1.0, 20, 0.95)
    stops = stop_token_ids(target, tokenizer)
    prompts = encode_prompts(tokenizer, DEMO_PROMPTS)
    arms = [("every change", ())] + [(f"without {c}", (c,)) for c in CHANGES] + [("none (before)", CHANGES)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: dblast-k4, {settings.dtype}, trie of "
          f"{settings.max_tree_nodes} branch nodes, T 1.0 top-p 0.95 top-k 20, {len(prompts)} demo prompts, 128 new "
          f"tokens, every cycle the whole block, {torch.get_num_threads()} threads, {args.rounds} rounds", flush=True)
    seconds = {name: [] for name, _ in arms}
    outputs = {}
    for round_ in range(args.rounds + 1):  # round 0 warms every arm up, untimed
        for name, changes in arms:
            with without(changes, decoder):
                start, cycles, tokens = time.perf_counter(), 0, []
                for i, ids in enumerate(prompts):
                    out = decoder.generate(ids, sampling, max_new_tokens=128, stop_token_ids=stops, seed=i)
                    cycles += len(out.cycles)
                    tokens.append(out.token_ids)
                elapsed = time.perf_counter() - start
            if outputs.setdefault("tokens", tokens) != tokens:
                raise SystemExit(f"{name}: the output differs from the first arm's")
            if round_:
                seconds[name].append(elapsed / cycles)
    base = statistics.median(seconds["none (before)"])
    print(f"{cycles} cycles per round, the same tokens in every arm")
    for name, _ in arms:
        cycle = statistics.median(seconds[name])
        print(f"  {name:28s} {cycle * 1e3:6.1f} ms per cycle (median of {args.rounds}), {base / cycle:.3f}x the "
              f"loop before")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
