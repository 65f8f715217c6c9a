"""Runs a drafter + target over evaluation prompts and writes one record per response,
resumably: responses already in the records file are skipped, so a killed run continues
where it stopped. Every response has its own seed (from the run seed and the response's
key), so a resumed run produces what an uninterrupted one would."""
import zlib
from typing import Callable, List, Optional

from ..decoding import SamplingParams, SpeculativeDecoder
from ..progress import progress_bar
from ..target_loading import encode_messages, stop_token_ids
from .datasets import Prompt, chat_messages
from .records import append_record, make_record, read_done_records


def response_seed(seed: int, dataset: str, prompt_id: str, turn: int) -> int:
    return zlib.crc32(f"{seed}/{dataset}/{prompt_id}/{turn}".encode())


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
                out = decoder.generate(ids, sampling, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                       seed=run_seed)
                base = (decoder.generate_autoregressive(ids, sampling, max_new_tokens=max_new_tokens,
                                                        stop_token_ids=stops, seed=run_seed)
                        if measure_speedup else None)
                text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                done[key] = make_record(dataset=prompt.dataset, prompt_id=prompt.prompt_id, turn=turn, output=out,
                                        block_size=decoder.drafter.config.block_size, settings=settings,
                                        text=text, baseline=base)
                append_record(records_path, done[key])
                if on_record:
                    on_record(done[key])
            answers.append(done[key]["text"])
            records.append(done[key])
            bar.update(1)
    bar.close()
    return records
