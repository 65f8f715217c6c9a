"""The top-token oracle: the committed length of a drafter that always drafts the target's most
likely token, a drafter-free reference point for one-branch greedy drafting on a target and
filter (not an upper bound: another first token can lead to a more certain continuation).

With a one-hot draft x the verifier accepts with probability p(x) (DBLast Eq 18 with K = 1),
and on rejection the residual sample is never x; so the oracle, drafting the argmax of the
filtered p given the committed prefix, accepts exactly when a sample from p is that argmax.
Along a response sampled from the target alone, its cycles can therefore be read off the
tokens that are the argmax of the distribution they were drawn from: a run of such tokens (at
most b = B - 1 drafts) ends at the first other token (the correction) or after b drafts (then
the next token is the bonus). Greedy decoding (T = 0) always matches: every cycle reaches the
ceiling bin.
"""
from typing import List, Sequence, Tuple

import torch

from ..decoding.decoder import GenerationOutput, sample_autoregressive
from ..sampling import SamplingParams
from ..target.adapter import TargetAdapter
from ..progress import progress_bar
from ..target.loading import encode_messages
from ..prompts import Prompt, chat_messages
from .metrics import kept_records
from .records import append_record, read_done_records
from .report import summarize_run
from .runner import response_seed


def sample_with_top_tokens(target: TargetAdapter, prompt_ids: Sequence[int], sampling: SamplingParams,
                           max_new_tokens: int, stop_token_ids: Sequence[int], seed: int
                           ) -> Tuple[GenerationOutput, List[bool], List[float]]:
    """A response sampled from the target alone, and for each of its tokens after the first
    (which the prefill commits): whether it is the most likely token of the filtered
    distribution it was drawn from, and that most likely token's probability."""
    matches, top_probability = [], []

    def record(probs: torch.Tensor, token: int) -> None:
        top = int(probs.argmax())  # the lowest id on ties, as the greedy filter picks
        matches.append(top == token)
        top_probability.append(float(probs[top]))

    out = sample_autoregressive(target, prompt_ids, sampling, max_new_tokens, stop_token_ids, seed, on_probs=record)
    return out, matches[1:], top_probability[1:]


def oracle_accepted(matches: Sequence[bool], num_draft: int) -> List[int]:
    """Accepted drafts per cycle of the oracle along one response, from the top-token matches of
    its tokens after the first. A cycle commits its accepted drafts and the correction or bonus
    token; a response that ends inside a cycle counts only the tokens it kept there (n + 1 =
    kept, as the decoder counts), so the counts add up to the response's length."""
    if num_draft < 1:
        raise ValueError(f"num_draft (block size - 1) must be >= 1, got {num_draft}")
    cycles, position = [], 0
    while position < len(matches):
        accepted = 0
        while accepted < num_draft and position + accepted < len(matches) and matches[position + accepted]:
            accepted += 1
        committed = min(accepted + 1, len(matches) - position)
        cycles.append(committed - 1)
        position += committed
    return cycles


def oracle_records(target: TargetAdapter, tokenizer, prompts: Sequence[Prompt], records_path: str, *,
                   sampling: SamplingParams, block_size: int, max_new_tokens: int, seed: int,
                   stop_token_ids: Sequence[int], settings: dict, progress: bool = True) -> List[dict]:
    """One record per prompt (its first turn) with the fields metrics.summarize reads
    (`accepted` per cycle, `block_size`, `eos_terminated`, ...; no expected_accepted or
    timings) plus `top_probability` per token. The target answers alone with the response seed
    `dblast eval` gives that turn: the very responses of its target-only baseline. Resumable:
    prompts already in `records_path` are skipped."""
    done = read_done_records(records_path, settings, lambda r: (r["dataset"], r["prompt_id"]))
    records = []
    bar = progress_bar(len(prompts), desc="responses", unit="resp", enabled=progress)
    for prompt in prompts:
        key = (prompt.dataset, str(prompt.prompt_id))
        if key not in done:
            out, matches, top_probability = sample_with_top_tokens(
                target, encode_messages(tokenizer, chat_messages(prompt)), sampling, max_new_tokens, stop_token_ids,
                response_seed(seed, prompt.dataset, prompt.prompt_id, 0))
            done[key] = {
                "dataset": prompt.dataset, "prompt_id": key[1], "turn": 0,
                "accepted": oracle_accepted(matches, block_size - 1), "block_size": block_size,
                "eos_terminated": bool(out.stopped_by_eos), "new_tokens": len(out.token_ids),
                "top_probability": [round(p, 6) for p in top_probability], "settings": settings,
            }
            append_record(records_path, done[key])
        records.append(done[key])
        bar.update(1)
    bar.close()
    return records


def summarize_oracle(records: Sequence[dict], *, eos_only: bool = True) -> dict:
    """summarize_run of the oracle's records, each dataset with the mean top-token probability
    (pooled over the tokens of the responses the statistics use; tau is a prompt mean)."""
    result = summarize_run(records, eos_only=eos_only)
    for name, s in result["datasets"].items():
        used = kept_records([r for r in records if r["dataset"] == name], eos_only=eos_only)
        probabilities = [p for r in used for p in r["top_probability"]]
        s["top_probability"] = sum(probabilities) / len(probabilities) if probabilities else None
    return result
