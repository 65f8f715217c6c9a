"""The adaptive controller's cycle costs, learned from the cycles it runs.

A cycle's cost C(n, d) (seconds at batch size n verifying d drafts; dblast_ext.decoding.adaptive) depends
on the machine, the models, the dtype and the settings, so it has to be measured; measuring a
whole table before the first generation took minutes on a fresh machine (every depth at batch
sizes 1, 2, 4, ... up to the batch). Instead the controller times the cycles the generation runs
anyway (the time from one `depth` call to the next: everything a cycle does) and this module
turns those timings into the cost curve it decides by:

- at each (n, d) seen, the median of the last WINDOW timings;
- where a cached table (`CostTable`, measured by `dblast calibrate --cost` or learned by earlier
  generations) has a curve for n, the unseen depths follow its shape, scaled to what was timed;
- without one, C(d) for the unseen drafting depths is the line a + b d through the timed ones
  (b >= 0; flat while one drafting depth is timed, so the choice is then a plain step or that depth);
- a batch whose rows finish uses the curve of the nearest batch size timed within a factor of 2.
Where no curve is known yet (`curve` returns None), the controller learns: plain steps first
(their cost is then known), and a drafting cycle only where what it could lose, bounded with
pessimistic priors (PRIOR_DRAFT_RATIO, PRIOR_CATCH_UP), fits within LEARN_BUDGET of the plain
decoding time the generation has ahead plus what earlier generations decoded plainly while
learning (`credit`: short generations add up) (`AdaptiveDepth.depth`). What was timed is written back
into the cache at the end of a generation, so the next one starts where this one stopped.

The depth never depends on the cycle's own draws (timings are of earlier cycles), so the output
distribution stays the target's; a row's tokens at T > 0 depend on the depths, so token-for-token
repeatability needs a fixed table (`SpeculativeDecoder(cost_table=...)`), which is not refined.
"""
import statistics
from typing import Dict, List, Optional, Tuple

from .adaptive import STEADY_UNSEEN, CostTable

__all__ = ["LearnedCosts", "cost_line", "LEARN_BUDGET", "PRIOR_DRAFT_RATIO", "PRIOR_CATCH_UP", "WINDOW"]

# timings kept per (batch size, depth): their median is the cost (a cycle that allocated a new shape,
# or met another process on the machine, moves it by one place, not by its own size)
WINDOW = 9
# the share of the generation's plain decoding time (its remaining tokens at a plain step's cost)
# that learning what drafting costs may risk; the controller's probes have their own PROBE_BUDGET
LEARN_BUDGET = 0.05
# before a drafting cycle has been timed, the most it is assumed to cost, in plain steps at the same
# batch size (measured on 2 CPU cores: 1.3 to 2.7 at batch 1, 3.6 at batch 16, float32 SmolLM2 with
# dblast-k4), and the most a context token the drafter catches up on costs, in plain steps per row
# (measured: 0.003 at batch 1)
PRIOR_DRAFT_RATIO = 4.0
PRIOR_CATCH_UP = 0.01
# a neighbouring batch size's curve stands in for an untimed one within this factor
NEAREST_FACTOR = 2


class LearnedCosts:
    """C(n, d) and the catch-up cost for one decoder's key: the cached `table` refined by the
    timings `record` is given. `tree`: trie verification (one prompt: n = 1)."""

    def __init__(self, table: CostTable, tree: bool, max_depth: int, path: Optional[str] = None):
        self.table, self.tree, self.max_depth, self.path = table, tree, max_depth, path
        self.timings: Dict[Tuple[int, int], List[float]] = {}
        self.catch_ups: Dict[int, List[float]] = {}
        # drafting cycles that also caught up on context, before a steady one at their (n, d) was timed:
        # (seconds, catch-up tokens), resolved into catch-up costs once it is
        self.pending: Dict[Tuple[int, int], List[Tuple[float, int]]] = {}
        # what earlier generations learned counts as one timing each
        learned = table.learned.get("tree" if tree else "chain", {})
        for n, depths in learned.get("costs", {}).items():
            for d, seconds in depths.items():
                if int(d) <= max_depth:
                    self.timings[(int(n), int(d))] = [float(seconds)]
        for n, seconds in learned.get("catch_up", {}).items():
            self.catch_ups[int(n)] = [float(seconds)]
        # seconds of plain steps decoded while learning, by batch size: earlier generations' (the
        # learning budget's share of them is still there to spend) and this one's
        self.credit_before = {int(n): float(c) for n, c in learned.get("credit", {}).items()}
        self.credit_now: Dict[int, float] = {}
        self.changed = False

    # -- what the controller reports
    def record(self, rows: int, depth: int, seconds: float, unseen: int, after_draft: bool) -> None:
        """A cycle at `depth` over `rows` rows took `seconds`; a drafting cycle that was not right
        after another one read `unseen` context tokens, so it also informs the catch-up cost."""
        if not seconds > 0:
            return
        catch_up_tokens = unseen - STEADY_UNSEEN * rows
        if depth > 0 and not after_draft and catch_up_tokens > 0:
            # not a steady cycle: its time is the catch-up's as much as the depth's
            self.pending.setdefault((rows, depth), []).append((seconds, catch_up_tokens))
        else:
            self._keep(self.timings.setdefault((rows, depth), []), seconds)
        steady = self._median(rows, depth)
        if steady is not None:
            for caught_up, tokens in self.pending.pop((rows, depth), []):
                self._keep(self.catch_ups.setdefault(rows, []), max(0.0, caught_up - steady) / tokens)

    def add_credit(self, rows: int, seconds: float) -> None:
        """A plain step decoded while the drafting cost at `rows` was unknown took `seconds`; a
        learning cycle's cost beyond a plain step is passed negative, scaled back by LEARN_BUDGET
        (what it spent of the budget the credit gave)."""
        self.credit_now[rows] = self.credit_now.get(rows, 0.0) + seconds
        self.changed = True

    def credit(self, rows: int) -> float:
        """Seconds of plain steps earlier generations decoded while learning at `rows`: a run of
        short generations, none long enough to afford a learning cycle alone, together can."""
        return self.credit_before.get(rows, 0.0)

    def _keep(self, timings: List[float], seconds: float) -> None:
        timings.append(seconds)
        del timings[:-WINDOW]
        self.changed = True

    def _median(self, rows: int, depth: int) -> Optional[float]:
        timings = self.timings.get((rows, depth))
        return statistics.median(timings) if timings else None

    # -- what the controller asks
    def plain_cost(self, rows: int) -> Optional[float]:
        """C(rows, 0), timed at this batch size (or the table's), or None."""
        curve = self.curve(rows)
        if curve is not None:
            return curve[0]
        return self._median(rows, 0)

    def drafting_cost(self, rows: int, depth: int) -> Optional[float]:
        """What a drafting cycle at (rows, depth) was timed at: the steady median, else the least
        of the cycles that also caught up (an upper bound), else None."""
        steady = self._median(rows, depth)
        if steady is not None:
            return steady
        pending = self.pending.get((rows, depth))
        return min(seconds for seconds, _ in pending) if pending else None

    def curve(self, rows: int) -> Optional[List[float]]:
        """C(rows, d) for d = 0..D, or None where nothing tells what a drafting cycle costs."""
        prior = self._table_curve(rows)
        timed = self._timed_curve(rows, prior)
        if timed is not None:
            return timed
        for n in self._nearest(rows):
            timed = self._timed_curve(n, self._table_curve(n))
            if timed is not None:
                return timed
        return prior

    def catch_up(self, rows: int) -> float:
        """Seconds per context token the drafter catches up on: timed, else the table's."""
        for n in [rows] + self._nearest(rows):
            if self.catch_ups.get(n):
                return statistics.median(self.catch_ups[n])
        if self.tree:
            return self.table.tree_catch_up or 0.0
        return self.table.catch_up(rows)

    def _nearest(self, rows: int) -> List[int]:
        sizes = {n for n, _ in self.timings if n != rows and rows / NEAREST_FACTOR <= n <= rows * NEAREST_FACTOR}
        return sorted(sizes, key=lambda n: (abs(n - rows), -n))

    def _table_curve(self, rows: int) -> Optional[List[float]]:
        if self.tree:
            return list(self.table.tree[: self.max_depth + 1]) if self.table.tree else None
        return self.table.chain_costs(rows)[: self.max_depth + 1] if self.table.chain else None

    def _timed_curve(self, rows: int, prior: Optional[List[float]]) -> Optional[List[float]]:
        medians = {d: self._median(rows, d) for d in range(self.max_depth + 1)}
        medians = {d: m for d, m in medians.items() if m is not None}
        drafting = {d: m for d, m in medians.items() if d > 0}
        if prior is not None:  # the table's shape, scaled to what was timed (plain and drafting apart)
            if not medians:
                return None
            plain = medians.get(0, prior[0] * _ratio(drafting, prior))
            scale = _ratio(drafting, prior) if drafting else plain / prior[0]
            return [plain] + [medians.get(d, prior[d] * scale) for d in range(1, self.max_depth + 1)]
        if 0 not in medians or not drafting:
            return None
        return [medians[0]] + cost_line(drafting, self.max_depth)

    # -- the cache
    def save(self) -> None:
        """Writes what was timed into the table (and its cache file, when it has one)."""
        if not self.changed:
            return
        section = self.table.learned.setdefault("tree" if self.tree else "chain", {})
        costs = section.setdefault("costs", {})
        for (n, d), timings in self.timings.items():
            costs.setdefault(str(n), {})[str(d)] = statistics.median(timings)
        catch_up = section.setdefault("catch_up", {})
        for n, timings in self.catch_ups.items():
            if timings:
                catch_up[str(n)] = statistics.median(timings)
        credit = section.setdefault("credit", {})
        for n, seconds in self.credit_now.items():
            credit[str(n)] = max(0.0, self.credit_before.get(n, 0.0) + seconds)
        if self.path is not None:
            self.table.save(self.path)
        self.changed = False


def _ratio(timed: Dict[int, float], prior: List[float]) -> float:
    """The median of timed / table cost over the depths timed (1 with none)."""
    return statistics.median(m / prior[d] for d, m in timed.items()) if timed else 1.0


def cost_line(timed: Dict[int, float], max_depth: int) -> List[float]:
    """C(d) for d = 1..max_depth on the least-squares line a + b d (b >= 0) through the timed
    drafting depths (a drafter pass plus a cost per verified position); flat at their mean with
    one. Deeper cycles never cost less, and timing noise between depths of nearly equal cost (a
    trie under a node budget) does not decide the depth."""
    depths = sorted(timed)
    mean_d = sum(depths) / len(depths)
    mean_c = sum(timed[d] for d in depths) / len(depths)
    spread = sum((d - mean_d) ** 2 for d in depths)
    slope = max(0.0, sum((d - mean_d) * (timed[d] - mean_c) for d in depths) / spread) if spread else 0.0
    return [max(1e-9, mean_c + slope * (d - mean_d)) for d in range(1, max_depth + 1)]
