"""The decode cycle replayed from CUDA graphs (`SpeculativeDecoder(..., cuda_graphs=True)`).
Staged: written ahead of a GPU run, off by default until one shows it exact and faster.

What is captured. A cycle with the static target cache (dblast_ext.target.slot_cache) has the same
shapes every time, so its device work is captured once per shape and replayed after, in three
graphs launched back to back (parts, each replaying the eager loop's own steps: the
`chain_cycle.ChainCycle` the loop hands over is all the replay uses of the decoder):
  1. "draft": the drafter pass (`ChainCycle.draft`: propose, then the branch choice) and the cut
     to the cycle's depth;
  2. "score": the target forward on [anchor, draft] over the slot cache (`ChainCycle.score`: its
     4D mask and positions are computed inside, from the row lengths);
  3. "verify": `branch_verify` without value checks (`ChainCycle.verify(validate=False)`).
A plain target step (depth 0, the adaptive controller's) is one more part, "plain"
(`ChainCycle.plain_step`). Three graphs rather than one cost two more launches per cycle (microseconds)
and give the bench each part's time between them; and a part that cannot be captured runs
eagerly between the others on the same fixed buffers ("otherwise graphs around the drafter
pass and the verifier"). A part whose capture fails (a host read inside it, say) stays eager
(`CycleGraphs.eager_parts` says why). The CUDA `drafter_attention` op checks `context_lens`
with a host read in eager calls only, not while its stream captures, so the warm-up runs
without torch's sync debug mode.

What is not captured, and why. The prefill and the first cycle (their shapes are the prompts';
the first cycle also validates the proposal), the uniforms' draw, the host read of the accepted
counts and tokens, the commit (`SlotRows.commit`, one addition), rows dropping out, and
everything on the host (the controller, stop tokens, streaming). Nor trie verification or the
compacting cache, whose shapes change every cycle (cuda_graphs=True refuses them).

Randomness. No random number is drawn inside a graph: the loop draws each cycle's uniforms
eagerly from each row's own generator, in the same order as without graphs, and they are
copied into the graphs' input buffer. The graphs make the eager cycle's decisions from the same
uniforms, so a seed gives the same tokens with graphs on or off (up to rounding in batched
matrix products, as for any batch: see below).

Buffers. A graph reads and writes fixed addresses, so the caches live in buffers owned here:
one `_State` per (batch bucket, target cache slots, drafter cache slots, model), shared by all
of its graphs (one per context length and depth, captured on first use, at most `max_graphs`;
further shapes run eagerly) and kept across generations (at most `max_states`, least recently
used dropped), so repeated generations of the same shapes replay without capturing again. The
loop's caches are adopted: their tensors are copied into the state's first rows and replaced
by views of them, so eager steps (the first cycle, a cycle of another shape) write the same
buffers; when rows drop out the loop's caches are new tensors again and the next replay copies
them in. Graph outputs are copied out before the loop keeps them.

Batch buckets. N active rows run in the smallest bucket of `BATCH_BUCKETS` holding them
(`bucket_for`); rows N.. of the bucket are padding: they read fixed inputs (anchor 0, no new
context, length `PAD_LENGTH`, uniforms 0.5), write only their own rows of the buffers, inside
the capacity, and their outputs are dropped. Rows are independent in every op, so a row's tokens
never depend on the padding; as with any batch, batched matrix products may round a row
differently at another batch size. When enough rows finish, the batch moves to a smaller
bucket's state (one copy of its caches). More rows than the largest bucket run eagerly.

The switch. `SpeculativeDecoder(cuda_graphs=True)` (or setting `decoder.cuda_graphs`) asks for
graphs and refuses, with a ValueError naming the argument, a decoder that cannot have them: a
target not on CUDA (checked when set and when each generation starts), target_cache other than
"static", a proposer other than a DrafterProposer, or a DFlash2 drafter (its selector may sample
inside the pass, and a graph would replay the same draws). `cuda_graphs=None` (the default) reads
the environment variable DBLAST_CUDA_GRAPHS: "1" turns graphs on wherever they apply and
leaves other decoders eager, unset or "0" leaves them off. Graphs bake in the weights'
addresses: a model moved or reloaded is noticed by its parameters' addresses and gets new
graphs; `SpeculativeDecoder.reset_cuda_graphs()` frees them all.
"""
import os
from collections import Counter, OrderedDict
from typing import Dict, Optional, Tuple

import torch

from ..drafting.proposer import DrafterProposer, Proposal
from ..results import VerifyResult
from .chain_cycle import ChainCycle

__all__ = ["CycleGraphs", "BATCH_BUCKETS", "PAD_LENGTH", "ENV_VAR", "bucket_for", "env_switch", "check_switch",
           "graphs_apply"]

ENV_VAR = "DBLAST_CUDA_GRAPHS"
# captured batch sizes: powers of two, then steps of a half, as far as one generate_batch call goes in practice
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PAD_LENGTH = 1  # a padding row's committed length: its queries see slot 0 (finite) and its own block
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


def bucket_for(rows: int, buckets=BATCH_BUCKETS) -> Optional[int]:
    """The smallest bucket holding `rows` active rows; None when none does (run eagerly)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    return next((b for b in sorted(buckets) if b >= rows), None)


def env_switch() -> bool:
    """DBLAST_CUDA_GRAPHS as a switch: "1" / "true" / "on" / "yes" on, unset / "" / "0" /
    "false" / "off" / "no" off; anything else is an error naming the variable."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR} must be 1 or 0 (true/false, on/off), got {os.environ[ENV_VAR]!r}")


def graphs_apply(device, target_cache: str, proposer) -> Optional[str]:
    """Why a decoder cannot replay its cycle from CUDA graphs (None: it can)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return f"needs the target on a CUDA device; it is on {torch.device(device)}"
    if target_cache != "static":
        return f"needs target_cache='static' (fixed shapes); got target_cache={target_cache!r}"
    if type(proposer) is not DrafterProposer:
        return f"captures a DrafterProposer's pass; got proposer {type(proposer).__name__}"
    if hasattr(proposer.drafter, "candidate_selector"):  # its chain may be sampled inside the pass
        return "does not capture DFlash2 drafters (the selector may draw random numbers inside the pass)"
    return None


def check_switch(value, device, target_cache: str, proposer) -> bool:
    """`cuda_graphs` as given to SpeculativeDecoder -> whether graphs are on. True is strict (a
    ValueError naming the argument where they cannot apply); None defers to DBLAST_CUDA_GRAPHS,
    which turns them on only where they apply."""
    if value is None:
        return env_switch() and graphs_apply(device, target_cache, proposer) is None
    if not isinstance(value, bool):
        raise ValueError(f"cuda_graphs must be True, False or None (DBLAST_CUDA_GRAPHS), got {value!r}")
    if value:
        why = graphs_apply(device, target_cache, proposer)
        if why is not None:
            raise ValueError(f"cuda_graphs=True {why}")
    return value


def _warm_up(fn) -> None:
    """Runs fn once on a side stream, as capture asks. Not under torch's sync debug mode: an
    eager call may read the host where a capturing one does not (the CUDA drafter_attention
    checks context_lens except while its stream captures); a capture that does read the host
    fails, and the part then stays eager."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()
    finally:
        torch.cuda.current_stream().wait_stream(stream)


class _Part:
    """One captured piece of a cycle: `fn` reads fixed buffers and returns a tuple of tensors,
    its outputs, at fixed addresses from the first run on (a graph's, or copies refreshed by
    each eager run)."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.graph, self.outputs, self.eager_reason = None, None, None

    def build(self, capture: bool, pool) -> None:
        """The first run: warm up, capture and replay (CUDA), or run eagerly and keep copies."""
        if capture:
            _warm_up(self.fn)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.fn()
            except Exception as error:  # a capture the model refuses (a host read, ...): this part stays eager
                self.eager_reason = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            else:
                self.graph, self.outputs = graph, tuple(outputs)
                graph.replay()
                return
        else:
            self.eager_reason = "capture off (emulation)"
        self.outputs = tuple(t.clone() for t in self.fn())

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        for static, fresh in zip(self.outputs, self.fn()):
            static.copy_(fresh)


class _State:
    """The fixed buffers of one (bucket, capacities, model): the target's slot cache, the
    drafter's cache, and the per-cycle inputs; shared by every graph captured over them."""

    def __init__(self, rows: int, layout, target_cache, proposer, proposer_cache, block: int, capture: bool):
        from transformers import DynamicCache

        from ..target.slot_cache import SlotLayer, SlotRows

        lengths = layout.lengths
        device = lengths.device
        self.rows = rows
        self.slot_lengths = torch.full((rows,), PAD_LENGTH, dtype=lengths.dtype, device=device)
        self.layout = SlotRows(self.slot_lengths, layout.capacity, layout.mask_dtype)
        self.target_cache = DynamicCache()
        self.target_cache.layer_class_to_replicate = None
        self.target_cache.layers = [SlotLayer(layer.keys.new_zeros((rows,) + layer.keys.shape[1:]),
                                              layer.values.new_zeros((rows,) + layer.values.shape[1:]), self.layout)
                                    for layer in target_cache.layers]
        self.drafter_cache = proposer.new_cache(rows, proposer_cache.capacity, device)
        self.drafter_lengths = self.drafter_cache.lengths
        self.drafter_lengths.fill_(PAD_LENGTH)
        self.anchors = torch.zeros(rows, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.uniforms = torch.full((rows, block + 1), 0.5, dtype=torch.float64, device=device)
        self.contexts: Dict[Tuple[tuple, torch.dtype], torch.Tensor] = {}
        self.graphs: Dict[tuple, list] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.loaded = rows  # rows n.. of the inputs hold padding

    def adopt(self, n: int, target_cache, proposer_cache) -> int:
        """Makes the loop's caches views of this state's first n rows, copying them in where
        they are not already; returns how many tensors were copied."""
        copied = 0
        for theirs, mine in zip(target_cache.layers, self.target_cache.layers):
            for name in ("keys", "values"):
                view = _adopted(getattr(theirs, name), getattr(mine, name), n)
                if view is not None:
                    setattr(theirs, name, view)
                    copied += 1
        for tensors, mine in ((proposer_cache.keys, self.drafter_cache.keys),
                              (proposer_cache.values, self.drafter_cache.values)):
            for i, buffer in enumerate(mine):
                view = _adopted(tensors[i], buffer, n)
                if view is not None:
                    tensors[i] = view
                    copied += 1
        return copied

    def load(self, n: int, anchors, uniforms, slot_lengths, context_lens=None, drafter_lengths=None) -> None:
        """This cycle's inputs into rows 0..n-1 (padding rows set once when n shrinks)."""
        if n < self.loaded:
            self.anchors[n:].zero_()
            self.context_lens[n:].zero_()
            self.uniforms[n:].fill_(0.5)
            self.slot_lengths[n:].fill_(PAD_LENGTH)
            self.drafter_lengths[n:].fill_(PAD_LENGTH)
        self.loaded = n
        self.anchors[:n].copy_(anchors)
        self.uniforms[:n].copy_(uniforms)
        self.slot_lengths[:n].copy_(slot_lengths)
        if context_lens is not None:
            self.context_lens[:n].copy_(context_lens)
            self.drafter_lengths[:n].copy_(drafter_lengths)

    def context(self, n: int, context: torch.Tensor) -> torch.Tensor:
        """The fixed buffer for a context of this width, holding `context` in its first n rows."""
        shape = (self.rows,) + tuple(context.shape[1:])
        buffer = self.contexts.get((shape, context.dtype))
        if buffer is None:
            buffer = self.contexts[(shape, context.dtype)] = context.new_zeros(shape)
        buffer[:n].copy_(context)
        return buffer


def _adopted(tensor: torch.Tensor, buffer: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """buffer[:n] holding `tensor` (None: `tensor` already is that view)."""
    if tensor.data_ptr() == buffer.data_ptr() and tensor.shape[0] == n and tensor.stride() == buffer.stride():
        return None
    if tensor.shape[0] != n or tensor.shape[1:] != buffer.shape[1:]:
        raise RuntimeError(f"a cache tensor of shape {tuple(tensor.shape)} does not fit the graphs' buffer "
                           f"{tuple(buffer.shape)} at {n} rows")
    view = buffer[:n]
    view.copy_(tensor)
    return view


class CycleGraphs:
    """A decoder's captured cycles (module docstring). `cycle` and `plain_step` return None
    where they do not apply, and the loop then runs the step eagerly. `capture=False` runs every
    part eagerly on the same fixed buffers: the bookkeeping without graphs, for CPU tests.
    `time_parts` records CUDA events between the parts (`part_times`)."""

    def __init__(self, capture: bool = True, max_graphs: int = 16, max_states: int = 4, buckets=BATCH_BUCKETS,
                 time_parts: bool = False):
        if int(max_graphs) < 1 or int(max_states) < 1:
            raise ValueError(f"max_graphs and max_states must be >= 1, got {max_graphs} and {max_states}")
        self.capture, self.max_graphs, self.max_states = capture, int(max_graphs), int(max_states)
        self.buckets = tuple(sorted(buckets))
        self.states: "OrderedDict[tuple, _State]" = OrderedDict()
        self.stats = Counter()  # captured (graphs built), replayed (cycles served), copied (cache tensors adopted)
        self.eager_parts: Dict[str, str] = {}  # a part that runs eagerly inside the cycle -> why
        self.time_parts = time_parts
        self._events = []

    def reset(self) -> None:
        """Frees every graph and buffer (the next cycles capture again)."""
        self.states.clear()
        self._events.clear()

    # the loop's hooks
    def cycle(self, steps: ChainCycle, anchors, context, context_lens, proposer_cache, uniforms, layout, target_cache,
              sampling, depth: int):
        """One drafted cycle of `depth` drafts from graphs: (VerifyResult, the block's features,
        branch [N], prior [N, K]), as the eager steps give them; None to run it eagerly."""
        n = anchors.shape[0]
        state = self._state(steps, n, layout, target_cache, proposer_cache)
        if state is None:
            return None
        key = ("cycle", tuple(context.shape[1:]), context.dtype, depth) + self._settings(steps, sampling)
        parts = state.graphs.get(key)
        if parts is None and len(state.graphs) >= self.max_graphs:
            return None
        self.stats["copied"] += state.adopt(n, target_cache, proposer_cache)
        state.load(n, anchors, uniforms, layout.lengths, context_lens, proposer_cache.lengths)
        buffer = state.context(n, context)
        if parts is None:
            parts = state.graphs[key] = self._build(state, self._cycle_parts(steps, state, buffer, depth, sampling))
        else:
            self._run(parts)
        tokens, prior, branch, _, lengths = parts[0].outputs
        _, features = parts[1].outputs
        accepted, output_tokens, accept_probs = parts[2].outputs
        proposer_cache.lengths = lengths[:n].clone()
        self.stats["replayed"] += 1
        return (VerifyResult(accepted[:n].clone(), output_tokens[:n].clone(), accept_probs[:n].clone()),
                features[:n].clone(), branch[:n].clone(), prior[:n].clone())

    def plain_step(self, steps: ChainCycle, anchors, proposer_cache, uniforms, layout, target_cache, sampling):
        """A plain target step from a graph: (VerifyResult, the anchors' features) as
        `ChainCycle.plain_step` gives them; None to run it eagerly."""
        n = anchors.shape[0]
        state = self._state(steps, n, layout, target_cache, proposer_cache)
        if state is None:
            return None
        key = ("plain",) + self._settings(steps, sampling)
        parts = state.graphs.get(key)
        if parts is None and len(state.graphs) >= self.max_graphs:
            return None
        self.stats["copied"] += state.adopt(n, target_cache, proposer_cache)
        state.load(n, anchors, uniforms, layout.lengths)
        if parts is None:
            def plain():
                result, features = steps.plain_step(state.anchors, state.uniforms, state.layout, state.target_cache,
                                                    sampling)
                return (*result, features)

            parts = state.graphs[key] = self._build(state, [_Part("plain", plain)])
        else:
            self._run(parts)
        accepted, output_tokens, accept_probs, features = parts[0].outputs
        self.stats["replayed"] += 1
        return (VerifyResult(accepted[:n].clone(), output_tokens[:n].clone(), accept_probs[:n].clone()),
                features[:n].clone())

    def part_times(self) -> Dict[str, float]:
        """Mean milliseconds of each part over the replays timed so far (time_parts=True)."""
        totals, counts = Counter(), Counter()
        for names, events in self._events:
            events[-1].synchronize()
            for name, start, end in zip(names, events, events[1:]):
                totals[name] += start.elapsed_time(end)
                counts[name] += 1
        return {name: totals[name] / counts[name] for name in totals}

    # the machinery
    def _state(self, steps: ChainCycle, n: int, layout, target_cache, proposer_cache) -> Optional[_State]:
        from ..target.slot_cache import SlotRows

        rows = bucket_for(n, self.buckets)
        if rows is None or not isinstance(layout, SlotRows) or not hasattr(proposer_cache, "keys"):
            return None
        model, drafter = steps.target.model, steps.proposer.drafter
        identity = (id(model), next(model.parameters()).data_ptr(), steps.target.lm_head_weight.data_ptr(),
                    id(drafter), next(drafter.parameters()).data_ptr())
        key = (rows, layout.capacity, layout.mask_dtype, proposer_cache.capacity, identity)
        state = self.states.get(key)
        if state is None:
            state = _State(rows, layout, target_cache, steps.proposer, proposer_cache, steps.proposer.block_size,
                           self.capture)
            self.states[key] = state
            while len(self.states) > self.max_states:
                self.states.popitem(last=False)
        self.states.move_to_end(key)
        return state

    @staticmethod
    def _settings(steps: ChainCycle, sampling) -> tuple:
        """What a captured part bakes in besides shapes: the filter, Z_T, the kernels."""
        from .. import ops

        variant = ops.cuda_kernels() if steps.use_kernels else "reference"
        return (tuple(sorted(sampling.kwargs().items())), getattr(steps.proposer, "category_temperature", None),
                steps.use_kernels, variant)

    @staticmethod
    def _cycle_parts(steps: ChainCycle, state: _State, context: torch.Tensor, depth: int, sampling):
        parts = []

        def draft():
            cache = state.drafter_cache
            try:
                proposal, branch, drafts = steps.draft(state.anchors, context, state.context_lens, cache,
                                                       state.uniforms)
                lengths = cache.lengths
            finally:
                cache.lengths = state.drafter_lengths  # the next run reads the fixed input again
            return proposal.branch_tokens[:, :, :depth], proposal.prior, branch, drafts[:, :depth], lengths

        def score():
            drafts = parts[0].outputs[3]
            return steps.score(state.anchors, drafts, state.layout, state.target_cache)

        def verify():
            tokens, prior, branch = parts[0].outputs[:3]
            result = steps.verify(parts[1].outputs[0], Proposal(tokens, prior), branch,
                                  state.uniforms[:, 1 : depth + 2], sampling, validate=False)
            return tuple(result)

        parts += [_Part("draft", draft), _Part("score", score), _Part("verify", verify)]
        return parts

    def _build(self, state: _State, parts):
        for part in parts:
            part.build(self.capture, state.pool)
            if part.eager_reason is not None and self.capture:
                self.eager_parts[part.name] = part.eager_reason
        self.stats["captured"] += 1
        return parts

    def _run(self, parts) -> None:
        if not (self.time_parts and self.capture):
            for part in parts:
                part.run()
            return
        events = [torch.cuda.Event(enable_timing=True)]
        events[0].record()
        for part in parts:
            part.run()
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        self._events.append(([p.name for p in parts], events))

