"""Target-block early determinism (DBLast Appendix C, Eq 22-24) and accepted length binned
by it (DBLast Figure 1).

D_b(y) = E_{x ~ p(.|y)} [ (1/b) sum_j prod_{i<=j} p(x_i | y, x_<i) ] averages the collision
probabilities of the first 1..b target-prefix distributions: near 1 when the continuation is
nearly forced, near 0 when many continuations are plausible. It is estimated from M blocks
sampled from the target's filtered distribution (Eq 24).

`dblast diagnose determinism` measures both at truncation points of the target's own
responses; `target_responses` and `determinism_points` keep each response and point as one
line of a file as soon as it is done, so a rerun into the same folder resumes."""
import json
import os
import random
import sys
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import reference
from ..decoding.decoder import SpeculativeDecoder
from ..sampling import SamplingParams
from ..target.adapter import TargetAdapter
from ..jsonl import read_jsonl
from ..progress import progress_bar
from ..target.loading import encode_messages, stop_token_ids
from ..prompts import Prompt, chat_messages
from .records import append_record, read_done_records
from .report import plot_determinism
from .runner import response_seed, run_settings

BIN_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@torch.inference_mode()
def early_determinism(target: TargetAdapter, prefix_ids: Sequence[int], sampling: SamplingParams,
                      num_draft: int, samples: int, generator: torch.Generator) -> float:
    """Eq 24: (1 / (M b)) sum_m sum_j prod_{i<=j} p(x_i^(m) | y, x_<i^(m)), the M blocks of
    b tokens sampled from the filtered target, all M continued together in one batch."""
    if num_draft < 1 or samples < 1:
        raise ValueError(f"num_draft and samples must be >= 1, got {num_draft} and {samples}")
    device = target.device
    ids = torch.tensor([list(prefix_ids)] * samples, device=device)
    cache = target.new_cache()
    logits, _ = target.forward(ids, cache, hidden_states=False, last_logits_only=True)
    running = torch.ones(samples, dtype=torch.float64)
    total = torch.zeros(samples, dtype=torch.float64)
    for _ in range(num_draft):
        probs = reference.filter_target_probs(logits[:, -1].float().cpu(), **sampling.kwargs()).double()
        tokens = torch.multinomial(probs, 1, generator=generator)
        running = running * probs.gather(1, tokens).view(-1)
        total += running
        logits, _ = target.forward(tokens.to(device), cache, hidden_states=False)
    return float(total.sum() / (samples * num_draft))


def bin_by_determinism(determinism: Sequence[float], values: Sequence[float],
                       edges: Sequence[float] = BIN_EDGES) -> List[Dict]:
    """Per bin (lo, hi] (the first also holds 0): count, mean value and its standard error."""
    d, v = np.asarray(determinism, dtype=float), np.asarray(values, dtype=float)
    rows = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        inside = (d > lo) & (d <= hi) if k else (d >= lo) & (d <= hi)
        n = int(inside.sum())
        mean = float(v[inside].mean()) if n else None
        sem = float(v[inside].std(ddof=1) / np.sqrt(n)) if n > 1 else None
        rows.append({"bin": [lo, hi], "count": n, "mean": mean, "sem": sem})
    return rows


def read_lines(path: str) -> List[dict]:
    return [value for _, value in read_jsonl(path, "determinism")]


def target_responses(decoder: SpeculativeDecoder, tokenizer, prompts: Sequence[Prompt], path: str, *,
                     sampling: SamplingParams, max_new_tokens: int, seed: int, stop_token_ids: Sequence[int],
                     settings: dict, progress: bool = True) -> List[Tuple[List[int], List[int]]]:
    """(prompt ids, anchors) per prompt whose response has any: the target alone answers each
    prompt's first turn with the seed `dblast eval` gives that turn; the anchors are the
    response's tokens up to its stop token, which is never one (nothing is drafted after the
    end of a response). One line per prompt in `path`; prompts already there are not rerun."""
    done = read_done_records(path, settings, lambda r: (r["dataset"], r["prompt_id"]), read=read_lines)
    responses = []
    bar = progress_bar(len(prompts), desc="target responses", unit="resp", enabled=progress)
    for prompt in prompts:
        ids = encode_messages(tokenizer, chat_messages(prompt))
        key = (prompt.dataset, str(prompt.prompt_id))
        if key not in done:
            out = decoder.generate_autoregressive(ids, sampling, max_new_tokens=max_new_tokens,
                                                  stop_token_ids=stop_token_ids,
                                                  seed=response_seed(seed, prompt.dataset, prompt.prompt_id, 0))
            anchors = out.token_ids[:-1] if out.stopped_by_eos else out.token_ids
            done[key] = {"dataset": key[0], "prompt_id": key[1], "anchors": list(anchors), "settings": settings}
            append_record(path, done[key])
        bar.update(1)
        if done[key]["anchors"]:
            responses.append((ids, done[key]["anchors"]))
    bar.close()
    if not responses:
        raise ValueError("every target response stopped at once: no anchor to truncate at")
    return responses


def point_seed(seed: int, index: int, stream: str) -> int:
    """The seed of one random stream ("blocks": the M target blocks, "cycle": the drafter's
    cycle) of truncation point `index`: each point has its own, so a resumed run samples what
    an uninterrupted one would, and no point shares a stream with another point or run seed."""
    return zlib.crc32(f"{seed}/determinism/{index}/{stream}".encode())


def first_cycle_at(decoder: SpeculativeDecoder, prefix: Sequence[int], sampling: SamplingParams, seed: int,
                   index: int) -> dict:
    """The expected and sampled accepted length of `decoder`'s first cycle after `prefix`, the
    prefix of truncation point `index`, drawn from that point's "cycle" stream (so every drafter
    measured at a point meets the same random numbers there)."""
    cycle = decoder.first_cycle(prefix, sampling, seed=point_seed(seed, index, "cycle"))
    return {"expected_accepted": cycle.expected_accepted, "accepted": cycle.num_accepted}


def determinism_points(decoder: SpeculativeDecoder, responses: Sequence[Tuple[List[int], List[int]]], path: str, *,
                       sampling: SamplingParams, truncations: int, samples: int, seed: int, settings: dict,
                       progress: bool = True) -> List[dict]:
    """At each of `truncations` seeded random points of `responses` (a response, then an anchor
    in it): the target block's early determinism from `samples` blocks (Eq 24) and the expected
    and sampled accepted length of the drafter's first cycle there. One line per point in
    `path`; points already there are not recomputed (the points drawn do not depend on
    `truncations`, so a larger one extends a finished run)."""
    done = read_done_records(path, settings, lambda r: r["index"], read=read_lines)
    num_draft = decoder.proposer.block_size - 1
    rng = random.Random(seed)
    points = []
    for k in range(truncations):
        which = rng.randrange(len(responses))
        ids, anchors = responses[which]
        cut = rng.randrange(len(anchors))  # the anchor is anchors[cut]
        if k in done and (done[k]["response"], done[k]["cut"]) != (which, cut):
            raise ValueError(f"{path}: point {k} was drawn at response {done[k]['response']}, anchor {done[k]['cut']}; "
                             f"this run draws response {which}, anchor {cut}: use another output directory")
        if k not in done:
            prefix = ids + anchors[: cut + 1]
            generator = torch.Generator().manual_seed(point_seed(seed, k, "blocks"))
            d = early_determinism(decoder.target, prefix, sampling, num_draft, samples, generator)
            done[k] = {"index": k, "response": which, "cut": cut, "determinism": d,
                       **first_cycle_at(decoder, prefix, sampling, seed, k), "settings": settings}
            append_record(path, done[k])
        points.append({key: value for key, value in done[k].items() if key != "settings"})
        if progress and (k + 1) % max(1, truncations // 10) == 0:
            print(f"determinism: {k + 1}/{truncations} truncation points", file=sys.stderr)
    return points


def baseline_points(decoder: SpeculativeDecoder, responses: Sequence[Tuple[List[int], List[int]]],
                    points: Sequence[dict], path: str, *, sampling: SamplingParams, seed: int, settings: dict,
                    progress: bool = True) -> List[dict]:
    """A second drafter (`decoder`, e.g. the K = 1 baseline) at the truncation points `points`
    of `determinism_points`: its first cycle at each point's prefix, from the point's own cycle
    seed, so both arms are measured on the same prefixes and their determinism bins hold the
    same points (DBLast Figure 1 compares them bin by bin). One line per point in `path`;
    points already there are not recomputed."""
    done = read_done_records(path, settings, lambda r: r["index"], read=read_lines)
    out = []
    for n, point in enumerate(points):
        k, which, cut = point["index"], point["response"], point["cut"]
        if k in done and (done[k]["response"], done[k]["cut"]) != (which, cut):
            raise ValueError(f"{path}: point {k} is at response {done[k]['response']}, anchor {done[k]['cut']}, "
                             f"the drafter's at response {which}, anchor {cut}: use another output directory")
        if k not in done:
            ids, anchors = responses[which]
            done[k] = {"index": k, "response": which, "cut": cut,
                       **first_cycle_at(decoder, ids + anchors[: cut + 1], sampling, seed, k), "settings": settings}
            append_record(path, done[k])
        out.append({key: value for key, value in done[k].items() if key != "settings"})
        if progress and (n + 1) % max(1, len(points) // 10) == 0:
            print(f"determinism, baseline: {n + 1}/{len(points)} truncation points", file=sys.stderr)
    return out


def relative_gain(mean: Optional[float], baseline: Optional[float]) -> Optional[float]:
    """(mean - baseline) / baseline, the per-bin annotation of DBLast Figure 1; None where either
    bin is empty or the baseline accepts nothing there."""
    if mean is None or baseline is None or baseline <= 0:
        return None
    return (mean - baseline) / baseline


def determinism_table(arms, gains=None) -> str:
    """Per determinism bin: the points, each arm's mean expected accepted length +- its standard
    error, and with a baseline (the second arm) the first arm's relative gain over it (`gains`)."""
    def cell(b):
        if b["mean"] is None:
            return "-"
        return f"{b['mean']:.3f}" + (f" +- {b['sem']:.3f}" if b["sem"] is not None else "")
    header = ["early determinism", "truncation points"] + [f"{name}: mean expected accepted" for name, _ in arms]
    if gains is not None:
        header.append(f"gain of {arms[0][0]}")
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for k, b in enumerate(arms[0][1]):
        row = [f"({b['bin'][0]:.1f}, {b['bin'][1]:.1f}]", str(b["count"])] + [cell(bins[k]) for _, bins in arms]
        if gains is not None:
            row.append("-" if gains[k] is None else f"{100 * gains[k]:+.0f}%")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


@dataclass
class Baseline:
    """A second drafter measured at the same truncation points (DBLast Figure 1)."""

    decoder: SpeculativeDecoder
    label: str           # its name in tables and plots
    drafter: str         # its name in the records' settings
    drafter_digest: str


def determinism_study(decoder: SpeculativeDecoder, tokenizer, prompts: Sequence[Prompt], out_dir: str, spec,
                      *, category_temperature: float, truncations: int, samples: int, label: str,
                      settings_extra: dict, baseline: Optional[Baseline] = None, arguments: Optional[dict] = None):
    """The determinism diagnostic end to end, resumable under `out_dir`: the target's responses
    to `prompts`, `truncations` points in them with their early determinism (`samples` target
    blocks each) and the drafter's first cycle there, binned; with a `baseline`, its first cycles
    at the same points and the drafter's relative gain per bin. Writes determinism.json and
    determinism.png; returns (the result, [(label, bins)] per arm, the gains or None).
    `spec`: the run's eval.runner.RunSpec; `settings_extra`: what else the responses and points
    depend on (they resume only with equal settings); `arguments`: recorded as the run's."""
    sampling = spec.sampling
    settings = dict(run_settings(decoder, spec, category_temperature, measure_speedup=False), **settings_extra)
    responses = target_responses(decoder, tokenizer, prompts, os.path.join(out_dir, "responses.jsonl"),
                                 sampling=sampling, max_new_tokens=spec.max_new_tokens, seed=spec.seed,
                                 stop_token_ids=stop_token_ids(decoder.target.model, tokenizer), settings=settings,
                                 progress=spec.progress)
    points = determinism_points(decoder, responses, os.path.join(out_dir, "points.jsonl"), sampling=sampling,
                                truncations=truncations, samples=samples, seed=spec.seed, settings=settings,
                                progress=spec.progress)
    determinism = [p["determinism"] for p in points]
    arms = [(label, bin_by_determinism(determinism, [p["expected_accepted"] for p in points]))]
    result = {"settings": arguments or {}, "bins": arms[0][1], "points": points}
    gains = None  # the drafter's relative gain over the baseline per bin, when there is one
    if baseline is not None:
        baseline_settings = dict(settings, drafter=baseline.drafter, drafter_digest=baseline.drafter_digest,
                                 branches=baseline.decoder.proposer.num_branches)
        others = baseline_points(baseline.decoder, responses, points, os.path.join(out_dir, "baseline_points.jsonl"),
                                 sampling=sampling, seed=spec.seed, settings=baseline_settings, progress=spec.progress)
        arms.append((baseline.label, bin_by_determinism(determinism, [p["expected_accepted"] for p in others])))
        gains = [relative_gain(a["mean"], b["mean"]) for a, b in zip(arms[0][1], arms[1][1])]
        result["baseline"] = {"drafter": baseline.drafter, "bins": arms[1][1], "points": others, "gains": gains}
    with open(os.path.join(out_dir, "determinism.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    plot_determinism(os.path.join(out_dir, "determinism.png"), arms, gains)
    return result, arms, gains
