"""The decode loop over a batch of prompts, one branch verified per row and cycle
(`SpeculativeDecoder.generate_batch`; `generate` is a batch of one):

prefill, then per cycle: the controller's depth, the uniforms, the chain cycle's device steps
(`ChainCycle`, or their CUDA-graph replay), the cycle's one host read (accepted counts, tokens,
acceptance), the commit into the target cache, and rows that finished dropping out. Records
(branch, prior, expected accepted length) stay on the device until the batch ends.
"""
import math
import time
from typing import Callable, List, Optional, Sequence

import torch

from ..drafting.proposer import first_drafts
from ..sampling import SamplingParams
from ..target.ragged_cache import RaggedRows
from .adaptive import DepthController
from .chain_cycle import ChainCycle
from .generation import CycleRecord, GenerationOutput, append_context, draw_uniforms, keep_until_stop, row_generators, \
    stop_id_set

__all__ = ["generate_rows", "check_depth"]


def check_depth(depth, max_depth: int) -> int:
    """A controller's depth, refused unless an integer in 0..max_depth (the block's drafts)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= max_depth:
        raise ValueError(f"the controller chose depth {depth!r}: a cycle verifies 0..{max_depth} drafts")
    return depth


def generate_rows(steps: ChainCycle, rows: List[List[int]], sampling: Optional[SamplingParams], max_new_tokens: int,
                  stop_token_ids: Optional[Sequence[int]], seeds: Optional[Sequence[int]],
                  on_tokens: Optional[Callable[[int, List[int]], None]], controller: DepthController, *,
                  target_cache: str = "dynamic", graphs=None) -> List[GenerationOutput]:
    """Speculative sampling of `rows` (checked prompt id lists), each cycle verifying the number of
    drafts `controller` picks, over the "dynamic" or "static" target cache; `graphs`: a
    `cuda_graphs.CycleGraphs` to replay the cycle from (None: every step eager)."""
    target, proposer = steps.target, steps.proposer
    sampling = sampling or SamplingParams()
    stops = stop_id_set(stop_token_ids, target.vocab_size)
    device = target.device
    generators = row_generators(seeds, len(rows), device)
    block = proposer.block_size
    selector_draws = steps.start_selector(sampling)

    layout = RaggedRows.left_padded([len(p) for p in rows])
    ids, mask, positions = layout.prefill_inputs(rows, device)
    cache = target.new_cache()
    logits, features = target.forward(ids, cache, last_logits_only=True, attention_mask=mask, position_ids=positions)
    anchors = steps.sample(logits[:, -1], draw_uniforms(generators, 1, device)[:, 0], None, sampling,
                           validate=False).tokens
    context = layout.left_align(features)
    context_lens = torch.tensor(layout.lengths, device=device)
    proposer_cache = proposer.new_cache(len(rows), layout.end + max_new_tokens + 2 * block, device)
    # fixed shapes from here on; an active row holds at most prompt + max_new_tokens - 2 tokens before
    # its block, so this capacity always has room for the last one
    if target_cache == "static":
        from ..target.slot_cache import SlotRows

        layout, cache = SlotRows.from_prefill(cache, layout, layout.end + max_new_tokens + block)

    outputs = [[] for _ in rows]
    active = []
    for row, anchor in enumerate(anchors.tolist()):
        if on_tokens:
            on_tokens(row, [anchor])
        if not keep_until_stop([anchor], outputs[row], stops, max_new_tokens):
            active.append(row)
    history = []  # per cycle: active rows, accepted, kept, device tensors (branch, expected, prior), times, depth
    waiting = []  # plain steps' features [N, 1, F], which the next drafter pass reads after `context`
    unseen = list(layout.lengths)  # per row: context tokens the drafter's next pass reads (host-side count)
    if len(active) < len(rows):
        anchors, context, context_lens, generators, waiting = _drop_finished(
            list(range(len(rows))), active, layout, cache, proposer_cache, anchors, context, context_lens,
            generators, waiting)
        controller.select(active)
        unseen = [unseen[row] for row in active]
    while active:
        t0 = time.perf_counter()
        depth = check_depth(controller.depth(sum(unseen), sum(max_new_tokens - len(outputs[row]) for row in active)),
                            block - 1)  # drafts this cycle verifies (0: a plain step)
        uniforms = draw_uniforms(generators, block + 1 + selector_draws, device)
        if depth == 0:
            t1 = t0
            replayed = graphs and graphs.plain_step(steps, anchors, proposer_cache, uniforms, layout, cache, sampling)
            result, features = replayed or steps.plain_step(anchors, uniforms, layout, cache, sampling)
            branch = torch.full_like(anchors, -1)
            prior = torch.full((len(active), proposer.num_branches), math.nan, device=device)
        else:
            if waiting:  # one copy per drafter pass, however many plain steps came before it
                context = append_context(context, context_lens, torch.cat(waiting, dim=1))
                context_lens, waiting = context_lens + len(waiting), []
            # steps 1-4 replayed from CUDA graphs (dblast_ext.decoding.cuda_graphs) after the first cycle, which
            # validates
            replayed = graphs and history and graphs.cycle(steps, anchors, context, context_lens, proposer_cache,
                                                           uniforms, layout, cache, sampling, depth)
            if replayed:  # host times: t1 - t0 is the launch, the wait falls to the host read
                result, features, branch, prior = replayed
                t1 = time.perf_counter()
            else:
                proposal, branch, draft = steps.draft(anchors, context, context_lens, proposer_cache, uniforms)  # 1-2.
                if depth < block - 1:
                    proposal, draft = first_drafts(proposal, depth), draft[:, :depth]
                prior = proposal.prior
                t1 = time.perf_counter()
                result, features = steps.score_and_verify(anchors, draft, proposal, branch,                     # 3-4.
                                                          uniforms[:, : depth + 2], layout, cache, sampling,
                                                          validate=not history)
        accepted = result.num_accepted.long()
        # 5. the cycle's one host read: how many drafts each row accepted, the tokens, the acceptance
        read = torch.cat([accepted[:, None].double(), result.output_tokens.double(),
                          result.accept_probs.double()], dim=1).tolist()
        layout.commit(cache, accepted + 1 if layout.commits_on_device else [int(r[0]) + 1 for r in read])
        survive = torch.cumprod(result.accept_probs.double(), -1).sum(-1)
        going, kept = [], []
        for i, row in enumerate(active):
            emitted = [int(t) for t in read[i][1 : int(read[i][0]) + 2]]
            before = len(outputs[row])
            finished = keep_until_stop(emitted, outputs[row], stops, max_new_tokens)
            kept.append(len(outputs[row]) - before)
            if on_tokens:
                on_tokens(row, outputs[row][before:])
            if not finished:
                going.append(i)
        controller.observe(depth, [r[depth + 2:] for r in read])
        history.append((list(active), [int(r[0]) for r in read], kept, branch, survive, prior,
                        t1 - t0, time.perf_counter() - t1, depth))
        anchors = result.output_tokens.gather(1, accepted[:, None])[:, 0]
        if depth == 0:  # the drafter has not seen these features yet: they wait for its next pass
            waiting.append(features)
            unseen = [u + 1 for u in unseen]
        else:
            context, context_lens = features, accepted + 1
            unseen = [int(r[0]) + 1 for r in read]
        if len(going) < len(active):
            anchors, context, context_lens, generators, waiting = _drop_finished(
                active, [active[i] for i in going], layout, cache, proposer_cache, anchors, context,
                context_lens, generators, waiting)
            controller.select(going)
            unseen = [unseen[i] for i in going]
        active = [active[i] for i in going]
    cycles = _cycle_records(history, len(rows))
    return [GenerationOutput(out, bool(stops) and out[-1] in stops, cycles[row])
            for row, out in enumerate(outputs)]


def _drop_finished(active, going, layout, target_cache, proposer_cache, anchors, context, context_lens, generators,
                   waiting):
    """Keeps the rows in `going` (output indices, a subset of `active`) in every state."""
    position = {row: i for i, row in enumerate(active)}
    keep = [position[row] for row in going]
    if not keep:
        return anchors, context, context_lens, generators, waiting
    index = torch.tensor(keep, device=anchors.device)
    layout.select(target_cache, keep)
    if len(active) > 1 and not hasattr(proposer_cache, "select_rows"):
        raise TypeError(f"{type(proposer_cache).__name__} lacks select_rows: batches of prompts need it "
                        "(dblast_ext.drafting.proposer.ProposerCache)")
    if hasattr(proposer_cache, "select_rows"):
        proposer_cache.select_rows(index)
    return (anchors.index_select(0, index), context.index_select(0, index), context_lens.index_select(0, index),
            [generators[i] for i in keep], [features.index_select(0, index) for features in waiting])


def _cycle_records(history, rows: int) -> List[List[CycleRecord]]:
    """Every row's CycleRecords from the loop's history: the device-side figures of all cycles
    read in one go."""
    cycles = [[] for _ in range(rows)]
    if not history:
        return cycles
    figures = torch.cat([torch.cat([branch[:, None].double(), survive[:, None], prior.double()], dim=1)
                         for _, _, _, branch, survive, prior, _, _, _ in history]).tolist()
    at = 0
    for active, accepted, kept, _, _, _, draft_time, verify_time, depth in history:
        for i, row in enumerate(active):
            branch, survive, *prior = figures[at + i]
            n = accepted[i] if kept[i] == accepted[i] + 1 else kept[i] - 1  # a cut cycle counts what was kept
            if depth == 0:  # a plain target step: no branch, no prior
                cycles[row].append(CycleRecord(n, 0.0, -1, [], draft_time, verify_time, [], drafts=0))
            else:
                cycles[row].append(CycleRecord(n, survive, int(branch), prior, draft_time, verify_time,
                                               [int(branch)], drafts=depth))
        at += len(active)
    return cycles
