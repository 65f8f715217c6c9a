"""A DFlash2 generation loop at T = 0 in the order of operations of z-lab's published reference
(its `dflash_generate`, read to learn the order, not copied), written plainly: no caches at all,
every cycle recomputes the target over the whole sequence and the drafter over the whole
committed context (the training forward, dblast_ext.training.block_forward), so that it shares
no cache, kernel or decode-loop code with dblast_ext.decoding.decoder.

The order it follows: the prompt's prefill gives the first anchor (the target's argmax); each
cycle drafts a block [anchor, mask x (B - 1)] whose queries see the context features of every
committed position before the anchor (the target's hidden states after the drafter's target
layers, l + 1 in transformers' indexing) and the whole block (no causal order within it), with
convolution taps that start at the anchor; the selector walks the B - 1 drafted rows from the
anchor; the target scores [anchor, drafts]; the longest prefix of drafts equal to its argmax is
accepted and its argmax after them is the next anchor. Near the length limit the reference
drafts a shorter block (min(B, limit - position)).
"""
from typing import List, Tuple

import torch

from dblast_ext.drafting.dflash2 import draft_logits
from dblast_ext.training.block_forward import block_inputs, drafter_block_hidden


@torch.no_grad()
def reference_greedy(model, drafter, prompt: List[int], max_new_tokens: int) -> Tuple[List[int], list]:
    """(the generated ids, [(drafts, accepted) per cycle])."""
    config = drafter.config
    layers = [layer + 1 for layer in config.target_layer_ids]
    head = model.get_output_embeddings().weight
    table = model.get_input_embeddings().weight
    ids = list(prompt)
    logits = model(torch.tensor([ids])).logits[0, -1]
    ids.append(int(logits.argmax()))
    limit = len(prompt) + max_new_tokens
    cycles = []
    while len(ids) < limit:
        start = len(ids) - 1                      # the anchor's position
        size = min(config.block_size, limit - start)
        if size > 1:
            out = model(torch.tensor([ids[:start]]), output_hidden_states=True)
            features = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
            saved, config.block_size = config.block_size, size   # the short block near the limit
            sequence = torch.tensor([ids + [0] * (size - 1)])
            inputs = block_inputs(drafter, lambda t: table[t], sequence, torch.tensor([[start]]))
            hidden = drafter_block_hidden(drafter, inputs["embeddings"], inputs["positions"], features,
                                          torch.tensor([[start]]))[0, 1:]
            config.block_size = saved
            scores = draft_logits(hidden @ head.T, config.output_multiplier, config.final_logit_softcapping)
            drafts = drafter.candidate_selector.walk(torch.tensor([ids[start]]), hidden[None], scores[None]).tokens
            drafts = drafts[0].tolist()
        else:
            drafts = []
        verified = model(torch.tensor([ids + drafts])).logits[0, start:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
            accepted += 1
        ids += drafts[:accepted] + [verified[accepted]]
        cycles.append((drafts, accepted))
    return ids[len(prompt):limit], cycles
