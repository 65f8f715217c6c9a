"""`dblast data ACTION`: drafter training data. `generate` samples responses from the target
itself (its filtered distribution, with the per-token probabilities the losses need) into a
resumable JSONL file; see dblast_ext.training.data for the format."""
import os

from ..sampling import SamplingParams
from ..eval.datasets import load_dataset_list
from ..target.loading import load_target
from ..training.data import check_existing, generate_training_data, sampling_settings
from .common import add_sampling_args, add_target_args, check_sampling_args, check_target_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("data", help="drafter training data (generate)",
                              description="Drafter training data.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    g = actions.add_parser("generate", help="sample training responses from the target itself",
                           description="Regenerate training responses with the target: sample from its filtered "
                                       "distribution (temperature, top-k, top-p) and store prompt + response ids, "
                                       "the loss mask and the target's log-probabilities, one JSON line per "
                                       "(prompt, sample). Rerunning with the same --out resumes.")
    add_target_args(g)
    g.add_argument("--prompts", required=True,
                   help="comma-separated: .jsonl files (`prompt` or chat `messages` per line) or gsm8k, math500, "
                        "humaneval, mtbench; the first user turn of each prompt is used")
    g.add_argument("--out", required=True, help="output .jsonl (an existing one is resumed)")
    add_sampling_args(g, temperature=0.7)
    g.set_defaults(top_p=0.8, top_k=20)
    g.add_argument("--samples-per-prompt", type=int, default=1, help="responses per prompt (default %(default)s)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences sampled at once (default %(default)s)")
    g.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each dataset")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.set_defaults(resumable=True)  # main's message on Ctrl-C


def check_generate_args(args) -> None:
    """Cheap checks before any model loads, each naming its flag."""
    for flag, value in (("--samples-per-prompt", args.samples_per_prompt), ("--batch-size", args.batch_size)):
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.num_prompts is not None and args.num_prompts <= 0:
        raise ValueError(f"--num-prompts must be > 0, got {args.num_prompts}")
    check_sampling_args(args)
    check_target_args(args)
    if os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a directory; give a .jsonl file path")


def run_generate(args) -> int:
    check_generate_args(args)
    try:
        prompts = load_dataset_list(args.prompts, limit=args.num_prompts)
    except ValueError as e:
        raise ValueError(f"--prompts: {e}") from None
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    check_existing(args.out, sampling_settings(sampling, args.max_new_tokens, args.seed))  # before loading
    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype, progress=not args.no_progress)
    records = generate_training_data(model, tokenizer, prompts, args.out, sampling=sampling,
                                     samples_per_prompt=args.samples_per_prompt,
                                     max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                     seed=args.seed, progress=not args.no_progress)
    responses = sum(sum(r["loss_mask"]) for r in records)
    eos = sum(r["eos_terminated"] for r in records)
    print(f"{len(records)} sequences ({len(prompts)} prompts x {args.samples_per_prompt}), {responses} response "
          f"tokens, {eos} ended with EOS: {args.out}")
    return 0


ACTIONS = {"generate": run_generate}


def run(args) -> int:
    return ACTIONS[args.action](args)
