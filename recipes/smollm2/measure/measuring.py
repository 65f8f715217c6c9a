"""What the recipe's measurement scripts (extra_leaves.py, tree_budget.py, trie_prior.py,
cycle_profile.py, cycle_changes.py, data_speed.py) share: where the recipe's folders are, the
held-out training prompts they measure on (never an evaluation set), and the embedded pair
loaded at `dblast demo`'s fastest exact CPU settings.
"""
import json
import os
from typing import List, Sequence

# recipes/smollm2, whose data/ (the kept prompts and shards) lies beside this folder
RECIPE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# held-out prompt files by set, in data/prompts/ (written by prompts.py, self_instruct.py, code_prompts.py)
HELDOUT_SETS = {"math": "math-heldout.jsonl", "chat": "chat-heldout.jsonl", "code": "code-heldout.jsonl"}


def add_heldout_run_args(parser, *, sets: Sequence[str], prompts: int) -> None:
    """The flags every measurement on held-out prompts takes: which sets (default `sets`), the
    first N prompts of each (default `prompts`), the response length, and the sampling filter
    (T 1.0, top-p 0.95, top-k 20, as `dblast demo`)."""
    parser.add_argument("--drafter", default="dblast-k4")
    parser.add_argument("--sets", nargs="+", default=list(sets), choices=sorted(HELDOUT_SETS))
    parser.add_argument("--prompts", type=int, default=prompts, help="first N prompts of each held-out set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=20)


def heldout_texts(name: str, count: int) -> List[str]:
    """The first `count` prompts of held-out set `name` (a key of HELDOUT_SETS)."""
    if name not in HELDOUT_SETS:
        raise ValueError(f"unknown held-out set {name!r}: choose from {', '.join(sorted(HELDOUT_SETS))}")
    with open(os.path.join(RECIPE, "data", "prompts", HELDOUT_SETS[name]), encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:count]


def encode_prompts(tokenizer, texts: Sequence[str]) -> list:
    """Each text as one user turn in the target's chat template."""
    from dblast_ext.target.loading import encode_messages
    return [encode_messages(tokenizer, [{"role": "user", "content": text}]) for text in texts]


def heldout_prompts(tokenizer, sets: Sequence[str], count: int) -> list:
    """The first `count` prompts of each held-out set, encoded, set after set."""
    return [ids for name in sets for ids in encode_prompts(tokenizer, heldout_texts(name, count))]


def load_pair_at_cpu_fastest(drafter_name: str):
    """(target, tokenizer, drafter, settings): the embedded target and `drafter_name` with the dtype
    and inference block of dblast_ext.decoding.fastest_settings for a CPU (`settings` also holds the draft
    vocabulary, verification rule and node budget, which the decoder takes)."""
    from dblast_ext.drafting.drafter_io import load_drafter
    from dblast_ext.decoding.fastest_settings import fastest_exact_settings
    from dblast_ext.target.loading import load_target, resolve_dtype

    settings = fastest_exact_settings("cpu", drafter_name)
    target, tokenizer = load_target("default", device="cpu", dtype=settings.dtype, progress=False)
    drafter = load_drafter(drafter_name, target=target).to(dtype=resolve_dtype(settings.dtype, "cpu")).eval()
    if settings.block_size is not None:
        drafter.config.block_size = settings.block_size
    return target, tokenizer, drafter, settings
