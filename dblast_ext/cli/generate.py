"""`dblast generate`: speculative sampling from a local target with a local drafter, the text
streamed to stdout, the run's figures (committed length, acceptance histogram, speed,
optionally the speed-up over target-only sampling) to stderr or as JSON."""
import json
import sys

import torch

from ..target.loading import TextStream, encode_prompt, stop_token_ids
from .common import (add_category_temperature_arg, add_model_args, add_sampling_args, check_args, load_decoder,
                     pick_fastest_settings, sampling_of)
from ..eval.metrics import speedup_ratio
from ..eval.contention import contention_warning
from ..foreign_load import timed
from .display import acceptance_histogram, committed_length, drafting_line, exactness_line, rate


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with speculative sampling",
                              description="Generate text from a local Hugging Face causal LM, drafted by a local "
                                          "DFlash/DBLast drafter and verified exactly (the output follows the "
                                          "target's own sampling distribution).")
    add_model_args(p, fastest=True)
    p.set_defaults(adaptive_by_default=True)
    add_sampling_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    add_category_temperature_arg(p)
    p.add_argument("--compare-ar", action="store_true",
                   help="also sample with the target alone (same seed and filter) and report the speed-up")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, figures) instead")


def run(args) -> int:
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message goes through the chat template)")
    check_args(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise ValueError("--prompt: the prompt is empty" + (" (nothing on standard input)" if args.prompt == "-" else ""))
    picked = pick_fastest_settings(args)
    if picked:
        print(picked, file=sys.stderr)
    decoder, tokenizer = load_decoder(args, args.category_temperature)
    target, drafter = decoder.target.model, decoder.drafter
    if args.temperature == 0 and decoder.target.dtype != torch.float32:  # where "exact" needs its precise wording
        print(exactness_line(decoder.target.dtype, 0.0), file=sys.stderr)
    ids = encode_prompt(tokenizer, prompt, args.chat, args.system)
    sampling = sampling_of(args)
    stops = [] if args.ignore_eos else stop_token_ids(target, tokenizer)
    run_kwargs = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=args.seed)
    if args.compare_ar:
        decoder.warm_up(ids, sampling, stop_token_ids=stops)

    stream = None if args.json else TextStream(tokenizer, lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    out, timing = timed(decoder.generate, ids, **run_kwargs, on_tokens=stream)
    if stream:
        sys.stdout.write("\n")
    accepted = [c.num_accepted for c in out.cycles]
    new_tokens = len(out.token_ids)
    figures = {
        "new_tokens": new_tokens, "stopped_by_eos": out.stopped_by_eos, "wall_time": timing.wall_time,
        "foreign_load": timing.foreign_load,
        "cycles": len(accepted), "accepted": accepted,
        # committed per target pass: n + 1 per cycle; the prefill's first token is not a cycle's
        "committed_length": committed_length(accepted) if accepted else None,
        "expected_accepted": [c.expected_accepted for c in out.cycles],
        "block_size": drafter.config.block_size, "num_branches": drafter.num_branches,
        "draft_vocab": None if decoder.draft_ids is None else len(decoder.draft_ids),
        "verify": decoder.verify, "controller": decoder.controller if isinstance(decoder.controller, str) else "custom",
        "drafts": [c.drafts for c in out.cycles],
    }
    if decoder.verify == "tree":
        figures["tree_nodes"] = [c.tree_nodes for c in out.cycles]
    if args.compare_ar:
        base, base_timing = timed(decoder.generate_autoregressive, ids, **run_kwargs)
        figures.update(ar_new_tokens=len(base.token_ids), ar_wall_time=base_timing.wall_time,
                       ar_foreign_load=base_timing.foreign_load,
                       speedup=speedup_ratio(len(base.token_ids), base_timing.wall_time, new_tokens, timing.wall_time))

    if args.json:
        figures.update(text=tokenizer.decode(out.token_ids, skip_special_tokens=True), token_ids=out.token_ids)
        print(json.dumps(figures))
        return 0
    err = sys.stderr
    print(f"--- {rate(new_tokens, timing.wall_time)}" + (", stopped at end-of-sequence" if out.stopped_by_eos else ""),
          file=err)
    if accepted:
        tree = ""
        if decoder.verify == "tree":
            tree = f", trie verification over {sum(figures['tree_nodes']) / len(accepted):.1f} nodes per pass"
        print(f"--- {len(accepted)} cycles, committed length {figures['committed_length']:.2f} tokens per target "
              f"pass (K = {drafter.num_branches}, block {drafter.config.block_size}{tree}); accepted drafts per "
              f"cycle:", file=err)
        counts = [accepted.count(n) for n in range(drafter.config.block_size)]
        print(acceptance_histogram(counts), file=err)
        if decoder.controller == "adaptive":
            print(f"--- {drafting_line(figures['drafts'])}", file=err)
    if args.compare_ar:
        print(f"--- target alone: {rate(figures['ar_new_tokens'], figures['ar_wall_time'])}; "
              f"speed-up {figures['speedup']:.2f}x", file=err)
        warning = contention_warning([timing.foreign_load, base_timing.foreign_load])
        if warning:
            print(f"--- {warning}", file=err)
    return 0
