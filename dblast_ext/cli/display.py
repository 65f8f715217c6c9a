"""Terminal output shared by the subcommands: the acceptance histogram and run summaries."""
from typing import Sequence


def acceptance_histogram(counts: Sequence[int], width: int = 40) -> str:
    """One line per accepted count n = 0..b (counts[n] cycles; b = B - 1 drafts for block B) with a
    bar, the count and the share; the last line (n = b = B - 1, every draft accepted) is the
    ceiling bin and is marked."""
    num_draft = len(counts) - 1
    total = max(1, sum(counts))
    peak = max(counts) or 1
    lines = []
    for n, count in enumerate(counts):
        bar = "#" * round(width * count / peak)
        mark = "  <- ceiling (n = b = B - 1: all drafts accepted)" if n == num_draft else ""
        lines.append(f"  n={n:>2} {bar:<{width}} {count:>5} {100 * count / total:5.1f}%{mark}")
    return "\n".join(lines)


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds if seconds > 0 else float('inf'):.1f} tok/s)"


def committed_length(accepted: Sequence[int]) -> float:
    """Tokens committed per target pass: accepted drafts + the target's own token, per cycle."""
    return sum(n + 1 for n in accepted) / len(accepted)


def drafting_line(depths) -> str:
    """What the adaptive controller chose over a run's cycles (their `drafts`: 0 is a plain
    target step): how many cycles drafted, and how deep."""
    drafted = [d for d in depths if d]
    if not depths:
        return ""
    if not drafted:
        return f"adaptive drafting: all {len(depths)} passes were plain target steps (drafting did not pay here)"
    return (f"adaptive drafting: {len(drafted)} of {len(depths)} target passes verified drafts, "
            f"{sum(drafted) / len(drafted):.1f} drafts deep on average; {len(depths) - len(drafted)} were plain "
            "target steps (--controller off: every pass verifies the whole block)")


def exactness_line(dtype, temperature: float) -> str:
    """What is exact in this run, said precisely: the distribution always; greedy output equal
    to the target's own one-token steps in float32 only (a verify pass over a block rounds unlike
    a one-token step, and in 16 bits that can flip a near-tie)."""
    name = str(dtype).replace("torch.", "")
    if name == "float32":
        return ("exact: the text follows the target's own distribution"
                + ("; greedy, it is the target's own greedy output token for token" if temperature == 0 else ""))
    return (f"exact: the text follows the target's distribution as its verify pass computes it; in {name} a "
            "pass over a block rounds unlike a one-token step, so a near-tie can resolve differently from the "
            "target's own greedy steps (--dtype float32 matches them token for token)")
