"""`dblast generate`: speculative sampling from a local target with a local drafter, the text
streamed to stdout, the run's figures (committed length, acceptance histogram, speed,
optionally the speed-up over target-only sampling) to stderr or as JSON."""
import json
import sys

import torch

from ..decoding import SamplingParams, SpeculativeDecoder
from ..drafter_io import checkpoint_files, load_drafter
from ..target_loading import TextStream, default_device, encode_prompt, load_target, resolve_dtype, stop_token_ids
from .display import acceptance_histogram, rate


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with speculative sampling",
                              description="Generate text from a local Hugging Face causal LM, drafted by a local "
                                          "DFlash/DBLast drafter and verified exactly (the output follows the "
                                          "target's own sampling distribution).")
    p.add_argument("--target", required=True, help="local directory of a transformers causal LM (+ tokenizer)")
    p.add_argument("--drafter", required=True, help="local directory of a DFlash or DBLast drafter checkpoint")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off (default)")
    p.add_argument("--top-k", type=int, default=0, help="top-k; 0 = off (default)")
    p.add_argument("--branches", type=int, default=None,
                   help="K: add a K-branch head to a DFlash (K = 1) checkpoint (untrained: for trying the "
                        "machinery; a DBLast checkpoint brings its own)")
    p.add_argument("--category-temperature", type=float, default=1.0,
                   help="Z_T, the prior's temperature; 0 = always the most likely branch (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--compare-ar", action="store_true",
                   help="also sample with the target alone (same seed and filter) and report the speed-up")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--no-kernels", action="store_true", help="run the reference ops instead of the compiled kernels")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, figures) instead")


def _check(args) -> None:
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.branches is not None and args.branches < 1:
        raise ValueError(f"--branches must be >= 1, got {args.branches}")
    if not args.prompt:
        raise ValueError("the prompt is empty")
    resolve_dtype(args.dtype, args.device or default_device())
    checkpoint_files(args.drafter)  # before the (slower) target load


def run(args) -> int:
    _check(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    device = args.device or default_device()
    target, tokenizer = load_target(args.target, device=device, dtype=args.dtype)
    drafter = load_drafter(args.drafter, target=target, num_branches=args.branches)
    drafter = drafter.to(device=device, dtype=resolve_dtype(args.dtype, device)).eval()
    decoder = SpeculativeDecoder(target, drafter, category_temperature=args.category_temperature,
                                 use_kernels=not args.no_kernels)
    ids = encode_prompt(tokenizer, prompt, args.chat, args.system)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    stops = [] if args.ignore_eos else stop_token_ids(target, tokenizer)
    run_kwargs = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=args.seed)
    if args.compare_ar:  # one short warm-up of each loop, so one-time costs stay out of the comparison
        decoder.generate(ids, **dict(run_kwargs, max_new_tokens=min(8, args.max_new_tokens)))
        decoder.generate_autoregressive(ids, **dict(run_kwargs, max_new_tokens=min(8, args.max_new_tokens)))

    stream = None if args.json else TextStream(tokenizer, lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    out = decoder.generate(ids, **run_kwargs, on_tokens=stream)
    if stream:
        sys.stdout.write("\n")
    accepted = [c.num_accepted for c in out.cycles]
    new_tokens = len(out.token_ids)
    figures = {
        "new_tokens": new_tokens, "stopped_by_eos": out.stopped_by_eos, "wall_time": out.wall_time,
        "cycles": len(accepted), "accepted": accepted,
        # committed per target pass: n + 1 per cycle; the prefill's first token is not a cycle's
        "committed_length": sum(n + 1 for n in accepted) / len(accepted) if accepted else None,
        "expected_accepted": [c.expected_accepted for c in out.cycles],
        "block_size": drafter.config.block_size, "num_branches": drafter.num_branches,
    }
    if args.compare_ar:
        base = decoder.generate_autoregressive(ids, **run_kwargs)
        figures.update(ar_new_tokens=len(base.token_ids), ar_wall_time=base.wall_time,
                       speedup=(base.wall_time / len(base.token_ids)) / (out.wall_time / new_tokens))

    if args.json:
        figures.update(text=tokenizer.decode(out.token_ids, skip_special_tokens=True), token_ids=out.token_ids)
        print(json.dumps(figures))
        return 0
    err = sys.stderr
    print(f"--- {rate(new_tokens, out.wall_time)}" + (", stopped at end-of-sequence" if out.stopped_by_eos else ""),
          file=err)
    if accepted:
        print(f"--- {len(accepted)} cycles, committed length {figures['committed_length']:.2f} tokens per target "
              f"pass (K = {drafter.num_branches}, block {drafter.config.block_size}); accepted drafts per cycle:",
              file=err)
        print(acceptance_histogram(accepted, drafter.config.block_size - 1), file=err)
    if args.compare_ar:
        print(f"--- target alone: {rate(figures['ar_new_tokens'], figures['ar_wall_time'])}; "
              f"speed-up {figures['speedup']:.2f}x", file=err)
    return 0
