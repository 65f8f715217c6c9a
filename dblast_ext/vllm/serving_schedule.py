"""A per-batch-size speculation schedule for vLLM, measured for the pair: how many drafts a
step should verify when n requests are in flight (0: no drafting), for vLLM's
`num_speculative_tokens_per_batch_size` (a list of [first, last, drafts] ranges, in vLLM
builds that have it). vLLM's engine cannot take the package's adaptive controller, but it can
take the controller's decision as a function of the batch size, from the same two measurements:

- the cost of a cycle at each depth and batch size (the controller's cost table, measured on
  this machine with the pair; dblast_ext.decoding.cost_calibration), and
- the pair's conditional acceptance at each draft position, measured with every cycle
  verifying the whole block on the built-in demo prompts at temperature 0;

drafts(n) = argmax_d E(d) / C(n, d) (dblast_ext.decoding.adaptive), capped at the drafts per step the
server was asked for (and, as the controller decides, a depth between 0 and the cap only where it
is expected to be faster than the cap by more than adaptive.DEPARTURE_MARGIN). Measured once per
machine, pair and settings and cached beside the cost tables.
"""
import hashlib
import json
import math
import os
from typing import List, Optional, Sequence

from ..decoding.adaptive import CostTable, FixedDepth, chosen_depth, cost_cache_root, expected_committed, machine_description

__all__ = ["batch_schedule", "measure_acceptance", "pair_schedule", "vllm_has_batch_schedule", "MAX_SCHEDULED_BATCH"]

# the schedule covers batch sizes 1..MAX_SCHEDULED_BATCH; its last range runs to vLLM's limits
MAX_SCHEDULED_BATCH = 256
SCHEDULE_BATCH_SIZES = (1, 2, 4, 8, 16)  # timed; larger batches are extrapolated in proportion to the rows
ACCEPTANCE_TOKENS = 64


def batch_schedule(table: CostTable, acceptance: Sequence[float], max_drafts: int,
                   max_batch: int = MAX_SCHEDULED_BATCH) -> List[List[int]]:
    """[[first, last, drafts], ...]: for every batch size n in 1..max_batch the depth d <=
    max_drafts of the most expected committed tokens per second, E(d) / C(n, d) (0 < d < max_drafts
    only where faster than max_drafts by more than DEPARTURE_MARGIN), in ranges
    of equal depth (the last one open-ended: up to 2**31 - 1)."""
    if max_drafts < 1:
        raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
    if len(acceptance) < max_drafts or not all(0 <= a <= 1 for a in acceptance[:max_drafts]):
        raise ValueError(f"acceptance must give a rate in [0, 1] for each of the {max_drafts} positions, got "
                         f"{list(acceptance)}")
    ranges: List[List[int]] = []
    for n in range(1, max_batch + 1):
        costs = table.chain_costs(n)
        deepest = min(max_drafts, len(costs) - 1)
        depth = chosen_depth([expected_committed(acceptance, d) / costs[d] for d in range(deepest + 1)])
        if ranges and ranges[-1][2] == depth:
            ranges[-1][1] = n
        else:
            ranges.append([n, n, depth])
    ranges[-1][1] = 2 ** 31 - 1
    return ranges


class _Observing(FixedDepth):
    """Every cycle verifies the whole block; the acceptance the cycles report is kept."""

    def __init__(self):
        super().__init__()
        self.seen: List[List[float]] = []

    def observe(self, depth, acceptance) -> None:
        self.seen += [list(row) for row in acceptance]


def measure_acceptance(decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int = ACCEPTANCE_TOKENS,
                       stop_token_ids: Optional[Sequence[int]] = None) -> List[float]:
    """The mean conditional acceptance at each draft position over greedy responses to
    `prompts`, every cycle verifying the whole block (`decoder`'s own controller is put back)."""
    from ..sampling import SamplingParams

    observing, before = _Observing(), decoder.controller
    decoder.controller = observing
    try:
        for prompt in prompts:
            decoder.generate(prompt, SamplingParams(temperature=0.0), max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids)
    finally:
        decoder.controller = before
    drafts = decoder.proposer.block_size - 1
    rates = []
    for j in range(drafts):
        values = [row[j] for row in observing.seen if len(row) > j and not math.isnan(row[j])]
        rates.append(sum(values) / len(values) if values else 0.0)
    return rates


def vllm_has_batch_schedule() -> bool:
    """Whether the installed vLLM's speculative config takes num_speculative_tokens_per_batch_size."""
    try:
        import dataclasses

        from vllm.config import SpeculativeConfig
    except Exception:  # no vLLM, or one that does not import here
        return False
    try:
        names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    except TypeError:
        names = set(getattr(SpeculativeConfig, "model_fields", {}) or vars(SpeculativeConfig))
    return "num_speculative_tokens_per_batch_size" in names


def _schedule_path(target: str, drafter: str, max_drafts: int, device: str) -> str:
    def digest(path):  # the checkpoint's config and the size and age of its files
        parts = []
        for root, _, files in os.walk(path):
            for name in sorted(files):
                stat = os.stat(os.path.join(root, name))
                parts.append(f"{name}:{stat.st_size}:{int(stat.st_mtime)}")
        return parts

    key = json.dumps([machine_description(), device, os.path.abspath(target), digest(target),
                      os.path.abspath(drafter), digest(drafter), max_drafts])
    return os.path.join(cost_cache_root(), f"schedule-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def pair_schedule(target_dir: str, drafter_dir: str, max_drafts: int, device: Optional[str] = None,
                  progress: bool = True) -> List[List[int]]:
    """The schedule for serving `drafter_dir` with `target_dir` (local directories), measured with
    the package's own decode loop on `device` (default: CUDA where available) the first time and
    cached; see the module docstring."""
    import sys

    path = _schedule_path(target_dir, drafter_dir, max_drafts, device or "default")
    try:
        with open(path) as f:
            return json.load(f)["schedule"]
    except (OSError, ValueError, KeyError):
        pass
    from ..prompts import DEMO_PROMPTS
    from ..decoding.cost_calibration import calibrate_costs
    from ..decoding.decoder import SpeculativeDecoder
    from ..drafting.drafter_io import load_drafter
    from ..target.loading import default_device, encode_messages, load_target, stop_token_ids

    if progress:
        print("dblast: measuring the pair's cycle costs and acceptance for vLLM's batch-size schedule (once)",
              file=sys.stderr)
    target, tokenizer = load_target(target_dir, device=device or default_device(), progress=False)
    drafter = load_drafter(drafter_dir, target=target).to(device=target.device, dtype=target.dtype).eval()
    drafter.config.block_size = max_drafts + 1  # what vLLM drafts per step
    decoder = SpeculativeDecoder(target, drafter, category_temperature=0.0, controller="off")
    table = calibrate_costs(decoder, SCHEDULE_BATCH_SIZES, tree=False)
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": text}]) for text in DEMO_PROMPTS]
    acceptance = measure_acceptance(decoder, prompts, stop_token_ids=stop_token_ids(target, tokenizer))
    schedule = batch_schedule(table, acceptance, max_drafts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"schedule": schedule, "acceptance": acceptance, "costs": table.to_json()}, f, indent=1)
    return schedule
