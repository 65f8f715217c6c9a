"""Runs a drafter + target over evaluation prompts and writes one record per response,
resumably: responses already in the records file are skipped, so a killed run continues
where it stopped. Every response has its own seed (from the run seed and the response's
key), so a resumed run produces what an uninterrupted one would."""
import os
import zlib
from typing import Callable, List, Optional

from ..decoding import SamplingParams, SpeculativeDecoder
from ..target_loading import stop_token_ids
from .datasets import Prompt, chat_messages
from .records import append_record, make_record, read_records


def response_seed(seed: int, dataset: str, prompt_id: str, turn: int) -> int:
    return zlib.crc32(f"{seed}/{dataset}/{prompt_id}/{turn}".encode())


def encode_chat(tokenizer, messages: List[dict]) -> List[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    # no template (a base model): the user turns as plain text
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


def run_prompts(decoder: SpeculativeDecoder, tokenizer, prompts: List[Prompt], records_path: str, *,
                sampling: SamplingParams, max_new_tokens: int, seed: int, settings: dict,
                measure_speedup: bool = False, progress: bool = True,
                on_record: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Generates every turn of every prompt (multi-turn prompts see their own earlier answers)
    and appends the records to `records_path`; returns all records of the prompts given."""
    done = {}
    if os.path.isfile(records_path):
        for r in read_records(records_path):
            if r.get("settings") != settings:
                raise ValueError(f"{records_path} holds records made with other settings ({r.get('settings')}); "
                                 f"use another output directory or delete it (this run: {settings})")
            done[(r["dataset"], r["prompt_id"], r["turn"])] = r
    stops = stop_token_ids(decoder.target.model, tokenizer)
    total = sum(len(p.turns) for p in prompts)
    bar = _progress(total, progress)
    records = []
    for prompt in prompts:
        answers = []
        for turn in range(len(prompt.turns)):
            key = (prompt.dataset, prompt.prompt_id, turn)
            if key not in done:
                ids = encode_chat(tokenizer, chat_messages(prompt, turn, answers))
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


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="responses", unit="resp")
