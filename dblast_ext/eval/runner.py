"""Runs a drafter + target over evaluation prompts and writes one record per response,
resumably: responses already in the records file are skipped, so a killed run continues
where it stopped. Every response has its own seed (from the run seed and the response's
key), so a resumed run produces what an uninterrupted one would."""
import zlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..decoding import SpeculativeDecoder
from ..foreign_load import timed
from ..progress import progress_bar
from ..prompts import Prompt, chat_messages
from ..sampling import SamplingParams
from ..target_loading import encode_messages, stop_token_ids
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
    if decoder.verify != "branch":  # likewise
        settings["verify"] = decoder.verify
        if decoder.max_tree_nodes is not None:
            settings["max_tree_nodes"] = decoder.max_tree_nodes
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
                          measure_speedup=measure_speedup, progress=spec.progress)
    return records, settings


def run_prompts(decoder: SpeculativeDecoder, tokenizer, prompts: List[Prompt], records_path: str, *,
                sampling: SamplingParams, max_new_tokens: int, seed: int, settings: dict,
                measure_speedup: bool = False, progress: bool = True,
                on_record: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Generates every turn of every prompt (multi-turn prompts see their own earlier answers)
    and appends the records to `records_path`; returns all records of the prompts given."""
    done = read_done_records(records_path, settings, lambda r: (r["dataset"], r["prompt_id"], r["turn"]))
    stops = stop_token_ids(decoder.target.model, tokenizer)
    total = sum(len(p.turns) for p in prompts)
    bar = progress_bar(total, desc="responses", unit="resp", enabled=progress)
    records = []
    for prompt in prompts:
        answers = []
        for turn in range(len(prompt.turns)):
            key = (prompt.dataset, prompt.prompt_id, turn)
            if key not in done:
                ids = encode_messages(tokenizer, chat_messages(prompt, turn, answers))
                run_seed = response_seed(seed, *key)
                out, timing = timed(decoder.generate, ids, sampling, max_new_tokens=max_new_tokens,
                                    stop_token_ids=stops, seed=run_seed)
                base = (timed(decoder.generate_autoregressive, ids, sampling, max_new_tokens=max_new_tokens,
                              stop_token_ids=stops, seed=run_seed)
                        if measure_speedup else None)
                text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                done[key] = make_record(dataset=prompt.dataset, prompt_id=prompt.prompt_id, turn=turn, output=out,
                                        timing=timing, block_size=decoder.proposer.block_size, settings=settings,
                                        text=text, baseline=base)
                append_record(records_path, done[key])
                if on_record:
                    on_record(done[key])
            answers.append(done[key]["text"])
            records.append(done[key])
            bar.update(1)
    bar.close()
    return records
