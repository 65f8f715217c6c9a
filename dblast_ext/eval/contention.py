"""When a timing is not this machine's own: the rule that calls a timed run contended, from
the foreign load `foreign_load.Stopwatch` measured while it ran."""
from typing import Iterable, Optional

# a timed region during which other processes kept more cores than this busy on average is
# called contended: its timings are not this machine's (a quiet machine shows well under 0.05)
CONTENTION_LIMIT = 0.25


def is_contended(load: Optional[float]) -> bool:
    return load is not None and load > CONTENTION_LIMIT


def contention_warning(loads: Iterable[Optional[float]]) -> str:
    """A warning line when any of a comparison's timed runs (`loads`: their foreign loads) was
    contended; "" otherwise."""
    worst = max((load for load in loads if load is not None), default=None)
    if not is_contended(worst):
        return ""
    return (f"warning: other processes kept up to {worst:.2f} cores busy while this was timed (more than "
            f"{CONTENTION_LIMIT}): the speed-up is not this machine's alone; measure again on idle cores")
