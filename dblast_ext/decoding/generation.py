"""What the generation loops (speculative and target-only, one prompt or a batch) share: their
outputs and cycle records, checking prompts, one random stream per prompt, and cutting a row's
tokens at a stop token or the limit.

Each prompt draws its uniforms from its own generator, seeded by its own seed, in the same
order whatever else is in the batch: a row's output depends on its prompt and seed only.
"""
from dataclasses import dataclass, field
import numbers
from typing import List, Optional, Sequence, Set

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


def _token_ids(value, what: str) -> torch.Tensor:
    """`value` (a tensor or a nested sequence) as an int64 tensor, refusing anything that is
    not integer ids: a float prompt would otherwise be truncated to ids silently."""
    if not isinstance(value, torch.Tensor) and hasattr(value, "__len__") and len(value) == 0:
        return torch.empty(0, dtype=torch.int64)  # as_tensor would make an empty list float
    try:
        ids = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{what} must be token ids (a tensor or a list of integers): {error}") from None
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{what} must hold integer token ids, got {str(ids.dtype).replace('torch.', '')} values")
    return ids.to(torch.int64)


def _first_outside(ids: Sequence[int], vocab_size: Optional[int]) -> Optional[int]:
    """The position of the first id outside [0, vocab_size) (None: every id is inside, or no
    vocabulary was given)."""
    if vocab_size is None:
        return None
    return next((position for position, token in enumerate(ids) if not 0 <= token < vocab_size), None)


def _check_prompt_ids(ids: List[int], vocab_size: Optional[int]) -> None:
    """Every id of a prompt in [0, vocab_size), else an error naming the first bad id and its
    position (the embedding's own error names neither)."""
    position = _first_outside(ids, vocab_size)
    if position is not None:
        raise ValueError(f"input_ids: token id {ids[position]} at position {position} is outside the target's "
                         f"vocabulary [0, {vocab_size})")


def prompt_tensor(input_ids, max_new_tokens: int, device, vocab_size: Optional[int] = None) -> torch.Tensor:
    """One prompt as a [1, T] int64 tensor on `device`, checked before any model runs (integer
    ids, each in [0, vocab_size) when it is given)."""
    ids = _token_ids(input_ids, "input_ids")
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if vocab_size is not None:
        _check_prompt_ids(ids[0].tolist(), vocab_size)
    check_max_new_tokens(max_new_tokens)
    return ids.to(device)


def prompt_lists(prompts, max_new_tokens: int, vocab_size: Optional[int] = None) -> List[List[int]]:
    """A batch of prompts (a list of token-id sequences, or a [N, T] tensor) as lists, each
    checked like a single prompt, before any model runs; errors name the row."""
    if isinstance(prompts, torch.Tensor):
        prompts = _token_ids(prompts, "prompts")
        if prompts.dim() != 2:
            raise ValueError(f"prompts as a tensor must be [N, T], got shape {tuple(prompts.shape)}")
    elif isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a list of prompts (token-id sequences) or an [N, T] tensor, "
                         f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    rows = []
    for index, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, torch.Tensor):
                rows.append(prompt_tensor(prompt, 1, "cpu", vocab_size)[0].tolist())
            else:  # lists stay lists: no tensor round trip (nor a host read to count)
                rows.append(_id_list(prompt, vocab_size))
        except ValueError as error:
            raise ValueError(f"prompts[{index}]: {error}") from None
    check_max_new_tokens(max_new_tokens)
    return rows


def _id_list(prompt, vocab_size: Optional[int]) -> List[int]:
    """A prompt given as a sequence of ints, checked as prompt_tensor checks a tensor."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"input_ids must be token ids (a tensor or a list of integers), got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(f"input_ids must hold integer token ids, got {token!r} at position {position}")
    ids = [int(token) for token in ids]
    _check_prompt_ids(ids, vocab_size)
    return ids


def check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be an integer > 0, got {max_new_tokens!r}")


def stop_id_set(stop_token_ids, vocab_size: Optional[int] = None) -> Set[int]:
    """The stop ids as a set, each an integer id in [0, vocab_size): an id outside the
    vocabulary could never stop anything, so it is a mistake, not a no-op."""
    if stop_token_ids is None:
        return set()
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
    ids = _token_ids(stop_token_ids if isinstance(stop_token_ids, torch.Tensor) else list(stop_token_ids),
                     "stop_token_ids").view(-1).tolist()
    index = _first_outside(ids, vocab_size)
    if index is not None:
        raise ValueError(f"stop_token_ids[{index}] = {ids[index]} is outside the target's vocabulary [0, {vocab_size})")
    return set(ids)


# the decode loops' target KV caches: compacted after each cycle (dblast_ext.target.ragged_cache), or fixed
# slots giving every verify forward the same shapes (dblast_ext.target.slot_cache)
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


__all__ = ["CycleRecord", "GenerationOutput", "prompt_tensor", "prompt_lists", "stop_id_set", "check_max_new_tokens",
           "row_generators", "draw_uniforms", "keep_until_stop", "append_context", "TARGET_CACHES", "check_target_cache"]
