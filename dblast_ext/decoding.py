"""The speculative decode loop: a Hugging Face causal LM as the target, a proposer (by default
a DBlastDrafter, `proposer.DrafterProposer`) drafting blocks, exact verification in between:
greedy-branch (`branch_verify`, one branch per cycle) or trie verification (`verify="tree"`,
every branch in one target pass; dblast_ext.trie).

One cycle (docs/design.md, "The decode cycle"; DBLast Algorithm 1), for every row of a batch
at once (`generate_batch`; `generate` is a batch of one):
1. propose: K greedy branches of b tokens after each row's anchor, and the category prior;
2. choose a branch z ~ prior on the device (Z_T = 0: the prior's argmax);
3. one target forward on [anchor, draft] per row: logits and hidden states together;
4. verify: accepted drafts n per row, then a correction or bonus token;
5. read n and the tokens (the cycle's one host read), keep each row's anchor and accepted
   drafts in the target cache (dblast_ext.ragged_cache); the accepted tokens' features are the
   next cycle's new context (the proposer only ever caches committed context).
Records (branch, prior, expected accepted length) stay on the device until the batch ends.
With `cuda_graphs` (staged, off by default), steps 1-4 replay from CUDA graphs after the first
cycle (dblast_ext.cuda_graphs).
With verify="tree" (one prompt at a time), steps 2-4 become: merge the K branches into a trie
(plus extra leaves: the drafter's likeliest undrafted tokens), one target forward over
[anchor, trie nodes] under a tree mask, one `sample_tokens` draw per node, the walk; step 5
keeps the committed path's cache entries.
"""
import math
import os
import time
from dataclasses import replace
from typing import Callable, List, Optional, Sequence

import torch

from . import ops, reference
from .adaptive import CONTROLLERS, AdaptiveDepth, CostTable, DepthController, FixedDepth
from .autoregressive import sample_autoregressive, sample_autoregressive_batch
from .drafter import DBlastDrafter
from .drafter_io import check_against_target
from .draft_vocabulary import DraftVocab
from .learned_costs import LearnedCosts
from .generation import (TARGET_CACHES, CycleRecord, GenerationOutput, append_context, check_target_cache, draw_uniforms,
                         keep_until_stop, prompt_lists, prompt_tensor, row_generators, stop_id_set)
from .proposer import (DrafterProposer, Proposal, Proposer, SparseProposal, check_proposal, check_proposer,
                       first_drafts, samples_its_chain)
from .ragged_cache import RaggedRows
from .results import VerifyResult
from .sampling import SamplingParams, sample_from_logits
from .target import TargetAdapter
from .trie import add_alternative_leaves, build_trie, drafted_token_probs

__all__ = ["SpeculativeDecoder", "SamplingParams", "GenerationOutput", "CycleRecord", "sample_autoregressive",
           "sample_autoregressive_batch", "choose_branch", "VERIFY_MODES", "TARGET_CACHES", "TREE_EXTRA_LEAVES"]


def choose_branch(prior: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Step 2: z ~ prior for each row ([N, K] prior, [N] uniforms -> [N] int64), by inverse
    CDF on the device. A branch of prior 0 is never chosen, rounding included."""
    cdf = prior.double().cumsum(-1)
    below = (cdf <= uniforms.to(cdf.dtype)[:, None]).sum(-1)
    branches = torch.arange(prior.shape[-1], device=prior.device)
    last_possible = torch.where(prior > 0, branches, 0).amax(-1)
    return torch.minimum(below, last_possible)


VERIFY_MODES = ("branch", "tree")
# extra leaves per trie by default, chosen on held-out training prompts (not an evaluation set) with
# the embedded dblast-k4 at T 1.0 (recipes/smollm2/extra_leaves.py): tokens per pass over the branch
# rule's +1.7% / +6.1% (math / chat) with none, +10.5% / +10.5% with 2, +21.4% / +13.8% with 4,
# +20.5% / +15.9% with 8; each leaf is one more row in the target pass
TREE_EXTRA_LEAVES = 4
# a DFlash2 drafter's trie: its greedy chain and the selector's 3 likeliest paths (beam search), four
# paths like dblast-k4's four branches, merged where they share prefixes
SELECTOR_TREE_PATHS = 3


def check_depth(depth, max_depth: int) -> int:
    """A controller's depth, refused unless an integer in 0..max_depth (the block's drafts)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= max_depth:
        raise ValueError(f"the controller chose depth {depth!r}: a cycle verifies 0..{max_depth} drafts")
    return depth


class SpeculativeDecoder:
    def __init__(self, target, drafter: Optional[DBlastDrafter] = None, *, category_temperature: float = 1.0,
                 use_kernels: bool = True, draft_vocab: DraftVocab = None, proposer: Optional[Proposer] = None,
                 verify: str = "branch", max_tree_nodes: Optional[int] = None,
                 extra_leaves: Optional[int] = None, target_cache: str = "dynamic", controller="adaptive",
                 cost_table=None, cuda_graphs: Optional[bool] = None):
        """`target`: a Hugging Face causal LM. Either `drafter` (a DBlastDrafter, drafting over
        `draft_vocab`, see dblast_ext.draft_vocabulary, at category temperature Z_T) or
        `proposer` (anything implementing dblast_ext.proposer.Proposer; its own settings then
        replace `category_temperature` and `draft_vocab`). `use_kernels`: the dblast ops
        (False: their pure-PyTorch reference, same results).
        `verify`: "branch" verifies one branch drawn from the prior (DBLast Eq 18-21); "tree"
        merges all K branches into a trie and verifies it in one target pass (dblast_ext.trie;
        `max_tree_nodes` caps the branch nodes scored per cycle, None for all: those the drafter
        expects a walk to reach most often when it ranks its tokens, else those of the most prior
        mass at category temperature Z_T), plus `extra_leaves` leaves (default TREE_EXTRA_LEAVES; 0 for none): the
        drafter's likeliest tokens that no branch drafted, from a proposer that ranks them
        (returning a `proposer.RankedProposal`; a DrafterProposer is told to). Both modes leave the output
        distribution the target's.
        `target_cache`: "dynamic" keeps the target's KV cache as long as the committed tokens and
        compacts a batch's rows after each cycle (dblast_ext.ragged_cache; the fastest on a CPU);
        "static" gives every verify forward the same shapes (one buffer of fixed slots, each row
        writing at its own length, a commit one addition on the device: dblast_ext.slot_cache),
        what graph capture needs. Same outputs; "static" with verify="branch" only.
        `controller`: how many drafts each cycle verifies (dblast_ext.adaptive). "adaptive" picks
        the depth (0 to the whole block; 0 is a plain target step) that maximises the expected
        committed tokens per second from each row's measured acceptance and `cost_table`; "off"
        verifies the whole block every cycle; or any `adaptive.DepthController`. `cost_table`: a
        `CostTable` or the path of one (`dblast calibrate --cost`), used as it is; None: learned
        from the cycles each generation runs, starting from what earlier generations of this pair,
        dtype and these settings timed (cached on disk; dblast_ext.learned_costs), with no
        measurement before the first. Neither changes the output distribution; with the same
        cost table and seeds, the output is the same token for token (learned costs vary with
        the machine's timings, and a row's tokens at T > 0 with the depths).
        `cuda_graphs`: replay the cycle's device work from CUDA graphs (dblast_ext.cuda_graphs:
        drafter pass, verify forward and verifier, captured per batch bucket and shape on first
        use). Staged: off by default until a GPU run promotes it. True needs the target on CUDA,
        target_cache="static" and a drafter (a ValueError naming the argument otherwise); None
        reads DBLAST_CUDA_GRAPHS ("1": on wherever they apply). Same outputs as without.
        Speed without changing the output: the models' dtype, the drafter's inference block
        (`drafter.config.block_size`), `draft_vocab`, `verify` and `max_tree_nodes` change only
        how fast this runs. On a CPU the fastest measured for the embedded drafters (float32
        unless the CPU has native bfloat16, block 8, the first 8,192 ids, a trie; of 10 branch
        nodes for dblast-k4) are `dblast_ext.fastest_settings.fastest_exact_settings("cpu",
        name)`, which `dblast demo` and `dblast generate` apply; here nothing is chosen for you."""
        if (drafter is None) == (proposer is None):
            raise ValueError("give either drafter or proposer (exactly one)")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if max_tree_nodes is not None and (verify != "tree" or int(max_tree_nodes) < 1):
            raise ValueError(f"max_tree_nodes must be None or >= 1, and only with verify='tree'; got "
                             f"{max_tree_nodes!r} with verify={verify!r}")
        if extra_leaves is not None and (int(extra_leaves) < 0 or (verify != "tree" and int(extra_leaves) != 0)):
            raise ValueError(f"extra_leaves must be None or >= 0, and > 0 only with verify='tree'; got "
                             f"{extra_leaves!r} with verify={verify!r}")
        self.verify = verify
        self.max_tree_nodes = max_tree_nodes
        self.extra_leaves = 0 if verify != "tree" else TREE_EXTRA_LEAVES if extra_leaves is None else int(extra_leaves)
        self._use_kernels = use_kernels
        if drafter is not None:
            check_against_target(drafter.config, target.config)
            self.target = TargetAdapter(target, drafter.config.target_layer_ids)
            proposer = DrafterProposer(drafter, self.target, category_temperature=category_temperature,
                                       draft_vocab=draft_vocab, use_kernels=use_kernels)
        else:
            if category_temperature != 1.0 or draft_vocab is not None:
                raise ValueError("category_temperature and draft_vocab are a drafter's settings: with proposer=, "
                                 "set them on the proposer")
            check_proposer(proposer, target.config.num_hidden_layers)
            self.target = TargetAdapter(target, proposer.target_layer_ids)
        self.proposer = proposer
        if (self.extra_leaves or self.max_tree_nodes) and isinstance(proposer, DrafterProposer):
            # one of a branch's m may be its own draft; a node budget needs the drafts' probabilities
            proposer.top_tokens = self.extra_leaves + 1
        self._cuda_graphs, self._cycle_graphs = False, None
        self.target_cache = target_cache
        self.controller = controller
        self.cost_table = cost_table
        self.cuda_graphs = cuda_graphs

    @property
    def cuda_graphs(self) -> bool:
        """Whether cycles replay from CUDA graphs (see __init__); checked whenever it is set."""
        return self._cuda_graphs is True or (self._cuda_graphs is None and self._cycle_graphs is not None)

    @cuda_graphs.setter
    def cuda_graphs(self, value: Optional[bool]) -> None:
        from .cuda_graphs import CycleGraphs, check_switch

        on = check_switch(value, self.target.device, self.target_cache, self.proposer)
        self._cuda_graphs = value
        if not on:
            self._cycle_graphs = None
        elif self._cycle_graphs is None:
            self._cycle_graphs = CycleGraphs()

    def reset_cuda_graphs(self) -> None:
        """Frees the captured cycles and their buffers (after moving or replacing weights)."""
        if self._cycle_graphs is not None:
            self._cycle_graphs.reset()

    def _graphs_for_generation(self):
        """The CycleGraphs this generation replays from (None: eager), the switch checked again
        against where the target is now."""
        if self._cuda_graphs is False:
            return None
        from .cuda_graphs import CycleGraphs, check_switch

        if not check_switch(self._cuda_graphs, self.target.device, self.target_cache, self.proposer):
            return None
        if self._cycle_graphs is None:  # DBLAST_CUDA_GRAPHS set after the decoder was made
            self._cycle_graphs = CycleGraphs()
        return self._cycle_graphs

    @property
    def controller(self):
        """"adaptive", "off" or a DepthController (see __init__); checked whenever it is set."""
        return self._controller

    @controller.setter
    def controller(self, value) -> None:
        if isinstance(value, str) and value not in CONTROLLERS:
            raise ValueError(f"controller must be one of {', '.join(CONTROLLERS)} or a DepthController, got {value!r}")
        if not isinstance(value, str) and not all(hasattr(value, m) for m in ("start", "depth", "observe", "select")):
            raise TypeError(f"controller {type(value).__name__} lacks start, depth, observe or select "
                            "(dblast_ext.adaptive.DepthController)")
        self._controller = value

    @property
    def cost_table(self) -> Optional[CostTable]:
        """The adaptive controller's cost table as given (None: measured and cached per key)."""
        return self._cost_table

    @cost_table.setter
    def cost_table(self, value) -> None:
        if isinstance(value, str):
            if not os.path.isfile(value):
                raise FileNotFoundError(f"cost_table {value}: no such file (`dblast calibrate --cost` writes one)")
            value = CostTable.load(value)
        if value is not None and not isinstance(value, CostTable):
            raise TypeError(f"cost_table must be a CostTable, the path of one, or None; got {type(value).__name__}")
        self._cost_table = value

    @property
    def target_cache(self) -> str:
        """"dynamic" or "static" (see __init__); checked whenever it is set."""
        return self._target_cache

    @target_cache.setter
    def target_cache(self, value: str) -> None:
        check_target_cache(value)
        if value != "static" and getattr(self, "_cuda_graphs", False) is True:
            raise ValueError(f"cuda_graphs=True needs target_cache='static' (fixed shapes); got target_cache={value!r}")
        if value == "static":
            if self.verify != "branch":
                raise ValueError("target_cache='static' verifies one branch per cycle (verify='branch'); the "
                                 f"trie's rows differ in number every cycle; got verify={self.verify!r}")
            # the static cache's 4D additive mask is what SDPA and eager attention take as given
            attention = getattr(self.target.model.config, "_attn_implementation", None) or "eager"
            if attention not in ("sdpa", "eager"):
                raise ValueError(f"target_cache='static' needs the target's attention to be 'sdpa' or 'eager' (it "
                                 f"passes a 4D additive mask); this target uses {attention!r}")
        self._target_cache = value

    @property
    def use_kernels(self) -> bool:
        """The dblast ops (False: their pure-PyTorch reference), for drafting and verifying alike."""
        return self._use_kernels

    @use_kernels.setter
    def use_kernels(self, value: bool) -> None:
        self._use_kernels = value
        if isinstance(self.proposer, DrafterProposer):
            self.proposer.use_kernels = value

    # the drafter-specific settings, for callers that built the decoder from a drafter
    @property
    def drafter(self) -> DBlastDrafter:
        return self.proposer.drafter

    @property
    def draft_ids(self) -> Optional[torch.Tensor]:
        return getattr(self.proposer, "draft_ids", None)

    @property
    def category_temperature(self) -> float:
        return self.proposer.category_temperature

    @category_temperature.setter
    def category_temperature(self, value: float) -> None:
        self.proposer.category_temperature = value

    @torch.inference_mode()
    def generate(self, input_ids, sampling: Optional[SamplingParams] = None, max_new_tokens: int = 256,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                 on_tokens: Optional[Callable[[List[int]], None]] = None) -> GenerationOutput:
        """Speculative sampling of one prompt; `on_tokens(new_ids)` is called with the tokens each
        cycle commits (for streaming), in order, ending with the last token returned."""
        if self.verify == "tree":
            prompt_tensor(input_ids, max_new_tokens, "cpu", self.target.vocab_size)  # before the controller starts
            stop_id_set(stop_token_ids, self.target.vocab_size)
            controller = self._start_controller(1, tree=True)
            try:
                return self._generate_tree(input_ids, sampling, max_new_tokens, stop_token_ids, seed, on_tokens,
                                           controller)
            finally:
                self._save_learned(controller)
        prompt_tensor(input_ids, max_new_tokens, "cpu", self.target.vocab_size)  # the single-prompt checks
        stream = (lambda row, ids: on_tokens(ids)) if on_tokens else None
        return self.generate_batch([torch.as_tensor(input_ids).view(-1).tolist()], sampling, max_new_tokens,
                                   stop_token_ids, seeds=[seed], on_tokens=stream)[0]

    @torch.inference_mode()
    def generate_batch(self, prompts, sampling: Optional[SamplingParams] = None, max_new_tokens: int = 256,
                       stop_token_ids: Optional[Sequence[int]] = None, seeds: Optional[Sequence[int]] = None,
                       on_tokens: Optional[Callable[[int, List[int]], None]] = None) -> List[GenerationOutput]:
        """Speculative sampling of many prompts at once (greedy-branch verification), one output
        per prompt. Rows accept different numbers of drafts each cycle and finish at different
        times (they then drop out); row r draws from its own generator seeded by seeds[r]
        (default r). With `controller="off"` its output is the one `generate(prompts[r],
        seed=seeds[r])` gives, up to floating-point rounding in batched matrix products; with the
        adaptive controller the depth of each cycle is the batch's, so at a temperature above 0 a
        row's tokens depend on the batch too (its distribution never does). `on_tokens(row,
        new_ids)` streams. One host read per cycle: the accepted counts, tokens and acceptance."""
        if self.verify != "branch":
            raise ValueError("generate_batch verifies one branch per row (verify='branch'); trie verification "
                             "takes one prompt at a time: use generate")
        rows = prompt_lists(prompts, max_new_tokens, self.target.vocab_size)
        stop_id_set(stop_token_ids, self.target.vocab_size)  # before the controller's calibration
        controller = self._start_controller(len(rows), tree=False)
        try:
            return self._generate_batch(rows, sampling, max_new_tokens, stop_token_ids, seeds, on_tokens, controller)
        finally:
            self._save_learned(controller)

    def _generate_batch(self, rows: List[List[int]], sampling: Optional[SamplingParams], max_new_tokens: int,
                        stop_token_ids: Optional[Sequence[int]], seeds: Optional[Sequence[int]],
                        on_tokens: Optional[Callable[[int, List[int]], None]],
                        controller: DepthController) -> List[GenerationOutput]:
        """generate_batch's loop, each cycle verifying the number of drafts `controller` picks."""
        sampling = sampling or SamplingParams()
        stops = stop_id_set(stop_token_ids, self.target.vocab_size)
        device = self.target.device
        generators = row_generators(seeds, len(rows), device)
        block = self.proposer.block_size
        graphs = self._graphs_for_generation()  # None: every step eager
        selector_draws = self._start_selector(sampling)

        layout = RaggedRows.left_padded([len(p) for p in rows])
        ids, mask, positions = layout.prefill_inputs(rows, device)
        target_cache = self.target.new_cache()
        logits, features = self.target.forward(ids, target_cache, last_logits_only=True, attention_mask=mask,
                                               position_ids=positions)
        anchors = self._sample(logits[:, -1], draw_uniforms(generators, 1, device)[:, 0], None, sampling,
                               validate=False).tokens
        context = layout.left_align(features)
        context_lens = torch.tensor(layout.lengths, device=device)
        proposer_cache = self.proposer.new_cache(len(rows), layout.end + max_new_tokens + 2 * block, device)
        # fixed shapes from here on; an active row holds at most prompt + max_new_tokens - 2 tokens before
        # its block, so this capacity always has room for the last one
        if self.target_cache == "static":
            from .slot_cache import SlotRows

            layout, target_cache = SlotRows.from_prefill(target_cache, layout, layout.end + max_new_tokens + block)

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
            anchors, context, context_lens, generators, waiting = self._drop_finished(
                list(range(len(rows))), active, layout, target_cache, proposer_cache, anchors, context, context_lens,
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
                replayed = graphs and graphs.plain_step(self, anchors, proposer_cache, uniforms, layout, target_cache,
                                                        sampling)
                result, features = replayed or self._plain_step(anchors, uniforms, layout, target_cache, sampling)
                branch = torch.full_like(anchors, -1)
                prior = torch.full((len(active), self.proposer.num_branches), math.nan, device=device)
            else:
                if waiting:  # one copy per drafter pass, however many plain steps came before it
                    context = append_context(context, context_lens, torch.cat(waiting, dim=1))
                    context_lens, waiting = context_lens + len(waiting), []
                # steps 1-4 replayed from CUDA graphs (dblast_ext.cuda_graphs) after the first cycle, which validates
                replayed = graphs and history and graphs.cycle(self, anchors, context, context_lens, proposer_cache,
                                                               uniforms, layout, target_cache, sampling, depth)
                if replayed:  # host times: t1 - t0 is the launch, the wait falls to the host read
                    result, features, branch, prior = replayed
                    t1 = time.perf_counter()
                else:
                    proposal, branch, draft = self._draft(anchors, context, context_lens, proposer_cache,  # 1-2.
                                                          uniforms)
                    if depth < block - 1:
                        proposal, draft = first_drafts(proposal, depth), draft[:, :depth]
                    prior = proposal.prior
                    t1 = time.perf_counter()
                    result, features = self._score_and_verify(anchors, draft, proposal, branch,         # 3-4.
                                                              uniforms[:, : depth + 2], layout, target_cache, sampling,
                                                              validate=not history)
            accepted = result.num_accepted.long()
            # 5. the cycle's one host read: how many drafts each row accepted, the tokens, the acceptance
            read = torch.cat([accepted[:, None].double(), result.output_tokens.double(),
                              result.accept_probs.double()], dim=1).tolist()
            layout.commit(target_cache, accepted + 1 if layout.commits_on_device else [int(r[0]) + 1 for r in read])
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
                anchors, context, context_lens, generators, waiting = self._drop_finished(
                    active, [active[i] for i in going], layout, target_cache, proposer_cache, anchors, context,
                    context_lens, generators, waiting)
                controller.select(going)
                unseen = [unseen[i] for i in going]
            active = [active[i] for i in going]
        cycles = self._cycle_records(history, len(rows))
        return [GenerationOutput(out, bool(stops) and out[-1] in stops, cycles[row])
                for row, out in enumerate(outputs)]

    def _plain_step(self, anchors, uniforms, layout, target_cache, sampling):
        """A cycle of depth 0: one target forward on each row's anchor, its next token drawn with
        uniforms[:, 1] (`sample_tokens`, the target's filter): (a verification result of no
        drafts, the anchor's features)."""
        mask, positions = layout.block_inputs(1, anchors.device)
        logits, features = self.target.forward(anchors[:, None], target_cache, attention_mask=mask,
                                               position_ids=positions)
        tokens = self._sample(logits[:, 0], uniforms[:, 1], None, sampling, validate=False).tokens
        rows = anchors.shape[0]
        return VerifyResult(torch.zeros(rows, dtype=torch.int32, device=anchors.device), tokens[:, None],
                            torch.zeros(rows, 0, device=anchors.device)), features

    # the controller of one generation: its depth choices and, when adaptive, the cost table
    def _start_controller(self, rows: int, tree: bool) -> DepthController:
        max_depth = self.proposer.block_size - 1
        if not isinstance(self.controller, str):
            costs = self._costs(rows, tree) if getattr(self.controller, "needs_costs", False) else (None, 0.0)
            self.controller.start(rows, max_depth, *costs)
            return self.controller
        if self.controller == "off":
            controller = FixedDepth()
            controller.start(rows, max_depth)
            return controller
        controller = AdaptiveDepth()
        controller.start(rows, max_depth, *self._costs(rows, tree))
        return controller

    def _costs(self, rows: int, tree: bool):
        """(the cost curve, the catch-up cost) of a generation of `rows` prompts. A `cost_table`
        given to the decoder that holds them: C(d) for d = 0..D and seconds per unseen context
        token (trie), or functions of the number of rows (a batch, whose rows finish one by one),
        used as they are. Otherwise a `LearnedCosts` over the cached table of the decoder's key
        (`cost_calibration.cost_key`), which the controller refines from the cycles it times;
        nothing is measured before the generation starts."""
        from .cost_calibration import cached_table

        table, path = self.cost_table, None
        if table is not None and (table.tree is not None if tree else bool(table.chain)):
            return (list(table.tree), table.tree_catch_up or 0.0) if tree else (table.chain_costs, table.catch_up)
        if table is None:
            table, path = cached_table(self)
        return LearnedCosts(table, tree, self.proposer.block_size - 1, path), 0.0

    @staticmethod
    def _save_learned(controller) -> None:
        """Writes the costs a controller timed into their cache (the next generation starts from them)."""
        learner = getattr(controller, "learner", None)
        if learner is not None:
            learner.save()

    # The cycle's device-side steps, between the uniforms' draw and the host read. With the static
    # target cache and validate=False they trace as one graph (torch.compile fullgraph: no graph
    # break, no host sync; tested); dblast_ext.cuda_graphs captures _draft, _score and _verify.
    def _start_selector(self, sampling: SamplingParams, tree: bool = False) -> int:
        """A DFlash2 drafter samples its chain at T > 0 (verified by sparse_verify) when one branch
        is verified, and walks it greedily otherwise; for a trie it proposes its greedy chain and
        its SELECTOR_TREE_PATHS best paths. Returns the uniforms per row a cycle adds for the
        sampled chain (b, else 0): columns block + 1 onwards, drawn with the cycle's others from
        the row's generator."""
        if not samples_its_chain(self.proposer):
            return 0
        sampled = sampling.temperature > 0 and not tree
        self.proposer.selector_temperature = sampling.temperature if sampled else 0.0
        self.proposer.selector_paths = SELECTOR_TREE_PATHS if tree else 0
        return self.proposer.block_size - 1 if sampled else 0

    def _draft(self, anchors, context, context_lens, proposer_cache, uniforms):
        """1. propose a block after each row's anchor, 2. choose a branch (`_choose`):
        (proposal, branch [N], draft [N, b - 1])."""
        if samples_its_chain(self.proposer):  # the sampled chain's draws, or none for the greedy walk
            block = self.proposer.block_size
            self.proposer.selector_uniforms = uniforms[:, block + 1:] if uniforms.shape[1] > block + 1 else None
        proposal = self.proposer.propose(anchors, context, proposer_cache, context_lens)
        return (proposal, *self._choose(proposal, uniforms))

    @staticmethod
    def _choose(proposal: Proposal, uniforms: torch.Tensor):
        """2. a branch z ~ prior with uniforms[:, 0], and its drafts: (branch [N], draft [N, b - 1])."""
        branch = choose_branch(proposal.prior, uniforms[:, 0])
        drafts = proposal.branch_tokens.shape[-1]
        return branch, proposal.branch_tokens.gather(1, branch[:, None, None].expand(-1, 1, drafts))[:, 0]

    def _score_and_verify(self, anchors, draft, proposal, branch, uniforms, layout, target_cache, sampling,
                          validate: bool):
        """3. one target forward on [anchor, draft] per row, appended to the target cache as
        `layout` says, 4. branch_verify with uniforms[:, 1:]: (verification result, the block's
        features)."""
        logits, features = self._score(anchors, draft, layout, target_cache)
        return self._verify(logits, proposal, branch, uniforms[:, 1:], sampling, validate=validate), features

    def _score(self, anchors, draft, layout, target_cache):
        """3. one target forward on [anchor, draft] per row, appended to the target cache as
        `layout` says: (logits [N, b + 1, V], features)."""
        mask, positions = layout.block_inputs(draft.shape[1] + 1, anchors.device)
        return self.target.forward(torch.cat([anchors[:, None], draft], dim=1), target_cache, attention_mask=mask,
                                   position_ids=positions)

    def _drop_finished(self, active, going, layout, target_cache, proposer_cache, anchors, context, context_lens,
                       generators, waiting):
        """Keeps the rows in `going` (output indices, a subset of `active`) in every state."""
        position = {row: i for i, row in enumerate(active)}
        keep = [position[row] for row in going]
        if not keep:
            return anchors, context, context_lens, generators, waiting
        index = torch.tensor(keep, device=anchors.device)
        layout.select(target_cache, keep)
        if len(active) > 1 and not hasattr(proposer_cache, "select_rows"):
            raise TypeError(f"{type(proposer_cache).__name__} lacks select_rows: batches of prompts need it "
                            "(dblast_ext.proposer.ProposerCache)")
        if hasattr(proposer_cache, "select_rows"):
            proposer_cache.select_rows(index)
        return (anchors.index_select(0, index), context.index_select(0, index), context_lens.index_select(0, index),
                [generators[i] for i in keep], [features.index_select(0, index) for features in waiting])

    @staticmethod
    def _cycle_records(history, rows: int) -> List[List[CycleRecord]]:
        """Every row's CycleRecords from the loop's history: the device-side figures of all
        cycles read in one go."""
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

    def _generate_tree(self, input_ids, sampling: Optional[SamplingParams], max_new_tokens: int,
                       stop_token_ids: Optional[Sequence[int]], seed: int,
                       on_tokens: Optional[Callable[[List[int]], None]],
                       controller: Optional[DepthController] = None) -> GenerationOutput:
        """`generate` with trie verification: one prompt, one `_tree_cycle` per cycle, each
        capped at the depth `controller` picks (0: a plain target step)."""
        sampling = sampling or SamplingParams()
        ids = prompt_tensor(input_ids, max_new_tokens, self.target.device, self.target.vocab_size)
        stops = stop_id_set(stop_token_ids, self.target.vocab_size)
        controller = controller or self._start_controller(1, tree=True)
        generator = torch.Generator().manual_seed(seed)
        self._start_selector(sampling, tree=True)  # the trie verifies the selector's greedy chain

        target_cache = self.target.new_cache()
        logits, context = self.target.forward(ids, target_cache, last_logits_only=True)
        anchor = sample_from_logits(logits[0, -1], sampling, generator)
        generated = [anchor]
        if on_tokens:
            on_tokens([anchor])
        proposer_cache = self.proposer.new_cache(1, ids.shape[1] + max_new_tokens + self.proposer.block_size,
                                                 ids.device)
        cycles, waiting = [], []  # waiting: plain steps' features, which the next drafter pass reads after `context`
        unseen = ids.shape[1]  # context tokens the drafter's next pass reads
        while len(generated) < max_new_tokens and anchor not in stops:
            depth = check_depth(controller.depth(unseen, max_new_tokens - len(generated)),
                                self.proposer.block_size - 1)
            if depth and waiting:
                context, waiting = torch.cat([context] + waiting, dim=1), []
            record, emitted, features, acceptance = self._tree_cycle(
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

    def _tree_cycle(self, anchor: int, context: torch.Tensor, target_cache, proposer_cache,
                    sampling: SamplingParams, generator: torch.Generator, validate: bool, depth: Optional[int] = None):
        """_cycle with trie verification (dblast_ext.trie): every branch scored in one pass, the
        trie cut at `depth` drafts (None: the whole block; 0: a plain target step). Returns (the
        cycle's record, the committed tokens, their features, the conditional acceptance at each
        depth of the trie: the controller's observation)."""
        device = context.device
        t0 = time.perf_counter()
        anchors = torch.tensor([anchor], dtype=torch.int64, device=device)
        if depth == 0:
            logits, features = self.target.forward(anchors[None], target_cache)
            token = sample_from_logits(logits[0, -1], sampling, generator)
            record = CycleRecord(0, 0.0, -1, [], 0.0, time.perf_counter() - t0, [], drafts=0)
            return record, [token], features, []
        proposal = self.proposer.propose(anchors, context, proposer_cache)            # 1. propose
        if validate or not isinstance(self.proposer, DrafterProposer):
            check_proposal(proposal, self.target.vocab_size)
        depth = self.proposer.block_size - 1 if depth is None else depth
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

        start = self.target.cache_length(target_cache)                                  # 3. score every node
        mask = trie.attention_mask(start, self.target.dtype, device)
        logits, features = self.target.forward_tree(torch.tensor([trie.tokens], device=device), target_cache,
                                                    trie.positions(start, device), mask)
        uniforms = torch.rand(self.proposer.block_size, generator=generator, dtype=torch.float64)
        drawn = self._sample(logits[0], uniforms[trie.depths].to(device), trie.child_tokens(device), sampling,
                             validate)                                                  # 4. draw and walk
        walk = trie.walk(drawn.tokens.tolist(), drawn.query_probs.tolist())
        self.target.keep_rows(target_cache, start, walk.rows)                           # 5. keep the path
        accepted = len(walk.tokens) - 1
        record = CycleRecord(accepted, walk.expected_accepted, walk.branches[0], prior, t1 - t0,
                             time.perf_counter() - t1, walk.branches, trie.num_nodes, walk.branch_rule_expected,
                             drafts=depth)
        reach = [1.0] + walk.depth_reach
        acceptance = [reach[i + 1] / reach[i] if reach[i] > 0 else math.nan for i in range(len(walk.depth_reach))]
        return record, walk.tokens, features[:, walk.rows], acceptance

    def _sample(self, logits: torch.Tensor, uniforms: torch.Tensor, query_tokens: torch.Tensor,
                sampling: SamplingParams, validate: bool):
        """sample_tokens over the trie's rows (validated like _verify's inputs)."""
        if self.use_kernels:
            return ops.sample_tokens(logits, uniforms, query_tokens=query_tokens, validate=validate,
                                     **sampling.kwargs())
        return reference.sample_tokens(logits, uniforms, query_tokens=query_tokens, **sampling.kwargs())

    def _verify(self, logits: torch.Tensor, proposal: Proposal, branch: torch.Tensor, uniforms: torch.Tensor,
                sampling: SamplingParams, validate: bool):
        """branch_verify, its value checks (finite logits, ids below the vocabulary, a prior
        summing to 1, uniforms in [0, 1): reductions over [b + 1, V] and a device sync) run on
        the first cycle of a response and then only for proposers other than DrafterProposer:
        the loop draws the uniforms itself, SamplingParams is checked when made, and a
        DrafterProposer's ids come from an argmax over the vocabulary and its prior from a
        softmax."""
        validate = validate or not isinstance(self.proposer, DrafterProposer)
        if isinstance(proposal, SparseProposal):  # a sampled chain and the candidates it was drawn from
            verify = ops.sparse_verify if self.use_kernels else reference.sparse_verify
            return verify(logits, proposal.branch_tokens[:, 0], proposal.proposal_tokens, proposal.proposal_probs,
                          uniforms, validate=validate, **sampling.kwargs())
        if self.use_kernels:
            return ops.branch_verify(logits, proposal.branch_tokens, proposal.prior, branch, uniforms,
                                     validate=validate, **sampling.kwargs())
        return reference.branch_verify(logits, proposal.branch_tokens, proposal.prior, branch, uniforms,
                                       **sampling.kwargs())

    @torch.inference_mode()
    def first_cycle(self, prefix_ids, sampling: Optional[SamplingParams] = None, seed: int = 0) -> CycleRecord:
        """One drafting + verification cycle right after `prefix_ids`, whose last token is the
        anchor (as if the prefix had just been committed): acceptance at a chosen point of a
        response, for diagnostics."""
        sampling = sampling or SamplingParams()
        ids = prompt_tensor(prefix_ids, 1, self.target.device, self.target.vocab_size)
        if ids.shape[1] < 2:
            raise ValueError("prefix_ids needs at least two tokens: context and the anchor")
        target_cache = self.target.new_cache()
        _, context = self.target.forward(ids[:, :-1], target_cache, last_logits_only=True)
        proposer_cache = self.proposer.new_cache(1, ids.shape[1] + self.proposer.block_size, ids.device)
        if self.verify == "tree":
            record, _, _, _ = self._tree_cycle(int(ids[0, -1]), context, target_cache, proposer_cache, sampling,
                                            torch.Generator().manual_seed(seed), validate=True)
            return record
        anchors = ids[:, -1]
        block = self.proposer.block_size
        uniforms = draw_uniforms([torch.Generator(device=ids.device).manual_seed(seed)],
                                 block + 1 + self._start_selector(sampling), ids.device)
        proposal, branch, draft = self._draft(anchors, context, torch.tensor([context.shape[1]], device=ids.device),
                                              proposer_cache, uniforms)
        result, _ = self._score_and_verify(anchors, draft, proposal, branch, uniforms[:, : block + 1],
                                           RaggedRows.left_padded([context.shape[1]]), target_cache, sampling,
                                           validate=True)
        survive = float(torch.cumprod(result.accept_probs[0].double(), 0).sum())
        return CycleRecord(int(result.num_accepted[0]), survive, int(branch[0]), proposal.prior[0].tolist(), 0.0, 0.0,
                           [int(branch[0])], drafts=int(draft.shape[1]))

    def prepare(self, rows: int = 1) -> None:
        """Measures the adaptive controller's whole cost table for generations of up to `rows`
        prompts (and for trie verification) now, if the cached table lacks it: every depth at
        batch sizes 1, 2, 4, ... (seconds to minutes; `dblast calibrate --cost` does the same).
        Not needed: without it the controller learns the costs from the cycles it runs. For
        benchmarks that compare against a fully measured table; nothing to do for other controllers."""
        if self.controller == "adaptive" or getattr(self.controller, "needs_costs", False):
            from .cost_calibration import ensure_costs

            ensure_costs(self, rows, tree=self.verify == "tree")

    def warm_up(self, input_ids, sampling: Optional[SamplingParams] = None, *, target_only: bool = True,
                stop_token_ids: Optional[Sequence[int]] = None) -> None:
        """A few tokens of speculative sampling (and of the target alone, with `target_only`) so
        one-time costs (allocations, kernel selection) stay out of the timings that follow."""
        self.generate(input_ids, sampling, max_new_tokens=8, stop_token_ids=stop_token_ids)
        if target_only:
            self.generate_autoregressive(input_ids, sampling, max_new_tokens=8, stop_token_ids=stop_token_ids)

    def generate_autoregressive(self, input_ids, sampling: Optional[SamplingParams] = None,
                                max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None,
                                seed: int = 0, on_tokens: Optional[Callable[[List[int]], None]] = None
                                ) -> GenerationOutput:
        """The target alone, with the same filter (`sample_autoregressive`): the speed-up baseline."""
        return sample_autoregressive(self.target, input_ids, sampling, max_new_tokens, stop_token_ids, seed,
                                     on_tokens)

    def generate_autoregressive_batch(self, prompts, sampling: Optional[SamplingParams] = None,
                                      max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None,
                                      seeds: Optional[Sequence[int]] = None) -> List[GenerationOutput]:
        """The target alone over a batch, batched as `generate_batch` is (the same target cache):
        its speed-up baseline."""
        return sample_autoregressive_batch(self.target, prompts, sampling, max_new_tokens, stop_token_ids, seeds,
                                           use_kernels=self.use_kernels, target_cache=self.target_cache)
