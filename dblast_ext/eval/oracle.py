"""The oracle drafter: the committed length of a drafter that always drafts the target's most
likely token, a drafter-free ceiling for one-branch greedy drafting on a target and filter.

With a one-hot draft x the verifier accepts with probability p(x) (DBLast Eq 18 with K = 1),
and on rejection the residual sample is never x; so the oracle, drafting the argmax of the
filtered p given the true prefix, accepts exactly when a sample from p is that argmax. Along a
response sampled from the target alone, its cycles can therefore be read off the positions
where the sampled token is the filtered argmax: a run of matches (at most b - 1 drafts) ends
at the first other token (the correction) or after b - 1 drafts (then the next token is the
bonus). Greedy decoding (T = 0) always matches: every cycle reaches the ceiling.
"""
import os
from typing import List, Sequence, Tuple

import torch

from .. import reference
from ..decoding import SamplingParams, TargetAdapter, sample_autoregressive
from ..progress import progress_bar
from ..target_loading import encode_messages
from .datasets import Prompt, chat_messages
from .records import append_record, read_records
from .runner import response_seed


@torch.inference_mode()
def top_token_matches(target: TargetAdapter, prompt_ids: Sequence[int], response_ids: Sequence[int],
                      sampling: SamplingParams) -> Tuple[List[bool], List[float]]:
    """For every response token after the first (which the prefill commits): whether it is the
    most likely token of the filtered target given the prompt and the response before it, and
    that token's probability. One target pass over prompt + response."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: the oracle needs the prompt the response answers")
    if len(response_ids) < 2:
        return [], []
    ids = torch.tensor([list(prompt_ids) + list(response_ids[:-1])], device=target.device)
    logits, _ = target.forward(ids, target.new_cache(), hidden_states=False)
    # row P + i - 1 predicts response token i (P = prompt length); rows from P predict tokens 1..
    probs = reference.filter_target_probs(logits[0, len(prompt_ids):].float().cpu(), **sampling.kwargs())
    top_probability, top_token = probs.max(dim=-1)
    matches = top_token == torch.tensor(list(response_ids[1:]))
    return matches.tolist(), top_probability.tolist()


def oracle_accepted(matches: Sequence[bool], num_draft: int) -> List[int]:
    """Accepted drafts per cycle of the oracle along one response, from the top_token_matches
    of its tokens after the first. A response that ends inside a run of matches ends its last
    cycle there (the drafts past the end are not counted, as the decode loop stops at EOS or
    the length cap)."""
    if num_draft < 1:
        raise ValueError(f"num_draft (block size - 1) must be >= 1, got {num_draft}")
    cycles, position = [], 0
    while position < len(matches):
        accepted = 0
        while accepted < num_draft and position + accepted < len(matches) and matches[position + accepted]:
            accepted += 1
        cycles.append(accepted)
        position += accepted + 1  # the correction or bonus token closes the cycle
    return cycles


def oracle_records(target: TargetAdapter, tokenizer, prompts: Sequence[Prompt], records_path: str, *,
                   sampling: SamplingParams, block_size: int, max_new_tokens: int, seed: int,
                   stop_token_ids: Sequence[int], settings: dict, progress: bool = True) -> List[dict]:
    """One record per prompt (its first turn), in the evaluation records' format (records.py;
    no expected_accepted): the target answers alone with the response seed `dblast eval`
    gives that turn, so these are the very responses of its target-only baseline. Resumable
    like run_prompts: prompts already in `records_path` are skipped."""
    done = {}
    if os.path.isfile(records_path):
        for r in read_records(records_path):
            if r.get("settings") != settings:
                raise ValueError(f"{records_path} holds records made with other settings ({r.get('settings')}); "
                                 f"use another output directory or delete it (this run: {settings})")
            done[(r["dataset"], r["prompt_id"])] = r
    records = []
    bar = progress_bar(len(prompts), desc="responses", unit="resp", enabled=progress)
    for prompt in prompts:
        key = (prompt.dataset, str(prompt.prompt_id))
        if key not in done:
            ids = encode_messages(tokenizer, chat_messages(prompt))
            out = sample_autoregressive(target, ids, sampling, max_new_tokens, stop_token_ids,
                                        response_seed(seed, prompt.dataset, prompt.prompt_id, 0))
            matches, top_probability = top_token_matches(target, ids, out.token_ids, sampling)
            done[key] = {
                "dataset": prompt.dataset, "prompt_id": str(prompt.prompt_id), "turn": 0,
                "accepted": oracle_accepted(matches, block_size - 1), "block_size": block_size,
                "eos_terminated": bool(out.stopped_by_eos), "new_tokens": len(out.token_ids),
                "top_probability": [round(p, 6) for p in top_probability], "settings": settings,
            }
            append_record(records_path, done[key])
        records.append(done[key])
        bar.update(1)
    bar.close()
    return records
