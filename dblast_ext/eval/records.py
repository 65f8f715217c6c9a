"""Evaluation records: one JSONL line per generated response (DESIGN.md, evaluation).

Fields: `prompt_id`, `dataset`, `turn`, `accepted` (n per cycle, 0..b), `expected_accepted`
(per cycle, sum_i prod_{j<=i} A_j), `block_size`, `eos_terminated`, `new_tokens`,
`wall_time`, `ar_wall_time` / `ar_new_tokens` when the target-only run was measured, the
response `text`, and `settings` (the run's flags)."""
import json
import os
from typing import List, Optional

from ..decoding import GenerationOutput


def make_record(*, dataset: str, prompt_id: str, turn: int, output: GenerationOutput, block_size: int,
                settings: dict, text: str, baseline: Optional[GenerationOutput] = None) -> dict:
    record = {
        "dataset": dataset, "prompt_id": str(prompt_id), "turn": turn,
        "accepted": [c.num_accepted for c in output.cycles],
        "expected_accepted": [round(c.expected_accepted, 6) for c in output.cycles],
        "block_size": block_size, "eos_terminated": bool(output.stopped_by_eos),
        "new_tokens": len(output.token_ids), "wall_time": output.wall_time, "text": text, "settings": settings,
    }
    if baseline is not None:
        record.update(ar_wall_time=baseline.wall_time, ar_new_tokens=len(baseline.token_ids))
    return record


def append_record(path: str, record: dict) -> None:
    """One line per record, flushed at once, so an interrupted run keeps what it finished."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str) -> List[dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no records file at {path}")
    records = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                # the last line of a killed run may be cut short: say so instead of failing obscurely
                raise ValueError(f"{path}: line {line_number} is not valid JSON ({e.msg}); "
                                 "delete that line to resume") from None
    return records
