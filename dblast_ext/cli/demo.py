"""`dblast demo`: the main job on the embedded pair, no downloads. SmolLM2-135M-Instruct drafted
by the shipped DBLast drafter answers a few built-in prompts at temperature 1.0 (top-p 0.95,
top-k 20); the answers stream, and each prompt's committed length per target pass is
printed, then the acceptance histogram over every cycle, the measured speed-up over sampling
with the target alone (same prompts, seeds and filter), and a cycle's measured cost in
target-only steps against the tokens it commits (which explains the speed-up)."""
import sys

from ..drafting.embedded_drafters import EMBEDDED_DRAFTERS
from ..target.loading import TextStream, encode_messages, stop_token_ids
from .common import (add_controller_args, add_draft_vocab_arg, add_runtime_args, add_sampling_args, add_verify_args,
                     check_args, draft_vocab_of, load_decoder, pick_fastest_settings, sampling_of)
from ..eval.metrics import speedup_ratio
from ..eval.contention import contention_warning
from ..foreign_load import timed
from ..prompts import DEMO_PROMPTS
from .display import acceptance_histogram, committed_length, drafting_line, exactness_line, rate


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="speculative sampling on the embedded SmolLM2 + DBLast pair",
                              description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--drafter", default="dblast-k4", choices=sorted(EMBEDDED_DRAFTERS),
                   help="which embedded drafter drafts (default %(default)s)")
    add_sampling_args(p, temperature=1.0)
    p.set_defaults(top_p=0.95, top_k=20, max_new_tokens=128)
    p.add_argument("--prompts", type=int, default=len(DEMO_PROMPTS),
                   help=f"how many of the {len(DEMO_PROMPTS)} built-in prompts to answer (default %(default)s)")
    p.add_argument("--block-size", type=int, default=None,
                   help="draft blocks of this length instead of the drafter's trained one (a shorter block "
                        "verifies fewer tokens per target pass, which pays on a CPU where a pass costs in "
                        "proportion to its length; default: the fastest measured on this device, "
                        "dblast_ext.decoding.fastest_settings)")
    add_draft_vocab_arg(p)
    add_verify_args(p, fastest=True)
    add_controller_args(p)
    p.set_defaults(adaptive_by_default=True)
    p.add_argument("--no-compare", action="store_true", help="skip the target-only runs (no speed-up figure)")
    add_runtime_args(p)


def run(args) -> int:
    if not 1 <= args.prompts <= len(DEMO_PROMPTS):
        raise ValueError(f"--prompts must be in 1..{len(DEMO_PROMPTS)}, got {args.prompts}")
    args.target, args.branches, args.no_kernels = "default", None, False
    check_args(args)
    out = sys.stdout
    picked = pick_fastest_settings(args)
    print("loading SmolLM2-135M-Instruct (the first run dequantises it once) ...", file=sys.stderr)
    decoder, tokenizer = load_decoder(args)
    drafter = decoder.drafter
    sampling = sampling_of(args)
    stops = stop_token_ids(decoder.target.model, tokenizer)
    vocab = "" if decoder.draft_ids is None else f", drafting from {len(decoder.draft_ids)} token ids"
    if decoder.verify == "tree":
        nodes = "every branch node" if decoder.max_tree_nodes is None else f"{decoder.max_tree_nodes} branch nodes"
        vocab += f", trie verification of {nodes} + {decoder.extra_leaves} extra leaves"
    dtype = str(decoder.target.dtype).replace("torch.", "")
    print(f"target SmolLM2-135M-Instruct ({dtype}), drafter {args.drafter} (K = {drafter.num_branches}, block "
          f"{drafter.config.block_size}{vocab}); temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}, "
          f"up to {args.max_new_tokens} new tokens", file=out)
    print(exactness_line(decoder.target.dtype, args.temperature), file=out)
    print((picked + "\n") if picked else "", file=out)
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": text}]) for text in DEMO_PROMPTS[:args.prompts]]
    decoder.warm_up(prompts[0], sampling, target_only=not args.no_compare, stop_token_ids=stops)

    accepted, depths, spec_tokens, spec_time, ar_tokens, ar_time, loads = [], [], 0, 0.0, 0, 0.0, []
    draft_time = verify_time = 0.0
    for i, (text, ids) in enumerate(zip(DEMO_PROMPTS, prompts)):
        print(f"[{i + 1}/{len(prompts)}] {text}", file=out)
        run_kwargs = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                          seed=args.seed + i)
        stream = TextStream(tokenizer, lambda piece: (out.write(piece), out.flush()))
        result, timing = timed(decoder.generate, ids, **run_kwargs, on_tokens=stream)
        cycles = [c.num_accepted for c in result.cycles]
        accepted += cycles
        depths += [c.drafts for c in result.cycles]
        draft_time += sum(c.draft_time for c in result.cycles)
        verify_time += sum(c.verify_time for c in result.cycles)
        spec_tokens += len(result.token_ids)
        spec_time += timing.wall_time
        loads.append(timing.foreign_load)
        line = f"\n    -> {rate(len(result.token_ids), timing.wall_time)}"
        if cycles:
            line += f", committed length {committed_length(cycles):.2f} tokens per target pass"
        if not args.no_compare:
            base, base_timing = timed(decoder.generate_autoregressive, ids, **run_kwargs)
            ar_tokens += len(base.token_ids)
            ar_time += base_timing.wall_time
            loads.append(base_timing.foreign_load)
            ratio = speedup_ratio(len(base.token_ids), base_timing.wall_time, len(result.token_ids), timing.wall_time)
            line += f"; target alone {len(base.token_ids) / base_timing.wall_time:.1f} tok/s, speed-up {ratio:.2f}x"
        print(line + "\n", file=out)

    if accepted:
        print(f"all prompts: {len(accepted)} cycles, committed length {committed_length(accepted):.2f} tokens per "
              "target pass; accepted drafts per cycle:", file=out)
        print(acceptance_histogram([accepted.count(n) for n in range(drafter.config.block_size)]), file=out)
        if decoder.controller == "adaptive":
            print(drafting_line(depths), file=out)
    else:  # every answer ended with the token the prefill samples (e.g. --max-new-tokens 1)
        print("all prompts: no drafting cycle ran (every answer ended at its first token)", file=out)
    print(f"speculative sampling: {rate(spec_tokens, spec_time)}", file=out)
    if not args.no_compare:
        speedup = speedup_ratio(ar_tokens, ar_time, spec_tokens, spec_time)
        print(f"target alone:         {rate(ar_tokens, ar_time)}\nspeed-up: {speedup:.2f}x", file=out)
        if accepted:
            print(cycle_cost_line(len(accepted), committed_length(accepted), draft_time, verify_time,
                                  ar_time / ar_tokens), file=out)
        for note in (cheaper_cycle_hint(decoder.target.device.type, speedup, draft_vocab_of(args), args.block_size),
                     contention_warning(loads)):
            if note:
                print(note, file=out)
    return 0


def cheaper_cycle_hint(device_type: str, speedup: float, draft_vocab, block_size) -> str:
    """Below 1x on a CPU, the flags that cheapen a cycle there (measured in results/smollm2/README.md),
    unless the run already uses them; "" otherwise."""
    if device_type != "cpu" or speedup >= 1.0 or (draft_vocab is not None and block_size is not None):
        return ""
    return ("on a CPU a cycle costs less with a draft vocabulary and a shorter block at about the same "
            "acceptance: try --draft-vocab 8192 --block-size 8 (0.57x -> 0.87x on a 2-core CPU; results/smollm2/README.md)")


def cycle_cost_line(cycles: int, committed: float, draft_time: float, verify_time: float, step_time: float) -> str:
    """Why the speed-up is what it is: a cycle's cost in target-only steps against the tokens
    it commits (their ratio is about the speed-up, less the prefill and loop overhead)."""
    draft, verify = draft_time / cycles / step_time, verify_time / cycles / step_time
    return (f"a cycle costs {draft + verify:.2f} target-only steps (draft {draft:.2f} + verify {verify:.2f}) and "
            f"commits {committed:.2f} tokens: {committed:.2f} / {draft + verify:.2f} = "
            f"{committed / (draft + verify):.2f}x before overheads; speculative sampling pays once the drafter "
            f"commits more tokens per cycle than a cycle costs")
