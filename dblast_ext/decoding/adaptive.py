"""Adaptive drafting: how many drafts each cycle verifies, chosen from measured acceptance and
measured cost, so that drafting never makes generation slower than the target alone.

A cycle that verifies d drafts (0 <= d <= D, D = block_size - 1) costs C(n, d) seconds at batch
size n (the drafter pass, the target forward over d + 1 positions per row, the verifier and the
loop's bookkeeping; d = 0 is a plain target step, no drafter pass) and commits

    E_r(d) = 1 + sum_{i=1..d} prod_{j<=i} a_r[j]

tokens in expectation for row r, where a_r[j] is the chance that draft j is accepted given that
drafts 1..j-1 were (its conditional acceptance). Each cycle the controller verifies the depth

    d* = argmax_d  sum_r E_r(d) / C(n, d)

(ties: the shallower; and a cut block 0 < d* < D only where it is expected to be faster than
the whole block by more than DEPARTURE_MARGIN), so at a batch size or a temperature where
verification costs more than it commits, d* = 0 and the loop decodes plainly. The signals:
- a_r[j]: a running average over the cycles that verified position j, starting from a prior
  of PRIOR_ACCEPTANCE worth PRIOR_WEIGHT observations, in which every observation's weight fades by
  ALPHA per cycle (so it follows a response whose predictability changes, and a position not
  verified for a while is quickly re-learnt). Each observation is an acceptance probability, not a 0/1
  outcome: greedy-branch verification reports min(1, p / q) at every verified position
  (`VerifyResult.accept_probs`), trie verification the walk's chance of reaching each depth
  (`TrieWalk.depth_reach`), so one cycle informs every position it verified.
- C(n, d): learned from the cycles the generation runs (a `learned_costs.LearnedCosts`: the
  controller times each cycle; where nothing is known yet it takes plain steps and drafts to learn
  only within a budget), starting from what earlier generations timed or a measured `CostTable`
  (`calibrate_costs`), cached on disk (`cost_table_path`); or a fixed table the caller gives.
Bounded exploration: every `probe_interval` cycles a cycle verifies deeper than d* (what changed
there can only be seen by verifying it): one position deeper, or more where they cost little more
(`probe_depth`), at most PROBE_BUDGET of the time in expectation; a probe from d* = 0 runs the
drafter, which then catches up on every committed token's features in one pass (no new prefill).

Exactness: the depth is chosen before the cycle draws anything and depends only on earlier
cycles (what they committed and the acceptance probabilities they reported) and the cost table.
Whatever d is, the cycle's committed tokens follow the target's distribution (a shorter chain is
verified exactly like a longer one; d = 0 samples the target directly), so the output
distribution is the target's (the timings a learned cost reads are of earlier cycles), and with
the same fixed cost table and seeds the output is the same token for token. The controller only decides how fast.
"""
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence

__all__ = ["DepthController", "FixedDepth", "ScriptedDepth", "AdaptiveDepth", "CostTable", "expected_committed",
           "chosen_depth", "cost_table_path", "CONTROLLERS", "ALPHA", "PRIOR_ACCEPTANCE", "PRIOR_WEIGHT",
           "PROBE_BUDGET", "DEPARTURE_MARGIN"]

# forgetting rate of the running averages: every cycle what an estimate is worth (in observations)
# shrinks by this share, so in steady drafting a new observation weighs about ALPHA, and after a
# stretch without observations (plain steps) a probe's observation weighs more, as stale evidence
# should; and the prior each position starts from, worth PRIOR_WEIGHT observations: an even
# chance, which drafts at batch 1 when a cycle costs under about twice a target step and lets the
# first cycles' measurements decide soon after
ALPHA = 1 / 16
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2
# the benefit of the doubt an estimate worth w observations gets: + OPTIMISM / sqrt(w + 1). Chosen on
# five MT-Bench prompts (the least predictable dataset) with the embedded pair, bfloat16 trie: at
# T 0.7, 0 gave 0.96x of fixed drafting (plain steps where drafting paid), 0.15 gave 1.00x; at T 1.5,
# 0.15 gave 1.05x of fixed drafting (recipes/smollm2/logs/adaptive-tuning-2026-12-05.log)
OPTIMISM = 0.15
# the share of time exploration may cost in expectation: a probe one position deeper than d* is run
# every max(MIN_PROBE_INTERVAL, (C(d* + 1) / C(d*) - 1) / PROBE_BUDGET) cycles
PROBE_BUDGET = 0.02
MIN_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 256
# a probe verifies the deepest depth that costs at most this many times the extra of one position
PROBE_DEPTH_SLACK = 1.5
# the controller cuts the block short of the whole (the fixed settings, measured fastest for the
# pair) only for a predicted gain above this share: below it the prediction is within the model's
# own error (a cut trie spends its node budget at shallower depths, which the per-position averages
# do not see; on the demo's prompts at T 1.0, six seeds, bfloat16 trie, a trie cut at depth 3 and
# the whole block ran within 2% of each other). Plain steps are not held to it (`chosen_depth`)
DEPARTURE_MARGIN = 0.03
# context tokens per row a drafting cycle's measured cost already includes (the previous cycle's
# committed tokens): the catch-up cost counts only the unseen tokens beyond these
STEADY_UNSEEN = 2
# the names SpeculativeDecoder(controller=...) takes besides a DepthController object
CONTROLLERS = ("adaptive", "off")


class DepthController(Protocol):
    """What the decode loop asks of a controller: `start` before the first cycle of a generation
    (with the cost curve when the controller sets `needs_costs = True`: C(d) for d = 0..D, or for
    a batch a function of its number of rows, and the catch-up cost per unseen context token),
    `depth` before each cycle (one depth for the whole batch: one shape; `unseen`: the context
    tokens, summed over the active rows, that the drafter has not read yet and its next pass will:
    the prompt before the first pass, every plain step's token after it; `remaining`: the tokens
    the active rows may still generate), `observe` after it with every active row's conditional
    acceptance at the positions that cycle verified, `select` when rows finish (the indices, into
    the active rows, of those that go on)."""

    def start(self, rows: int, max_depth: int, costs: Optional[List[float]] = None, catch_up: float = 0.0) -> None: ...

    def depth(self, unseen: int = 0, remaining: int = 0) -> int: ...

    def observe(self, depth: int, acceptance: Sequence[Sequence[float]]) -> None: ...

    def select(self, keep: Sequence[int]) -> None: ...


class FixedDepth:
    """Every cycle verifies `depth` drafts (None: the whole block), as the loop did before the
    controller: `controller="off"`."""

    def __init__(self, depth: Optional[int] = None):
        if depth is not None and int(depth) < 0:
            raise ValueError(f"depth must be None or >= 0, got {depth!r}")
        self.fixed = depth
        self.max_depth = 0

    def start(self, rows: int, max_depth: int, costs=None, catch_up: float = 0.0) -> None:
        self.max_depth = max_depth

    def depth(self, unseen: int = 0, remaining: int = 0) -> int:
        return self.max_depth if self.fixed is None else min(int(self.fixed), self.max_depth)

    def observe(self, depth, acceptance) -> None:
        pass

    def select(self, keep) -> None:
        pass


class ScriptedDepth(FixedDepth):
    """The depths of `depths` in turn, cycling (clipped to the block): for calibration and for
    the exactness tests, which switch depth every cycle."""

    def __init__(self, depths: Sequence[int]):
        super().__init__()
        if not depths or any(int(d) < 0 for d in depths):
            raise ValueError(f"depths must be a non-empty list of depths >= 0, got {list(depths)!r}")
        self.depths = [int(d) for d in depths]
        self.cycle = 0
        self.chosen: List[int] = []

    def start(self, rows: int, max_depth: int, costs=None, catch_up: float = 0.0) -> None:
        super().start(rows, max_depth)
        self.cycle = 0

    def depth(self, unseen: int = 0, remaining: int = 0) -> int:
        d = min(self.depths[self.cycle % len(self.depths)], self.max_depth)
        self.cycle += 1
        self.chosen.append(d)
        return d


def expected_committed(acceptance: Sequence[float], depth: int) -> float:
    """E(d) = 1 + sum_{i<=d} prod_{j<=i} a[j]: the tokens a cycle verifying `depth` drafts
    commits in expectation (acceptance[j - 1] = a[j])."""
    total, survive = 1.0, 1.0
    for a in acceptance[:depth]:
        survive *= a
        total += survive
    return total


def chosen_depth(rates: Sequence[float]) -> int:
    """The depth to verify given the expected committed tokens per second at each depth d = 0..D
    (`rates[d]`, D = the whole block): the argmax (ties: the shallower); where that is a cut block
    (0 < d < D) gaining at most DEPARTURE_MARGIN over the whole block, the whole block (a gain
    within the model's error, as fixed drafting). A plain step is taken on the argmax alone: it
    commits one token and costs a target step, both known, so the margin would only keep drafting
    where it does not pay. The controller's decision and the vLLM batch schedule's."""
    best, best_rate = 0, -1.0
    for d, rate in enumerate(rates):
        if rate > best_rate * (1 + 1e-9):  # ties: the shallower
            best, best_rate = d, rate
    whole = len(rates) - 1
    return whole if 0 < best and best_rate < rates[whole] * (1 + DEPARTURE_MARGIN) else best


class AdaptiveDepth:
    """d* = argmax_d sum_r E_r(d) / C(d) each cycle (module docstring), from running averages of
    each row's conditional acceptance and the cost curve `start` is given (C(d), d = 0..D, at the
    batch's size)."""

    needs_costs = True

    def __init__(self, alpha: float = ALPHA, probe_budget: float = PROBE_BUDGET, clock=time.perf_counter):
        """`clock`: seconds, read once per `depth` call to time the cycles when the costs are
        learned (dblast_ext.decoding.learned_costs); tests give their own."""
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not 0 < probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {probe_budget!r}")
        self.alpha = alpha
        self.probe_budget = probe_budget
        self.costs: List[float] = []
        self.cost_curve = None  # rows -> costs, when the batch's cost changes as rows finish
        self.catch_up = 0.0  # seconds per unseen context token (catch_up_cost)
        self.catch_up_curve = None
        self.rows: List[List[float]] = []    # per active row: a[j] estimates
        self.weights: List[List[float]] = []  # per active row: what a[j]'s estimate is worth, in observations
        self.observed: List[List[bool]] = []  # per active row: whether a cycle has verified position j yet
        self.max_depth = 0
        self.cycle = 0
        self.since_probe = 0
        self.chosen: List[int] = []
        self.clock = clock
        self.learner = None  # a LearnedCosts when the costs are learned while decoding
        self._running = None  # (rows, depth, start, unseen, after a drafting cycle) of the cycle under way
        self.learning_spent = 0.0  # seconds the learning cycles cost beyond plain steps

    def start(self, rows: int, max_depth: int, costs=None, catch_up=0.0) -> None:
        """`costs`: C(d) for d = 0..max_depth, or a callable giving them for a number of rows, or
        a `learned_costs.LearnedCosts` that this controller refines with the cycles it times;
        `catch_up`: seconds per context token the drafter reads beyond a drafting cycle's own (or
        a callable of the rows; a LearnedCosts gives its own)."""
        if costs is None:
            raise ValueError("AdaptiveDepth needs the batch's cost curve (a CostTable's costs or a LearnedCosts)")
        self.max_depth = max_depth
        self.rows = [[PRIOR_ACCEPTANCE] * max_depth for _ in range(rows)]
        self.weights = [[float(PRIOR_WEIGHT)] * max_depth for _ in range(rows)]
        self.observed = [[False] * max_depth for _ in range(rows)]
        self.cycle = 0
        self.since_probe = 0
        self.chosen = []
        self._running, self.learning_spent = None, 0.0
        self.learner = costs if hasattr(costs, "record") else None
        if self.learner is not None:
            self.cost_curve = self.catch_up_curve = None
            self.costs, self.catch_up = [], 0.0  # read from the learner before each cycle
            return
        self.cost_curve = costs if callable(costs) else None
        self.catch_up_curve = catch_up if callable(catch_up) else None
        self.costs = list(costs(rows)) if callable(costs) else list(costs)
        self.catch_up = float(catch_up(rows) if callable(catch_up) else catch_up)
        if not (math.isfinite(self.catch_up) and self.catch_up >= 0):
            raise ValueError(f"catch_up must be a finite number of seconds >= 0, got {self.catch_up}")
        if len(self.costs) < max_depth + 1 or not all(c > 0 and math.isfinite(c) for c in self.costs):
            raise ValueError(f"costs must give a finite cost > 0 for every depth 0..{max_depth}, got {self.costs}")

    def rates(self) -> List[float]:
        """The expected committed tokens per second over the active rows at each depth d."""
        committed = [float(len(self.rows))] * (self.max_depth + 1)  # sum_r E_r(d), each row's bonus token
        # E_r(d) - 1 = sum_{i<=d} prod_{j<=i} a[j]
        for row, weights, observed in zip(self.rows, self.weights, self.observed):
            survive, reached = 1.0, 0.0
            for j, a in enumerate(row[: self.max_depth]):
                # an estimate worth few observations gets the benefit of the doubt (OPTIMISM), so a
                # position not verified for a while (its weight faded) is tried again; the prior before
                # any observation gets none: at batch 16 its bonus alone made the first cycles draft
                bonus = OPTIMISM / math.sqrt(weights[j] + 1) if observed[j] else 0.0
                survive *= min(1.0, a + bonus)
                reached += survive
                committed[j + 1] += reached
        return [c / cost for c, cost in zip(committed, self.costs)]

    def best_depth(self) -> int:
        """The depth of the highest expected committed tokens per second over the active rows
        (a cut block only where it beats the whole block by more than DEPARTURE_MARGIN)."""
        return chosen_depth(self.rates())

    def catch_up_cost(self, unseen: int) -> float:
        """Seconds the next drafter pass spends on context beyond a drafting cycle's own: the
        prompt before the first pass, the plain steps' tokens after a stretch of them."""
        return self.catch_up * max(0, unseen - STEADY_UNSEEN * len(self.rows))

    @staticmethod
    def catch_up_pays(rates: List[float], d: int, catch_up: float, remaining: int) -> bool:
        """Whether drafting at depth d, after a catch-up of `catch_up` seconds, is expected to
        save more than that over the tokens still to generate (at most `remaining`)."""
        return catch_up < remaining * (1 / rates[0] - 1 / rates[d])

    def probe_depth(self, best: int) -> int:
        """How deep a probe from `best` verifies: one position deeper, or deeper still while that
        costs at most PROBE_DEPTH_SLACK times as much extra (where deeper positions are nearly free,
        as on a CPU in bfloat16, one probe observes them all)."""
        # timings on a loaded machine need not rise with depth: a next depth that looks cheaper than
        # `best` still probes one deeper, and its (clamped) extra cost sets the slack for the rest
        shallowest = max(self.costs[best + 1] - self.costs[best], 0.0)
        return max([best + 1] + [d for d in range(best + 2, self.max_depth + 1)
                                 if self.costs[d] - self.costs[best] <= PROBE_DEPTH_SLACK * shallowest])

    def probe_interval(self, best: int, catch_up: float = 0.0) -> int:
        """Cycles between probes from `best`: what a probe costs over a cycle at `best` (its
        catch-up included), spread so that probing costs at most `probe_budget` of the time. A
        probe after plain steps reads their tokens: where that catch-up grows faster than the
        budget, probes stop, as at a batch size where drafting cannot pay."""
        extra = (self.costs[self.probe_depth(best)] + catch_up) / self.costs[best] - 1
        interval = max(MIN_PROBE_INTERVAL, math.ceil(extra / self.probe_budget))
        return interval if catch_up > 0 or interval <= MAX_PROBE_INTERVAL else MAX_PROBE_INTERVAL

    def depth(self, unseen: int = 0, remaining: int = 0) -> int:
        """The depth of the next cycle; `unseen` and `remaining` as in DepthController."""
        if self.learner is not None:
            now = self._learn()
            d = self._steady_depth(unseen, remaining) if self.costs else self._learning_depth(unseen, remaining)
            self._running = (len(self.rows), d, now, unseen, bool(self.chosen) and self.chosen[-1] > 0)
            self.cycle += 1
            self.chosen.append(d)
            return d
        d = self._steady_depth(unseen, remaining)
        self.cycle += 1
        self.chosen.append(d)
        return d

    def _steady_depth(self, unseen: int, remaining: int) -> int:
        """d* from the cost curve (a probe deeper every probe_interval cycles)."""
        rates = self.rates()
        d = chosen_depth(rates)
        catch_up = self.catch_up_cost(unseen)
        if d > 0 and catch_up > 0 and not self.catch_up_pays(rates, d, catch_up, remaining):
            d = 0  # drafting would pay per cycle, but not for reading what it has not seen
        self.since_probe += 1
        if d < self.max_depth and self.since_probe >= self.probe_interval(d, catch_up):
            d, self.since_probe = self.probe_depth(d), 0
        return d

    def _learn(self) -> float:
        """Times the cycle that just ended into the learner and reads the cost curve at the
        batch's size (empty where it is not known yet). Returns the time now."""
        now = self.clock()
        if self._running is not None:
            rows, d, started, unseen, after_draft = self._running
            self.learner.record(rows, d, now - started, unseen, after_draft)
            if d > 0 and not self.costs:  # a learning cycle: what it cost beyond a plain step
                from .learned_costs import LEARN_BUDGET

                plain = self.learner.plain_cost(rows) or 0.0
                self.learning_spent += max(0.0, now - started - plain)
                # spent from the credit earlier generations left: the next ones do not spend it again
                self.learner.add_credit(rows, -max(0.0, now - started - plain) / LEARN_BUDGET)
            elif not self.costs:  # a plain step while learning: the budget's base for later generations
                self.learner.add_credit(rows, now - started)
        curve = self.learner.curve(len(self.rows)) if self.rows else None
        self.costs = list(curve) if curve is not None else []
        self.catch_up = self.learner.catch_up(len(self.rows)) if curve is not None else 0.0
        return now

    def _learning_depth(self, unseen: int, remaining: int) -> int:
        """The depth of a cycle before the batch size's drafting cost is known: a plain step until
        its own cost is timed, then the whole block where the most that cycle could lose (its cost
        beyond a plain step, each row committing at least one token either way: PRIOR_DRAFT_RATIO
        and PRIOR_CATCH_UP before any drafting cycle was timed, the timed one's after) fits in what
        is left of LEARN_BUDGET of the plain decoding time ahead and of the plain steps earlier
        generations took while learning; else a plain step."""
        from .learned_costs import LEARN_BUDGET, PRIOR_CATCH_UP, PRIOR_DRAFT_RATIO

        rows = len(self.rows)
        plain = self.learner.plain_cost(rows)
        if plain is None or self.max_depth == 0:
            return 0
        timed = self.learner.drafting_cost(rows, self.max_depth)
        if timed is not None:
            bound = timed - plain
        else:
            catch_up_tokens = max(0, unseen - STEADY_UNSEEN * rows)
            bound = (PRIOR_DRAFT_RATIO - 1) * plain + PRIOR_CATCH_UP * plain * catch_up_tokens / rows
        ahead = plain * (self.cycle + remaining / rows)  # the whole generation, decoded plainly
        budget = LEARN_BUDGET * (ahead + self.learner.credit(rows)) - self.learning_spent
        return self.max_depth if bound <= budget else 0

    def observe(self, depth: int, acceptance: Sequence[Sequence[float]]) -> None:
        """acceptance[r][j - 1]: row r's conditional acceptance a[j] as this cycle measured it,
        for the positions j <= depth it verified (NaN where the cycle says nothing of j)."""
        if len(acceptance) != len(self.rows):
            raise ValueError(f"acceptance has {len(acceptance)} rows, the controller tracks {len(self.rows)}")
        keep = 1 - self.alpha
        for estimates, weights, seen, observed in zip(self.rows, self.weights, self.observed, acceptance):
            for i in range(len(weights)):  # every cycle, observed or not, old evidence counts for less
                weights[i] *= keep
            for j, a in enumerate(observed[:depth]):
                if math.isnan(a):
                    continue
                seen[j] = True
                weights[j] += 1
                estimates[j] += (a - estimates[j]) / weights[j]

    def select(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.weights = [self.weights[i] for i in keep]
        self.observed = [self.observed[i] for i in keep]
        if self.cost_curve is not None and keep:
            self.costs = list(self.cost_curve(len(keep)))
        if self.catch_up_curve is not None and keep:
            self.catch_up = float(self.catch_up_curve(len(keep)))


# ------------------------------------------------------------------------------------------------
# the cost table

COST_TABLE_VERSION = 2  # 2: the catch-up costs


@dataclass
class CostTable:
    """Seconds per cycle by depth: `chain[n][d]` for greedy-branch verification at batch size n
    (d = 0..D), `tree[d]` for trie verification capped at depth d (one prompt); and the seconds
    per context token the drafter reads beyond a drafting cycle's own (after plain steps, or the
    prompt): `chain_catch_up[n]`, `tree_catch_up`. `key` names what it was measured for
    (machine, models, dtype, settings: `cost_key`). `learned`: what generations timed
    (dblast_ext.decoding.learned_costs): {"chain" | "tree": {"costs": {n: {d: seconds}}, "catch_up": {n: seconds}}}."""
    key: Dict[str, object] = field(default_factory=dict)
    chain: Dict[int, List[float]] = field(default_factory=dict)
    tree: Optional[List[float]] = None
    chain_catch_up: Dict[int, float] = field(default_factory=dict)
    tree_catch_up: Optional[float] = None
    learned: Dict[str, dict] = field(default_factory=dict)

    def catch_up(self, rows: int) -> float:
        """Seconds per unseen context token at batch size `rows`: measured, or linear between
        the measured sizes around it (the nearest beyond them); 0 where none was measured (a
        table written by hand: catch-up then goes unmodelled)."""
        if not self.chain_catch_up:
            return 0.0
        sizes = sorted(self.chain_catch_up)
        below = [n for n in sizes if n <= rows]
        above = [n for n in sizes if n >= rows]
        if not below or not above:
            return self.chain_catch_up[sizes[0] if not below else sizes[-1]]
        lo, hi = below[-1], above[0]
        w = 0.0 if hi == lo else (rows - lo) / (hi - lo)
        return self.chain_catch_up[lo] + w * (self.chain_catch_up[hi] - self.chain_catch_up[lo])

    def chain_costs(self, rows: int) -> List[float]:
        """C(rows, d) for every d: measured, or linear between the measured batch sizes around
        `rows` (beyond the largest, along the slope of the last two; with one size, in proportion
        to the rows)."""
        if not self.chain:
            raise ValueError("the cost table has no greedy-branch costs (calibrate it first)")
        if rows in self.chain:
            return list(self.chain[rows])
        sizes = sorted(self.chain)
        below = [n for n in sizes if n < rows]
        above = [n for n in sizes if n > rows]
        if not above:  # beyond the largest: each depth's cost goes on along its last measured slope
            if len(below) == 1:
                return [c * rows / below[0] for c in self.chain[below[0]]]
            lo, hi = below[-2], below[-1]
            return [b + (rows - hi) * max(0.0, (b - a) / (hi - lo)) for a, b in zip(self.chain[lo], self.chain[hi])]
        if not below:
            return list(self.chain[above[0]])
        lo, hi = below[-1], above[0]
        w = (rows - lo) / (hi - lo)
        return [a + w * (b - a) for a, b in zip(self.chain[lo], self.chain[hi])]

    def to_json(self) -> dict:
        return {"version": COST_TABLE_VERSION, "key": self.key,
                "chain": {str(n): costs for n, costs in sorted(self.chain.items())}, "tree": self.tree,
                "chain_catch_up": {str(n): c for n, c in sorted(self.chain_catch_up.items())},
                "tree_catch_up": self.tree_catch_up, "learned": self.learned}

    @classmethod
    def from_json(cls, data: dict, source: str = "cost table") -> "CostTable":
        if not isinstance(data, dict) or data.get("version") != COST_TABLE_VERSION:
            raise ValueError(f"{source}: not a dblast cost table of version {COST_TABLE_VERSION}")
        try:
            chain = {int(n): [float(c) for c in costs] for n, costs in (data.get("chain") or {}).items()}
            tree = None if data.get("tree") is None else [float(c) for c in data["tree"]]
            chain_catch_up = {int(n): float(c) for n, c in (data.get("chain_catch_up") or {}).items()}
            tree_catch_up = None if data.get("tree_catch_up") is None else float(data["tree_catch_up"])
            learned = {mode: {"costs": {str(int(n)): {str(int(d)): float(c) for d, c in depths.items()}
                                        for n, depths in (section.get("costs") or {}).items()},
                              "catch_up": {str(int(n)): float(c) for n, c in (section.get("catch_up") or {}).items()},
                              "credit": {str(int(n)): float(c) for n, c in (section.get("credit") or {}).items()}}
                       for mode, section in (data.get("learned") or {}).items() if mode in ("chain", "tree")}
        except (TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{source}: malformed costs ({error})") from None
        for costs in list(chain.values()) + ([tree] if tree else []):
            if not costs or not all(c > 0 and math.isfinite(c) for c in costs):
                raise ValueError(f"{source}: every cost must be a finite number of seconds > 0, got {costs}")
        learned_costs = [c for section in learned.values() for depths in section["costs"].values() for c in depths.values()]
        if not all(c > 0 and math.isfinite(c) for c in learned_costs):
            raise ValueError(f"{source}: every learned cost must be a finite number of seconds > 0")
        learned_catch_up = [c for section in learned.values() for c in section["catch_up"].values()]
        learned_catch_up += [c for section in learned.values() for c in section["credit"].values()]
        for c in list(chain_catch_up.values()) + ([] if tree_catch_up is None else [tree_catch_up]) + learned_catch_up:
            if not (c >= 0 and math.isfinite(c)):
                raise ValueError(f"{source}: every catch-up cost must be a finite number of seconds >= 0, got {c}")
        return cls(dict(data.get("key") or {}), chain, tree, chain_catch_up, tree_catch_up, learned)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str) -> "CostTable":
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        return cls.from_json(data, path)


def cost_cache_root() -> str:
    """Where measured cost tables are kept: $DBLAST_COST_CACHE, else ~/.cache/dblast_ext/costs."""
    return os.environ.get("DBLAST_COST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dblast_ext",
                                                                  "costs")


def machine_description() -> str:
    """The processor (or GPU) and thread count a cost table was measured with."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = f"; {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}; {torch.get_num_threads()} threads{gpu}"


def cost_table_path(key: Dict[str, object]) -> str:
    """The cache file of the cost table measured for `key`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cost_cache_root(), f"costs-{digest}.json")
