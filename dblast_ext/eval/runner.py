"""Runs a drafter + target over evaluation prompts and writes one record per response,
resumably: responses already in the records file are skipped, so a killed run continues
where it stopped. Every response has its own seed (from the run seed and the response's
key), so a resumed run produces what an uninterrupted one would. With a batch size above 1 the
prompts' responses are generated several at once (`SpeculativeDecoder.generate_batch`): each
row's tokens are those it gets alone, up to floating-point rounding in batched products, and
its `wall_time` is its share of the batch's (the batch's divided by its rows)."""
import zlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..decoding.decoder import SpeculativeDecoder
from ..foreign_load import Timing, timed
from ..progress import progress_bar
from ..prompts import Prompt, chat_messages
from ..sampling import SamplingParams
from ..target.loading import encode_messages, stop_token_ids
from .records import append_record, make_record, read_done_records


@dataclass
class RunSpec:
    """What a run's records are made with, besides the decoder and Z_T: the names its settings
    record for the target and drafter (and the drafter's checkpoint digest), the filter, the
    length limit and the run seed; and whether it shows progress."""

    target: str
    drafter: str
    drafter_digest: str
    sampling: SamplingParams
    max_new_tokens: int
    seed: int
    progress: bool = True
    batch_size: int = 1


def response_seed(seed: int, dataset: str, prompt_id: str, turn: int) -> int:
    return zlib.crc32(f"{seed}/{dataset}/{prompt_id}/{turn}".encode())


def run_settings(decoder: SpeculativeDecoder, spec: RunSpec, category_temperature: float,
                 measure_speedup: bool) -> dict:
    """The `settings` of every record of a run: a resumed run must match them exactly."""
    s = spec.sampling
    settings = {"target": spec.target, "drafter": spec.drafter, "drafter_digest": spec.drafter_digest,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                "branches": decoder.proposer.num_branches, "block_size": decoder.proposer.block_size,
                "category_temperature": category_temperature, "max_new_tokens": spec.max_new_tokens,
                "seed": spec.seed, "measure_speedup": measure_speedup, "kernels": decoder.use_kernels}
    if decoder.draft_ids is not None:  # only when set: records made before the option resume as they are
        settings["draft_vocab"] = len(decoder.draft_ids)
    if spec.batch_size != 1:  # likewise; wall times are then shares of a batch's
        settings["batch_size"] = spec.batch_size
    if decoder.controller != "off":  # likewise: runs made before the adaptive controller verified every draft
        settings["controller"] = decoder.controller if isinstance(decoder.controller, str) else type(
            decoder.controller).__name__
    if decoder.verify != "branch":  # likewise
        settings["verify"] = decoder.verify
        if decoder.max_tree_nodes is not None:
            settings["max_tree_nodes"] = decoder.max_tree_nodes
        if decoder.extra_leaves:  # likewise: runs made before extra leaves had none
            settings["extra_leaves"] = decoder.extra_leaves
    # where the target runs changes timings (and numerics): a resumed run must not pool two.
    # Recorded where they differ from a CPU float32 run, so records made before they were (all
    # CPU, float32) resume as they are
    model = decoder.target.model
    if model.dtype != torch.float32:
        settings["dtype"] = str(model.dtype).removeprefix("torch.")
    if decoder.target.device.type != "cpu":
        settings["device"] = decoder.target.device.type
    return settings


def evaluate(decoder: SpeculativeDecoder, tokenizer, prompts: List[Prompt], records_path: str, spec: RunSpec, *,
             category_temperature: float, measure_speedup: bool = False) -> Tuple[List[dict], dict]:
    """The records of `prompts` at category temperature Z_T (made where `records_path` lacks
    them; with `measure_speedup`, each response is timed against the target alone after a
    warm-up), and the run's settings."""
    decoder.category_temperature = category_temperature
    settings = run_settings(decoder, spec, category_temperature, measure_speedup)
    if measure_speedup and prompts:
        decoder.warm_up(encode_messages(tokenizer, chat_messages(prompts[0])), spec.sampling)
    records = run_prompts(decoder, tokenizer, prompts, records_path, sampling=spec.sampling,
                          max_new_tokens=spec.max_new_tokens, seed=spec.seed, settings=settings,
                          measure_speedup=measure_speedup, progress=spec.progress, batch_size=spec.batch_size)
    return records, settings


def check_batch_size(batch_size: int, measure_speedup: bool, verify: str) -> None:
    """A batch size the run can use: speed-ups time every response alone, and trie verification
    takes one prompt at a time."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > 1 and measure_speedup:
        raise ValueError(f"batch_size {batch_size}: measuring the speed-up times every response alone "
                         "(batch_size 1)")
    if batch_size > 1 and verify != "branch":
        raise ValueError(f"batch_size {batch_size}: trie verification takes one prompt at a time (batch_size 1)")


def run_prompts(decoder: SpeculativeDecoder, tokenizer, prompts: List[Prompt], records_path: str, *,
                sampling: SamplingParams, max_new_tokens: int, seed: int, settings: dict,
                measure_speedup: bool = False, progress: bool = True, batch_size: int = 1,
                on_record: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Generates every turn of every prompt, `batch_size` responses at a time, and appends the
    records to `records_path`; returns all records of the prompts given (prompt order, then
    turn). Turn t of every prompt comes before turn t + 1 of any: a multi-turn prompt sees
    its own earlier answers."""
    check_batch_size(batch_size, measure_speedup, decoder.verify)
    key_of = lambda prompt, turn: (prompt.dataset, prompt.prompt_id, turn)  # noqa: E731
    done = read_done_records(records_path, settings, lambda r: (r["dataset"], r["prompt_id"], r["turn"]))
    stops = stop_token_ids(decoder.target.model, tokenizer)
    keys = [key_of(p, t) for p in prompts for t in range(len(p.turns))]
    bar = progress_bar(len(keys), initial=sum(k in done for k in keys), desc="responses", unit="resp",
                       enabled=progress)
    for turn in range(max((len(p.turns) for p in prompts), default=0)):
        todo = [p for p in prompts if turn < len(p.turns) and key_of(p, turn) not in done]
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            ids = [encode_messages(tokenizer, chat_messages(p, turn, [done[key_of(p, t)]["text"] for t in range(turn)]))
                   for p in batch]
            seeds = [response_seed(seed, *key_of(p, turn)) for p in batch]
            run_kwargs = dict(max_new_tokens=max_new_tokens, stop_token_ids=stops)
            if len(batch) == 1:
                out, timing = timed(decoder.generate, ids[0], sampling, seed=seeds[0], **run_kwargs)
                outs = [out]
            else:
                outs, timing = timed(decoder.generate_batch, ids, sampling, seeds=seeds, **run_kwargs)
                timing = Timing(timing.wall_time / len(batch), timing.foreign_load)
            for prompt, prompt_ids, run_seed, out in zip(batch, ids, seeds, outs):
                base = (timed(decoder.generate_autoregressive, prompt_ids, sampling, seed=run_seed, **run_kwargs)
                        if measure_speedup else None)
                key = key_of(prompt, turn)
                text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                done[key] = make_record(dataset=prompt.dataset, prompt_id=prompt.prompt_id, turn=turn, output=out,
                                        timing=timing, block_size=decoder.proposer.block_size, settings=settings,
                                        text=text, baseline=base)
                append_record(records_path, done[key])
                if on_record:
                    on_record(done[key])
                bar.update(1)
    bar.close()
    return [done[k] for k in keys]
