"""`SpeculativeDecoder`: speculative sampling of a Hugging Face causal LM (the target) with a
proposer (by default a DBlastDrafter, `DrafterProposer`) drafting blocks, and exact verification
in between: greedy-branch (`branch_verify`, one branch per cycle) or trie verification
(`verify="tree"`, every branch in one target pass). This module holds the decoder's settings and
entry points; the loop lives beside it:

- `chain_cycle.ChainCycle`: one cycle's device steps (propose, choose a branch, score, verify);
- `batch_loop.generate_rows`: the loop over a batch of prompts (`generate_batch`; `generate`
  is a batch of one), with its one host read per cycle; CUDA graphs replay its cycles
  (`cuda_graphs`, staged);
- `trie_loop`: the loop with trie verification (one prompt);
- `adaptive`, `learned_costs`: how many drafts each cycle verifies.

One cycle (docs/design.md, "The decode cycle"; DBLast Algorithm 1), for every row at once:
1. propose: K greedy branches of b tokens after each row's anchor, and the category prior;
2. choose a branch z ~ prior on the device (Z_T = 0: the prior's argmax);
3. one target forward on [anchor, draft] per row: logits and hidden states together;
4. verify: accepted drafts n per row, then a correction or bonus token;
5. read n and the tokens (the cycle's one host read), keep each row's anchor and accepted
   drafts in the target cache (dblast_ext.target.ragged_cache); the accepted tokens' features
   are the next cycle's new context (the proposer only ever caches committed context).
"""
import os
from typing import Callable, List, Optional, Sequence

import torch

from ..drafting.drafter import DBlastDrafter
from ..drafting.drafter_io import check_against_target
from ..drafting.draft_vocabulary import DraftVocab
from ..drafting.proposer import DrafterProposer, Proposer, check_proposer
from ..sampling import SamplingParams
from ..target.adapter import TargetAdapter
from ..target.ragged_cache import RaggedRows
from .adaptive import CONTROLLERS, AdaptiveDepth, CostTable, DepthController, FixedDepth
from .autoregressive import sample_autoregressive, sample_autoregressive_batch
from .batch_loop import generate_rows
from .chain_cycle import ChainCycle, choose_branch
from .generation import (TARGET_CACHES, CycleRecord, GenerationOutput, check_target_cache, draw_uniforms, prompt_lists,
                         prompt_tensor, stop_id_set)
from .learned_costs import LearnedCosts
from .trie_loop import TREE_EXTRA_LEAVES, TrieCycle, generate_tree

__all__ = ["SpeculativeDecoder", "SamplingParams", "GenerationOutput", "CycleRecord", "sample_autoregressive",
           "sample_autoregressive_batch", "choose_branch", "VERIFY_MODES", "TARGET_CACHES", "TREE_EXTRA_LEAVES"]

VERIFY_MODES = ("branch", "tree")


class SpeculativeDecoder:
    def __init__(self, target, drafter: Optional[DBlastDrafter] = None, *, category_temperature: float = 1.0,
                 use_kernels: bool = True, draft_vocab: DraftVocab = None, proposer: Optional[Proposer] = None,
                 verify: str = "branch", max_tree_nodes: Optional[int] = None,
                 extra_leaves: Optional[int] = None, target_cache: str = "dynamic", controller="adaptive",
                 cost_table=None, cuda_graphs: Optional[bool] = None):
        """`target`: a Hugging Face causal LM. Either `drafter` (a DBlastDrafter, drafting over
        `draft_vocab`, see dblast_ext.drafting.draft_vocabulary, at category temperature Z_T) or
        `proposer` (anything implementing dblast_ext.drafting.proposer.Proposer; its own settings then
        replace `category_temperature` and `draft_vocab`). `use_kernels`: the dblast ops
        (False: their pure-PyTorch reference, same results).
        `verify`: "branch" verifies one branch drawn from the prior (DBLast Eq 18-21); "tree"
        merges all K branches into a trie and verifies it in one target pass (dblast_ext.decoding.trie;
        `max_tree_nodes` caps the branch nodes scored per cycle, None for all: those the drafter
        expects a walk to reach most often when it ranks its tokens, else those of the most prior
        mass at category temperature Z_T), plus `extra_leaves` leaves (default TREE_EXTRA_LEAVES; 0 for none): the
        drafter's likeliest tokens that no branch drafted, from a proposer that ranks them
        (returning a `proposer.RankedProposal`; a DrafterProposer is told to). Both modes leave the output
        distribution the target's.
        `target_cache`: "dynamic" keeps the target's KV cache as long as the committed tokens and
        compacts a batch's rows after each cycle (dblast_ext.target.ragged_cache; the fastest on a CPU);
        "static" gives every verify forward the same shapes (one buffer of fixed slots, each row
        writing at its own length, a commit one addition on the device: dblast_ext.target.slot_cache),
        what graph capture needs. Same outputs; "static" with verify="branch" only.
        `controller`: how many drafts each cycle verifies (dblast_ext.decoding.adaptive). "adaptive" picks
        the depth (0 to the whole block; 0 is a plain target step) that maximises the expected
        committed tokens per second from each row's measured acceptance and `cost_table`; "off"
        verifies the whole block every cycle; or any `adaptive.DepthController`. `cost_table`: a
        `CostTable` or the path of one (`dblast calibrate --cost`), used as it is; None: learned
        from the cycles each generation runs, starting from what earlier generations of this pair,
        dtype and these settings timed (cached on disk; dblast_ext.decoding.learned_costs), with no
        measurement before the first. Neither changes the output distribution; with the same
        cost table and seeds, the output is the same token for token (learned costs vary with
        the machine's timings, and a row's tokens at T > 0 with the depths).
        `cuda_graphs`: replay the cycle's device work from CUDA graphs (dblast_ext.decoding.cuda_graphs:
        drafter pass, verify forward and verifier, captured per batch bucket and shape on first
        use). Staged: off by default until a GPU run promotes it. True needs the target on CUDA,
        target_cache="static" and a drafter (a ValueError naming the argument otherwise); None
        reads DBLAST_CUDA_GRAPHS ("1": on wherever they apply). Same outputs as without.
        Speed without changing the output: the models' dtype, the drafter's inference block
        (`drafter.config.block_size`), `draft_vocab`, `verify` and `max_tree_nodes` change only
        how fast this runs. On a CPU the fastest measured for the embedded drafters (float32
        unless the CPU has native bfloat16, block 8, the first 8,192 ids, a trie; of 10 branch
        nodes for dblast-k4) are `dblast_ext.decoding.fastest_settings.fastest_exact_settings("cpu",
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
        extra_leaves = 0 if verify != "tree" else TREE_EXTRA_LEAVES if extra_leaves is None else int(extra_leaves)
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
        # the loop's steps over this target and proposer (the CUDA-graph replay's contract), and the trie's cycle
        self.chain_cycle = ChainCycle(self.target, proposer, use_kernels)
        self.trie_cycle = TrieCycle(self.chain_cycle, max_tree_nodes, extra_leaves)
        if (self.extra_leaves or self.max_tree_nodes) and isinstance(proposer, DrafterProposer):
            # one of a branch's m may be its own draft; a node budget needs the drafts' probabilities
            proposer.top_tokens = self.extra_leaves + 1
        self._cuda_graphs, self._cycle_graphs = False, None
        self.target_cache = target_cache
        self.controller = controller
        self.cost_table = cost_table
        self.cuda_graphs = cuda_graphs

    @property
    def max_tree_nodes(self) -> Optional[int]:
        """The trie's cap on branch nodes scored per cycle (None: all); set when the decoder is made."""
        return self.trie_cycle.max_tree_nodes

    @property
    def extra_leaves(self) -> int:
        """Extra leaves per trie (0 with verify="branch"); set when the decoder is made."""
        return self.trie_cycle.extra_leaves

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
                            "(dblast_ext.decoding.adaptive.DepthController)")
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
        return self.chain_cycle.use_kernels

    @use_kernels.setter
    def use_kernels(self, value: bool) -> None:
        self.chain_cycle.use_kernels = value
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

    # the two loops under a given controller (cost_calibration times them under a scripted one)
    def _generate_batch(self, rows: List[List[int]], sampling: Optional[SamplingParams], max_new_tokens: int,
                        stop_token_ids: Optional[Sequence[int]], seeds: Optional[Sequence[int]],
                        on_tokens: Optional[Callable[[int, List[int]], None]],
                        controller: DepthController) -> List[GenerationOutput]:
        return generate_rows(self.chain_cycle, rows, sampling, max_new_tokens, stop_token_ids, seeds, on_tokens,
                             controller, target_cache=self.target_cache, graphs=self._graphs_for_generation())

    def _generate_tree(self, input_ids, sampling: Optional[SamplingParams], max_new_tokens: int,
                       stop_token_ids: Optional[Sequence[int]], seed: int,
                       on_tokens: Optional[Callable[[List[int]], None]],
                       controller: DepthController) -> GenerationOutput:
        return generate_tree(self.trie_cycle, input_ids, sampling, max_new_tokens, stop_token_ids, seed, on_tokens,
                             controller)

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
            record, _, _, _ = self.trie_cycle.run(int(ids[0, -1]), context, target_cache, proposer_cache, sampling,
                                                  torch.Generator().manual_seed(seed), validate=True)
            return record
        anchors = ids[:, -1]
        block = self.proposer.block_size
        uniforms = draw_uniforms([torch.Generator(device=ids.device).manual_seed(seed)],
                                 block + 1 + self.chain_cycle.start_selector(sampling), ids.device)
        proposal, branch, draft = self.chain_cycle.draft(anchors, context, torch.tensor([context.shape[1]], device=ids.device),
                                              proposer_cache, uniforms)
        result, _ = self.chain_cycle.score_and_verify(anchors, draft, proposal, branch, uniforms[:, : block + 1],
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
