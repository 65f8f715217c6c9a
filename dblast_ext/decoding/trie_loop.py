"""The decode loop with trie verification (`verify="tree"`, one prompt at a time): each cycle
merges the K branches into a trie (plus extra leaves: the drafter's likeliest undrafted tokens),
scores every node in one target forward under a tree mask, draws one `sample_tokens` token per
node and walks the trie (dblast_ext.decoding.trie); the committed path's cache entries are kept.
"""
import math
import time
from dataclasses import replace
from typing import Callable, List, Optional, Sequence

import torch

from ..drafting.proposer import DrafterProposer, check_proposal
from ..sampling import SamplingParams, sample_from_logits
from .adaptive import DepthController
from .batch_loop import check_depth
from .chain_cycle import ChainCycle
from .generation import CycleRecord, GenerationOutput, keep_until_stop, prompt_tensor, stop_id_set
from .trie import add_alternative_leaves, build_trie, drafted_token_probs

__all__ = ["TrieCycle", "generate_tree", "TREE_EXTRA_LEAVES"]

# extra leaves per trie by default, chosen on held-out training prompts (not an evaluation set) with
# the embedded dblast-k4 at T 1.0 (recipes/smollm2/measure/extra_leaves.py): tokens per pass over the branch
# rule's +1.7% / +6.1% (math / chat) with none, +10.5% / +10.5% with 2, +21.4% / +13.8% with 4,
# +20.5% / +15.9% with 8; each leaf is one more row in the target pass
TREE_EXTRA_LEAVES = 4


class TrieCycle:
    """One cycle of trie verification over a chain cycle's target and proposer: at most
    `max_tree_nodes` branch nodes scored (None: all), plus `extra_leaves` leaves."""

    def __init__(self, steps: ChainCycle, max_tree_nodes: Optional[int], extra_leaves: int):
        self.steps = steps
        self.max_tree_nodes = max_tree_nodes
        self.extra_leaves = extra_leaves

    def run(self, anchor: int, context: torch.Tensor, target_cache, proposer_cache, sampling: SamplingParams,
            generator: torch.Generator, validate: bool, depth: Optional[int] = None):
        """Every branch scored in one pass, the trie cut at `depth` drafts (None: the whole block;
        0: a plain target step). Returns (the cycle's record, the committed tokens, their
        features, the conditional acceptance at each depth of the trie: the controller's
        observation)."""
        target, proposer = self.steps.target, self.steps.proposer
        device = context.device
        t0 = time.perf_counter()
        anchors = torch.tensor([anchor], dtype=torch.int64, device=device)
        if depth == 0:
            logits, features = target.forward(anchors[None], target_cache)
            token = sample_from_logits(logits[0, -1], sampling, generator)
            record = CycleRecord(0, 0.0, -1, [], 0.0, time.perf_counter() - t0, [], drafts=0)
            return record, [token], features, []
        proposal = proposer.propose(anchors, context, proposer_cache)                   # 1. propose
        if validate or not isinstance(proposer, DrafterProposer):
            check_proposal(proposal, target.vocab_size)
        depth = proposer.block_size - 1 if depth is None else depth
        prior = proposal.prior[0].tolist()
        ranked = getattr(proposal, "top_tokens", None) is not None
        branch_tokens = [tokens[:depth] for tokens in proposal.branch_tokens[0].tolist()]
        top_tokens = [tokens[:depth] for tokens in proposal.top_tokens[0].tolist()] if ranked else None
        top_probs = [probs[:depth] for probs in proposal.top_probs[0].tolist()] if ranked else None
        # a node budget keeps the nodes the drafter most expects a walk to reach, when it ranked its tokens
        token_probs = (drafted_token_probs(branch_tokens, top_tokens, top_probs)
                       if ranked and self.max_tree_nodes else None)
        trie = build_trie(branch_tokens, prior, self.max_tree_nodes, token_probs=token_probs)   # 2. the trie
        if self.extra_leaves and ranked:
            add_alternative_leaves(trie, top_tokens, top_probs, prior, self.extra_leaves)
        trie.tokens[0] = anchor
        t1 = time.perf_counter()

        start = target.cache_length(target_cache)                                       # 3. score every node
        mask = trie.attention_mask(start, target.dtype, device)
        logits, features = target.forward_tree(torch.tensor([trie.tokens], device=device), target_cache,
                                               trie.positions(start, device), mask)
        uniforms = torch.rand(proposer.block_size, generator=generator, dtype=torch.float64)
        drawn = self.steps.sample(logits[0], uniforms[trie.depths].to(device), trie.child_tokens(device), sampling,
                                  validate)                                              # 4. draw and walk
        walk = trie.walk(drawn.tokens.tolist(), drawn.query_probs.tolist())
        target.keep_rows(target_cache, start, walk.rows)                                # 5. keep the path
        accepted = len(walk.tokens) - 1
        record = CycleRecord(accepted, walk.expected_accepted, walk.branches[0], prior, t1 - t0,
                             time.perf_counter() - t1, walk.branches, trie.num_nodes, walk.branch_rule_expected,
                             drafts=depth)
        reach = [1.0] + walk.depth_reach
        acceptance = [reach[i + 1] / reach[i] if reach[i] > 0 else math.nan for i in range(len(walk.depth_reach))]
        return record, walk.tokens, features[:, walk.rows], acceptance


def generate_tree(cycle: TrieCycle, input_ids, sampling: Optional[SamplingParams], max_new_tokens: int,
                  stop_token_ids: Optional[Sequence[int]], seed: int, on_tokens: Optional[Callable[[List[int]], None]],
                  controller: DepthController) -> GenerationOutput:
    """Speculative sampling of one prompt with trie verification, each cycle capped at the depth
    `controller` picks (0: a plain target step); `on_tokens(new_ids)` streams."""
    target, proposer = cycle.steps.target, cycle.steps.proposer
    sampling = sampling or SamplingParams()
    ids = prompt_tensor(input_ids, max_new_tokens, target.device, target.vocab_size)
    stops = stop_id_set(stop_token_ids, target.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    cycle.steps.start_selector(sampling, tree=True)  # the trie verifies the selector's greedy chain

    target_cache = target.new_cache()
    logits, context = target.forward(ids, target_cache, last_logits_only=True)
    anchor = sample_from_logits(logits[0, -1], sampling, generator)
    generated = [anchor]
    if on_tokens:
        on_tokens([anchor])
    proposer_cache = proposer.new_cache(1, ids.shape[1] + max_new_tokens + proposer.block_size, ids.device)
    cycles, waiting = [], []  # waiting: plain steps' features, which the next drafter pass reads after `context`
    unseen = ids.shape[1]  # context tokens the drafter's next pass reads
    while len(generated) < max_new_tokens and anchor not in stops:
        depth = check_depth(controller.depth(unseen, max_new_tokens - len(generated)), proposer.block_size - 1)
        if depth and waiting:
            context, waiting = torch.cat([context] + waiting, dim=1), []
        record, emitted, features, acceptance = cycle.run(
            anchor, context, target_cache, proposer_cache, sampling, generator,
            validate=not any(c.drafts for c in cycles), depth=depth)
        controller.observe(depth, [acceptance])
        if depth == 0:
            waiting.append(features)
            unseen += 1
        else:
            context = features
            unseen = features.shape[1]
        cycles.append(record)
        before = len(generated)
        keep_until_stop(emitted, generated, stops, max_new_tokens)
        kept = len(generated) - before
        if kept < len(emitted):  # cut at a stop token or the limit: the cycle committed `kept` tokens
            cycles[-1] = replace(record, num_accepted=kept - 1)
        if on_tokens:
            on_tokens(generated[before:])
        anchor = generated[-1]
    stopped = bool(stops) and generated[-1] in stops
    return GenerationOutput(generated[:max_new_tokens], stopped, cycles)
