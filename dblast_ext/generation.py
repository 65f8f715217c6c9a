"""What the generation loops (speculative and target-only, one prompt or a batch) share: their
outputs and cycle records, checking prompts, one random stream per prompt, and cutting a row's
tokens at a stop token or the limit.

Each prompt draws its uniforms from its own generator, seeded by its own seed, in the same
order whatever else is in the batch: a row's output depends on its prompt and seed only.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch


@dataclass
class CycleRecord:
    num_accepted: int          # accepted drafts n, 0..b (committed length n + 1; a response's last
                               # cycle counts only the tokens kept before its stop token or limit)
    expected_accepted: float   # sum_i prod_{j<=i} A_j of the verified draft: the whole draft, also
                               # in a cycle cut at a stop token or the limit (a property of the
                               # proposal, not of what the response kept)
    branch: int
    prior: List[float]
    draft_time: float          # seconds in steps 1-2 of the cycle
    verify_time: float         # seconds in steps 3-5
    branches: List[int] = field(default_factory=list)  # the branches whose drafts begin with the
                               # accepted ones: [branch] for greedy-branch verification; for trie
                               # verification every branch through the deepest accepted node
    tree_nodes: int = 0        # trie verification: the draft nodes the target scored (0: branch mode)
    branch_rule_expected: Optional[float] = None  # trie verification: the expected accepted drafts of
                               # greedy-branch verification on the same proposal and target
                               # distributions, a same-context comparison (None: branch mode, or a
                               # node budget cut the trie)
    drafts: Optional[int] = None  # the drafts this cycle verified (the adaptive controller's depth;
                               # 0: a plain target step, no drafter pass; None: not recorded)


@dataclass
class GenerationOutput:
    token_ids: List[int]
    stopped_by_eos: bool
    cycles: List[CycleRecord] = field(default_factory=list)


def prompt_tensor(input_ids, max_new_tokens: int, device) -> torch.Tensor:
    """One prompt as a [1, T] int64 tensor on `device`, checked before any model runs."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    return ids


def prompt_lists(prompts, max_new_tokens: int) -> List[List[int]]:
    """A batch of prompts (a list of token-id sequences, or a [N, T] tensor) as lists, each
    checked like a single prompt, before any model runs."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts as a tensor must be [N, T], got shape {tuple(prompts.shape)}")
        prompts = prompts.tolist()
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    rows = []
    for index, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, torch.Tensor):  # (lists stay lists: no tensor round trip)
                prompt = prompt_tensor(prompt, max_new_tokens, "cpu")[0].tolist()
            rows.append([int(token) for token in prompt])
            if not rows[-1]:
                raise ValueError("input_ids is empty: the prompt needs at least one token")
        except (TypeError, ValueError) as error:
            raise ValueError(f"prompts[{index}]: {error}") from None
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    return rows


# the decode loops' target KV caches: compacted after each cycle (dblast_ext.ragged_cache), or fixed
# slots giving every verify forward the same shapes (dblast_ext.slot_cache)
TARGET_CACHES = ("dynamic", "static")


def check_target_cache(value: str) -> None:
    if value not in TARGET_CACHES:
        raise ValueError(f"target_cache must be one of {', '.join(TARGET_CACHES)}, got {value!r}")


def row_generators(seeds: Optional[Sequence[int]], rows: int, device) -> List[torch.Generator]:
    """One generator per prompt on `device` (seeds default to 0, 1, ..., N - 1)."""
    seeds = list(range(rows)) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != rows:
        raise ValueError(f"seeds must give one seed per prompt: {len(seeds)} seeds for {rows} prompts")
    return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


def draw_uniforms(generators: Sequence[torch.Generator], count: int, device) -> torch.Tensor:
    """[N, count] float64 uniforms, row r from generators[r] (no host round trip)."""
    return torch.stack([torch.rand(count, generator=g, device=device, dtype=torch.float64) for g in generators])


def append_context(context: torch.Tensor, lengths: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The drafter's pending context [N, T, F] (row r's first lengths[r] positions) with `features`
    [N, k, F] written right after each row's own: [N, T + k, F] (on the device, no host read).
    The features of plain target steps wait for the next drafter pass this way, so drafting
    resumes without a new prefill."""
    k = features.shape[1]
    grown = torch.cat([context, torch.zeros_like(features)], dim=1)
    where = (lengths.view(-1, 1) + torch.arange(k, device=lengths.device)).unsqueeze(-1)
    return grown.scatter(1, where.expand(-1, -1, features.shape[-1]), features)


def keep_until_stop(tokens: Sequence[int], generated: List[int], stops, max_new_tokens: int) -> bool:
    """Appends `tokens` to `generated` up to and including a stop token or the limit; True
    when the row is finished."""
    for token in tokens:
        generated.append(token)
        if token in stops or len(generated) >= max_new_tokens:
            return True
    return False


__all__ = ["CycleRecord", "GenerationOutput", "prompt_tensor", "prompt_lists", "row_generators", "draw_uniforms",
           "keep_until_stop", "append_context", "TARGET_CACHES", "check_target_cache"]
