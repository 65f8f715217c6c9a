"""What drafter capacity costs in a decoding cycle on this CPU (issue 58: capacity chosen by
evidence needs each candidate's cost beside its acceptance). For each drafter depth, the shipped
`dblast-k4` with that many layers (extra layers copied from its last one: the weights do not
change the time, and the trie is capped at the CPU budget of branch nodes, so every cycle scores
the same number of nodes) decodes the demo's prompts with `dblast demo`'s fastest exact settings,
every cycle drafting the whole block (controller off). Prints, per depth, the drafter's layers,
the whole proposal and the cycle in milliseconds and in target-only steps, timed by the same
phase clock as cycle_profile.py, depths interleaved prompt by prompt so drift hits all alike.

    python recipes/smollm2/measure/capacity_cost.py >> recipes/smollm2/logs/capacity-cost-<date>.log

Timings: run it on idle cores (nothing else multi-threaded beside it).
"""
import argparse
import copy
import time

from cycle_profile import PhaseClock
from measuring import encode_prompts, load_pair_at_cpu_fastest


def deeper(drafter, layers: int):
    """`drafter` with `layers` layers: its own, then copies of its last."""
    if layers < 1:
        raise SystemExit(f"--layers: every depth must be >= 1, got {layers}")
    out = copy.deepcopy(drafter)
    while len(out.layers) < layers:
        out.layers.append(copy.deepcopy(out.layers[-1]))
    del out.layers[layers:]
    out.config.num_hidden_layers = layers
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 3, 4], help="drafter depths to time")
    parser.add_argument("--prompts", type=int, default=4, help="demo prompts per depth")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts (the first warms up)")
    args = parser.parse_args()
    if args.rounds < 2:
        raise SystemExit(f"--rounds must be >= 2 (the first is a warm-up), got {args.rounds}")

    from dblast_ext.decoding import SamplingParams, SpeculativeDecoder
    from dblast_ext.decoding.adaptive import machine_description
    from dblast_ext.decoding.fastest_settings import cpu_has_native_bf16
    from dblast_ext.prompts import DEMO_PROMPTS
    from dblast_ext.target.loading import stop_token_ids

    target, tokenizer, shipped, settings = load_pair_at_cpu_fastest("dblast-k4")
    sampling = SamplingParams(1.0, 20, 0.95)  # the demo's defaults
    stops = stop_token_ids(target, tokenizer)
    prompts = encode_prompts(tokenizer, DEMO_PROMPTS[:args.prompts])
    native = "native" if cpu_has_native_bf16() else "no native"
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {machine_description()} ({native} bfloat16), "
          f"{settings.dtype}, block {settings.block_size}, {settings.draft_vocab} draft ids, trie of "
          f"{settings.max_tree_nodes} branch nodes + extra leaves, controller off, T 1.0 top-p 0.95 top-k 20, "
          f"{args.max_new_tokens} new tokens x {args.prompts} demo prompts x {args.rounds - 1} timed rounds",
          flush=True)

    clock = PhaseClock()
    decoders = {}
    for layers in args.layers:
        drafter = deeper(shipped, layers)
        decoder = SpeculativeDecoder(target, drafter, verify=settings.verify, draft_vocab=settings.draft_vocab,
                                     max_tree_nodes=settings.max_tree_nodes, controller="off")
        clock.wrap(drafter, "forward", f"{layers}: drafter layers")
        clock.wrap(decoder.proposer, "propose", f"{layers}: propose")
        decoders[layers] = decoder
    totals = {layers: [0.0, 0] for layers in args.layers}  # seconds in cycles, cycles
    base = [0.0, 0]  # seconds, tokens of the target alone
    for round_ in range(args.rounds):
        timed = round_ > 0
        if round_ == 1:
            clock.reset()
        for i, ids in enumerate(prompts):
            start = time.perf_counter()
            alone = decoders[args.layers[0]].generate_autoregressive(ids, sampling, max_new_tokens=args.max_new_tokens,
                                                                     stop_token_ids=stops, seed=i)
            if timed:
                base[0] += time.perf_counter() - start
                base[1] += len(alone.token_ids)
            for layers, decoder in decoders.items():
                start = time.perf_counter()
                out = decoder.generate(ids, sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=i)
                if timed:
                    totals[layers][0] += time.perf_counter() - start
                    totals[layers][1] += len(out.cycles)
    step = base[0] / base[1]
    print(f"target-only step {1e3 * step:.1f} ms")
    print(f"{'layers':>6} {'drafter layers':>16} {'propose':>16} {'cycle':>16}")
    for layers in args.layers:
        cycles = totals[layers][1]
        cells = [clock.seconds[f"{layers}: drafter layers"] / cycles, clock.seconds[f"{layers}: propose"] / cycles,
                 totals[layers][0] / cycles]
        print(f"{layers:>6} " + " ".join(f"{1e3 * s:7.1f} ms {s / step:4.2f} st" for s in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
