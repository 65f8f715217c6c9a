"""One test procedure for the decode loop's distribution tests, with its power computed exactly.

The loop commits tokens x_1..x_L (L = 2 or 3) whose exact joint p(x_1..x_L) the tests enumerate
on a tiny vocabulary. The *cells* of the test are the entries of every marginal of that joint
over a non-empty set of positions: each position's token, each pair of positions, the triple.
The procedure, at family-wise level ALPHA (Bonferroni over everything it tests):
- a count on a token outside the target's support fails outright;
- every cell of probability >= MIN_CELL gets an exact two-sided binomial test;
- every marginal also gets a chi-square goodness of fit (the small cells' pooled check).
The power is that of the binomial test alone on one cell whose probability is off by a relative
error r (either way), the rest of the procedure ignored: a lower bound on the chance that a loop
with that bias fails, computed from binomial tails with no simulation. The power of a test is
the least over its cells of probability >= MIN_CELL, for the exact joint it tests.
"""
import itertools
from dataclasses import dataclass
from typing import List

import numpy as np
from scipy import stats

from losslessness import chi_square_pvalue

ALPHA = 1e-4          # a correct loop fails a test with probability at most this, whatever its seeds
MIN_CELL = 0.05       # the power is stated for every cell at least this likely
SUBTLE, GROSS = 0.10, 0.50   # the relative errors the slow and the fast tier must detect
REQUIRED_POWER = 0.90


def marginals(joint: np.ndarray):
    """(positions, marginal array) for every non-empty set of positions of `joint`."""
    length = joint.ndim
    for size in range(1, length + 1):
        for keep in itertools.combinations(range(length), size):
            yield keep, joint.sum(axis=tuple(a for a in range(length) if a not in keep))


@dataclass
class Plan:
    """What the procedure tests for one exact joint: the cells (positions, index, probability)
    of probability >= MIN_CELL and the per-test level."""
    cells: List[tuple]
    num_marginals: int

    @property
    def level(self) -> float:
        return ALPHA / (len(self.cells) + self.num_marginals)


def plan(exact: np.ndarray) -> Plan:
    cells, count = [], 0
    for keep, marginal in marginals(exact):
        count += 1
        for index in zip(*np.nonzero(marginal >= MIN_CELL)):
            cells.append((keep, tuple(int(i) for i in index), float(marginal[index])))
    return Plan(cells, count)


def rejection_region(samples: int, p: float, level: float):
    """(lo, hi): a count <= lo or >= hi rejects Binomial(samples, p) at two-sided `level`
    (each tail at most level / 2)."""
    lo = int(stats.binom.ppf(level / 2, samples, p)) - 1
    while stats.binom.cdf(lo + 1, samples, p) <= level / 2:
        lo += 1
    while lo >= 0 and stats.binom.cdf(lo, samples, p) > level / 2:
        lo -= 1
    hi = int(stats.binom.isf(level / 2, samples, p)) + 1
    while hi > 0 and stats.binom.sf(hi - 2, samples, p) <= level / 2:
        hi -= 1
    while stats.binom.sf(hi - 1, samples, p) > level / 2:
        hi += 1
    return lo, hi


def cell_power(samples: int, p: float, level: float, relative: float) -> float:
    """The chance that the cell's binomial test rejects when the cell's true probability is
    p * (1 + relative) or p * (1 - relative): the lesser of the two."""
    lo, hi = rejection_region(samples, p, level)
    powers = []
    for biased in (p * (1 + relative), p * (1 - relative)):
        if biased > 1:
            continue
        powers.append(stats.binom.cdf(lo, samples, biased) + stats.binom.sf(hi - 1, samples, biased))
    return float(min(powers))


def power(exact: np.ndarray, samples: int, relative: float) -> float:
    """The test's power against a relative error `relative` on its least detectable cell of
    probability >= MIN_CELL."""
    test = plan(exact)
    assert test.cells, "no cell of probability >= MIN_CELL: the test would state no power"
    return min(cell_power(samples, p, test.level, relative) for _, _, p in test.cells)


def failures(counts: np.ndarray, exact: np.ndarray) -> List[str]:
    """What the procedure finds wrong with `counts` (one count per joint cell) against `exact`:
    empty when it accepts. Every position is tested, however rare."""
    samples = int(counts.sum())
    found = []
    outside = counts[exact == 0].sum()
    if outside:
        found.append(f"{int(outside)} samples on tokens outside the target's support")
    test = plan(exact)
    observed = dict(marginals(counts))
    for keep, index, p in test.cells:
        lo, hi = rejection_region(samples, p, test.level)
        n = observed[keep][index]
        if n <= lo or n >= hi:
            found.append(f"positions {keep} cell {index}: {int(n)} of {samples}, expected {p * samples:.0f} "
                         f"(accepted range {lo + 1}..{hi - 1})")
    for keep, marginal in marginals(exact):
        pvalue = chi_square_pvalue(observed[keep].ravel(), marginal.ravel() * samples)
        if pvalue <= test.level:
            found.append(f"positions {keep}: chi-square p = {pvalue:.2e} <= {test.level:.1e}")
    return found


def assert_follows(counts: np.ndarray, exact: np.ndarray) -> None:
    found = failures(counts, exact)
    assert not found, "; ".join(found)


def assert_rejects(counts: np.ndarray, exact: np.ndarray) -> None:
    """A negative control: the procedure must find the planted bias."""
    assert failures(counts, exact), "the test procedure accepted a loop with a planted bias"
