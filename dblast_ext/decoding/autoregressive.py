"""Sampling from the target alone, one token per pass: the speed-up baseline (one prompt, or a
batch with the same ragged-row cache as the speculative loop), and the oracle's reference."""
from typing import Callable, List, Optional, Sequence

import torch

from .. import ops, reference
from .generation import (GenerationOutput, check_target_cache, draw_uniforms, keep_until_stop, prompt_lists,
                         prompt_tensor, row_generators, stop_id_set)
from ..target.ragged_cache import RaggedRows
from ..sampling import SamplingParams, sample_from_logits
from ..target.adapter import TargetAdapter


@torch.inference_mode()
def sample_autoregressive(target: TargetAdapter, input_ids, sampling: Optional[SamplingParams] = None,
                          max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                          on_tokens: Optional[Callable[[List[int]], None]] = None,
                          on_probs: Optional[Callable[[torch.Tensor, int], None]] = None) -> GenerationOutput:
    """Sampling from the target alone, one token per pass, with the speculative path's filter and
    inverse-CDF rule; `on_probs(probs, token)` sees each token's filtered distribution."""
    sampling = sampling or SamplingParams()
    ids = prompt_tensor(input_ids, max_new_tokens, target.device, target.vocab_size)
    stops = stop_id_set(stop_token_ids, target.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    cache = target.new_cache()
    logits, _ = target.forward(ids, cache, hidden_states=False, last_logits_only=True)
    generated = []
    while True:
        token = sample_from_logits(logits[0, -1], sampling, generator, on_probs)
        generated.append(token)
        if on_tokens:
            on_tokens([token])
        if token in stops or len(generated) >= max_new_tokens:
            break
        logits, _ = target.forward(torch.tensor([[token]], device=ids.device), cache, hidden_states=False)
    stopped = bool(stops) and generated[-1] in stops
    return GenerationOutput(generated, stopped, [])


@torch.inference_mode()
def sample_autoregressive_batch(target: TargetAdapter, prompts, sampling: Optional[SamplingParams] = None,
                                max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None,
                                seeds: Optional[Sequence[int]] = None, use_kernels: bool = True,
                                target_cache: str = "dynamic") -> List[GenerationOutput]:
    """The target alone over a batch of prompts (left-padded, finished rows dropping out), one
    token per row per pass, drawn by `sample_tokens` from each prompt's own generator: the
    baseline of `SpeculativeDecoder.generate_batch`, batched the same way, with the same kind of
    target cache (`target_cache`, "dynamic" or "static": see SpeculativeDecoder). One host read
    per pass (the tokens)."""
    sampling = sampling or SamplingParams()
    rows = prompt_lists(prompts, max_new_tokens, target.vocab_size)
    check_target_cache(target_cache)
    stops = stop_id_set(stop_token_ids, target.vocab_size)
    device = target.device
    generators = row_generators(seeds, len(rows), device)
    layout = RaggedRows.left_padded([len(p) for p in rows])
    ids, mask, positions = layout.prefill_inputs(rows, device)
    cache = target.new_cache()
    logits, _ = target.forward(ids, cache, hidden_states=False, last_logits_only=True, attention_mask=mask,
                               position_ids=positions)
    if target_cache == "static":  # fixed shapes from here on, as in the speculative loop
        from ..target.slot_cache import SlotRows

        layout, cache = SlotRows.from_prefill(cache, layout, layout.end + max_new_tokens)
    sample = ops.sample_tokens if use_kernels else reference.sample_tokens
    outputs = [[] for _ in rows]
    active = list(range(len(rows)))
    while True:
        uniforms = draw_uniforms(generators, 1, device)[:, 0]
        kwargs = dict(validate=False) if use_kernels else {}
        tokens = sample(logits[:, -1], uniforms, **sampling.kwargs(), **kwargs).tokens
        going = [i for i, (row, token) in enumerate(zip(active, tokens.tolist()))
                 if not keep_until_stop([token], outputs[row], stops, max_new_tokens)]
        if not going:
            break
        if len(going) < len(active):
            layout.select(cache, going)
            tokens = tokens[torch.tensor(going, device=device)]
            active = [active[i] for i in going]
            generators = [generators[i] for i in going]
        mask, positions = layout.block_inputs(1, device)
        logits, _ = target.forward(tokens[:, None], cache, hidden_states=False, attention_mask=mask,
                                   position_ids=positions)
        layout.commit(cache, torch.ones_like(tokens) if layout.commits_on_device else [1] * len(active))
    return [GenerationOutput(out, bool(stops) and out[-1] in stops, []) for out in outputs]


__all__ = ["sample_autoregressive", "sample_autoregressive_batch"]
