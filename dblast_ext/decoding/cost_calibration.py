"""Measuring the adaptive controller's cost table (dblast_ext.decoding.adaptive.CostTable): how many
seconds a cycle of the decode loop takes at each depth, at each batch size, on this machine, with
these models, this dtype and these settings.

The loop itself is timed: `SpeculativeDecoder`'s own cycles on a synthetic prompt (random token
ids: a cycle's cost does not depend on what the tokens say), with a scripted controller that
walks through every depth several times; a cycle's cost is the median time between the
controller's consecutive depth calls at that depth (everything a cycle does, bookkeeping
included), smoothed as a drafter pass plus a cost per verified position (`smooth_costs`); and a
drafting cycle after a stretch of plain steps, whose extra time per token it reads is the
catch-up cost. Batches are measured at powers of two (1, 2, 4, ...) and interpolated between them.
A measured table is cached on disk under a key naming what it was measured for
(`adaptive.cost_table_path`), so it is measured once per machine, model pair, dtype and settings;
the decode loop measures what is missing before a generation starts, never during one.
"""
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from .adaptive import STEADY_UNSEEN, CostTable, ScriptedDepth, cost_table_path, machine_description
from .learned_costs import cost_line

__all__ = ["calibrate_costs", "ensure_costs", "cached_table", "cost_key", "smooth_costs", "CALIBRATION_PROMPT_TOKENS", "CALIBRATION_REPEATS"]

# the synthetic prompt's length (a typical context for a chat turn) and the times each depth is timed:
# with 3, one table kept a depth slope three times the true one (1.26 ms per depth for the demo's
# trie, against 0.32-0.54 in eight later calibrations), and the controller cut the trie too short
# for a whole session; 8 medians fit within about 0.1 ms per depth
CALIBRATION_PROMPT_TOKENS = 128
CALIBRATION_REPEATS = 8
# untimed rounds of every depth first: the first cycles validate their inputs, and every new shape
# allocates and (on a CPU) builds its kernels once; timing those made a cycle look twice its cost
WARM_UP_ROUNDS = 2
# the catch-up cost: a drafting cycle after this many plain steps, timed this many times
CATCH_UP_STEPS = 16
CATCH_UP_REPEATS = 2
# part of every table's key, raised when the loop's own cycle costs change, so tables measured
# before are measured again (2: CPU attention on grouped K/V heads, 8 timings per depth)
LOOP_COSTS_REVISION = 2


class _ScheduleDone(Exception):
    """Raised out of the decode loop when the timing schedule has run."""


class _TimedSchedule(ScriptedDepth):
    """A scripted controller that times each cycle (from one depth call to the next) and stops
    the loop once its schedule has run. Cycles whose index is in `catch_up_cycles` are timed
    apart (`catch_up_times`, with the unseen context tokens they read)."""

    def __init__(self, depths: Sequence[int], warm_up: int, catch_up_cycles: Sequence[int] = ()):
        super().__init__(depths)
        self.warm_up = warm_up  # cycles not timed
        self.catch_up_cycles = set(catch_up_cycles)
        self.times: Dict[int, List[float]] = {}
        self.catch_up_times: List[tuple] = []  # (seconds, unseen tokens)
        self._last = None

    def depth(self, unseen: int = 0, remaining: int = 0) -> int:
        now = time.perf_counter()
        if self._last is not None and self._last[2]:
            if self._last[3] is not None:
                self.catch_up_times.append((now - self._last[1], self._last[3]))
            else:
                self.times.setdefault(self._last[0], []).append(now - self._last[1])
        if self.cycle == len(self.depths):
            raise _ScheduleDone
        index = self.cycle
        d = super().depth()
        self._last = (d, now, self.cycle > self.warm_up, unseen if index in self.catch_up_cycles else None)
        return d


def _schedule(max_depth: int, repeats: int) -> tuple:
    """(depths, the indices of the catch-up cycles): every depth in turn (interleaved, so drift
    over the run spreads over all depths alike), the warm-up rounds, then the timed ones; then
    CATCH_UP_REPEATS times CATCH_UP_STEPS plain steps and a cycle at the deepest depth, which
    reads their tokens (its cost beyond a steady cycle's is the catch-up); and one more cycle
    whose start ends the last timing."""
    depths = [d for _ in range(WARM_UP_ROUNDS + repeats) for d in range(max_depth, -1, -1)]
    catch_up = []
    for _ in range(CATCH_UP_REPEATS):
        depths += [0] * CATCH_UP_STEPS
        catch_up.append(len(depths))
        depths.append(max_depth)
    return depths + [0], catch_up


def _time_cycles(decoder, rows: int, tree: bool, repeats: int) -> List[float]:
    from ..sampling import SamplingParams

    max_depth = decoder.proposer.block_size - 1
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(decoder.target.vocab_size, (CALIBRATION_PROMPT_TOKENS,), generator=generator).tolist()
    # rows of different lengths, as real batches are (a ragged layout: masks, and commits that move entries)
    prompts = [prompt[: CALIBRATION_PROMPT_TOKENS - (i * 7) % (CALIBRATION_PROMPT_TOKENS // 2)] for i in range(rows)]
    depths, catch_up_cycles = _schedule(max_depth, repeats)
    schedule = _TimedSchedule(depths, WARM_UP_ROUNDS * (max_depth + 1), catch_up_cycles)
    schedule.start(rows, max_depth)
    limit = sum(d + 1 for d in schedule.depths) + 2  # never reached first: each cycle commits at most d + 1
    greedy = SamplingParams(temperature=0.0)
    try:
        with torch.inference_mode():
            if tree:
                decoder._generate_tree(prompt, greedy, limit, None, 0, None, schedule)
            else:
                decoder._generate_batch(prompts, greedy, limit, None, None, None, schedule)
    except _ScheduleDone:
        pass
    missing = [d for d in range(max_depth + 1) if not schedule.times.get(d)]
    if missing or len(schedule.catch_up_times) != CATCH_UP_REPEATS:
        raise RuntimeError(f"cost calibration timed no cycle at depths {missing or 'catch-up'}")
    medians = [statistics.median(schedule.times[d]) for d in range(max_depth + 1)]
    # the least of the repeats (noise only adds): seconds beyond a steady deepest cycle, per token
    # beyond those a steady cycle reads
    catch_up = min(max(0.0, seconds - medians[max_depth]) / max(1, unseen - STEADY_UNSEEN * rows)
                   for seconds, unseen in schedule.catch_up_times)
    return smooth_costs(medians), catch_up


def smooth_costs(medians: Sequence[float]) -> List[float]:
    """The measured cost curve as the loop's cost model: C(0), a plain step, as measured; for
    d >= 1 the line a + b d fitted to the drafting depths (`learned_costs.cost_line`)."""
    if len(medians) <= 2:
        return list(medians)
    return [medians[0]] + cost_line({d: c for d, c in enumerate(medians) if d}, len(medians) - 1)


def cost_key(decoder) -> Dict[str, object]:
    """What a cost table depends on: the machine, the models (their configurations and sizes),
    the dtype and device, the block, the draft vocabulary and the verification settings."""
    target = decoder.target.model
    proposer = decoder.proposer
    drafter = getattr(proposer, "drafter", None)
    draft_ids = getattr(proposer, "draft_ids", None)
    return {
        "loop_costs_revision": LOOP_COSTS_REVISION,
        "machine": machine_description(),
        "device": str(decoder.target.device.type if hasattr(decoder.target.device, "type") else decoder.target.device),
        "torch": torch.__version__,
        "target": getattr(target.config, "_name_or_path", "") or type(target).__name__,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "target_layers": target.config.num_hidden_layers,
        "target_hidden": target.config.hidden_size,
        "dtype": str(decoder.target.dtype),
        "proposer": type(proposer).__name__,
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()) if drafter is not None else None,
        "drafter_dtype": str(next(drafter.parameters()).dtype) if drafter is not None else None,
        "block_size": proposer.block_size,
        "branches": proposer.num_branches,
        "draft_vocab": None if draft_ids is None else int(draft_ids.numel()),
        "verify": decoder.verify,
        "max_tree_nodes": decoder.max_tree_nodes,
        "extra_leaves": decoder.extra_leaves,
        "kernels": decoder.use_kernels,
        "target_cache": decoder.target_cache,
    }


def _batch_sizes(rows: int) -> List[int]:
    sizes, n = [], 1
    while True:
        sizes.append(n)
        if n >= rows:
            return sizes
        n *= 2


def calibrate_costs(decoder, batch_sizes: Sequence[int] = (1,), tree: Optional[bool] = None,
                    table: Optional[CostTable] = None, repeats: int = CALIBRATION_REPEATS,
                    progress: bool = False) -> CostTable:
    """Times `decoder`'s cycles at every depth: for greedy-branch verification at each of
    `batch_sizes`, for trie verification (one prompt) when `tree` (default: the decoder's verify
    mode is "tree"). Adds them to `table` (a new one by default, keyed by `cost_key`) and returns it."""
    if any(int(n) < 1 for n in batch_sizes):
        raise ValueError(f"batch_sizes must be >= 1, got {list(batch_sizes)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    tree = decoder.verify == "tree" if tree is None else tree
    table = table or CostTable(cost_key(decoder))
    if tree:
        if progress:
            print("dblast: measuring cycle costs (trie verification) for the adaptive controller", file=sys.stderr)
        table.tree, table.tree_catch_up = _time_cycles(decoder, 1, True, repeats)
    else:
        for n in batch_sizes:
            if progress:
                print(f"dblast: measuring cycle costs at batch size {n} for the adaptive controller", file=sys.stderr)
            table.chain[int(n)], table.chain_catch_up[int(n)] = _time_cycles(decoder, int(n), False, repeats)
    return table


_LOADED: Dict[str, CostTable] = {}  # cache files read (or measured) in this process, by path


def cached_table(decoder) -> tuple:
    """(the cached cost table of the decoder's key, or a new empty one; its cache path)."""
    key = cost_key(decoder)
    path = cost_table_path(key)
    table = _LOADED.get(path)
    if table is None:
        try:
            table = CostTable.load(path)
        except (FileNotFoundError, ValueError):  # none yet, or a damaged file: measured again
            table = CostTable(key)
        _LOADED[path] = table
    return table, path


def ensure_costs(decoder, rows: int, tree: bool) -> CostTable:
    """The cost table for a generation of `rows` prompts: the decoder's own (`cost_table=`),
    else the cached table of its key (`cost_key`: a change of model, dtype or settings gives
    another), measuring what either lacks now, before the generation starts. A measured cached
    table is saved again; a table the caller gave is completed in memory only."""
    table, path = decoder.cost_table, None
    if table is None:
        table, path = cached_table(decoder)
    if tree:
        missing = table.tree is None
        if missing:
            calibrate_costs(decoder, tree=True, table=table, progress=True)
    else:  # measured sizes from 1 up to at least `rows` are enough: the costs between are interpolated
        covered = 1 in table.chain and max(table.chain) >= rows
        needed = [] if covered else [n for n in _batch_sizes(rows) if n not in table.chain]
        missing = bool(needed)
        if missing:
            calibrate_costs(decoder, needed, tree=False, table=table, progress=True)
    if missing and path is not None:
        table.save(path)
    return table
