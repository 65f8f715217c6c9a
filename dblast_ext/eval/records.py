"""Evaluation records: one JSONL line per generated response (docs/evaluation.md).

Fields: `prompt_id`, `dataset`, `turn`, `accepted` (n per cycle, 0..b: the cycle committed n + 1
tokens, so a response's last cycle counts only the tokens it kept), `expected_accepted`
(per cycle, sum_i prod_{j<=i} A_j over the whole draft, a cut last cycle included), `block_size`, `eos_terminated`, `new_tokens`,
`wall_time`, `tree_nodes` (per cycle, with trie verification: the draft nodes the pass scored),
`branch_rule_expected` (per cycle, trie verification: the expected accepted drafts greedy-branch
verification would have had on the same proposal and target distributions; left out of a response
in which a node budget cut any cycle's trie),
`ar_wall_time` / `ar_new_tokens` when the target-only run was measured,
`foreign_load` / `ar_foreign_load` (the cores other processes kept busy during each timed run,
where the platform tells), the response `text`, and `settings` (the run's flags)."""
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

from ..decoding.decoder import GenerationOutput
from ..foreign_load import Timing
from ..jsonl import append_jsonl, read_jsonl


def make_record(*, dataset: str, prompt_id: str, turn: int, output: GenerationOutput, timing: Timing,
                block_size: int, settings: dict, text: str,
                baseline: Optional[Tuple[GenerationOutput, Timing]] = None) -> dict:
    """`timing`: the speculative run's; `baseline`: the target-only run and its timing, when measured."""
    record = {
        "dataset": dataset, "prompt_id": str(prompt_id), "turn": turn,
        "accepted": [c.num_accepted for c in output.cycles],
        "expected_accepted": [round(c.expected_accepted, 6) for c in output.cycles],
        "block_size": block_size, "eos_terminated": bool(output.stopped_by_eos),
        "new_tokens": len(output.token_ids), "wall_time": timing.wall_time, "text": text, "settings": settings,
    }
    if any(c.tree_nodes for c in output.cycles):  # trie verification: the nodes each pass scored
        record["tree_nodes"] = [c.tree_nodes for c in output.cycles]
        drafting = [c for c in output.cycles if c.drafts != 0]  # (plain steps have no trie to compare)
        if all(c.branch_rule_expected is not None for c in drafting):
            record["branch_rule_expected"] = [round(c.branch_rule_expected or 0.0, 6) for c in output.cycles]
    if any(c.drafts is not None and c.drafts < block_size - 1 for c in output.cycles):
        # the adaptive controller chose shallower cycles (0: a plain target step); absent: every cycle drafted b
        record["drafts"] = [c.drafts for c in output.cycles]
    if timing.foreign_load is not None:
        record["foreign_load"] = round(timing.foreign_load, 4)
    if baseline is not None:
        base, base_timing = baseline
        record.update(ar_wall_time=base_timing.wall_time, ar_new_tokens=len(base.token_ids))
        if base_timing.foreign_load is not None:
            record["ar_foreign_load"] = round(base_timing.foreign_load, 4)
    return record


def append_record(path: str, record: dict) -> None:
    append_jsonl(path, [record])


def clip_last_cycle(record: dict) -> dict:
    """`record` with its last cycle counting only the tokens the response kept (the prefill's
    token plus n + 1 per cycle make `new_tokens`). The decoder counts that way; records written
    before it did carry the verifier's count for a cycle cut at a stop token or the limit."""
    over = 1 + sum(record["accepted"]) + len(record["accepted"]) - record.get("new_tokens", float("inf"))
    if record["accepted"] and over > 0:
        if over > record["accepted"][-1]:
            raise ValueError(f"record {record['dataset']}/{record['prompt_id']} counts {over} more tokens "
                             f"than its {record['new_tokens']} new tokens beyond its last cycle")
        record = dict(record, accepted=record["accepted"][:-1] + [record["accepted"][-1] - over])
    return record


# what every reader of records needs: a file without them is not a records file
REQUIRED_FIELDS = ("dataset", "prompt_id", "accepted", "block_size", "eos_terminated")


def read_records(path: str, *, live: bool = False) -> List[dict]:
    """`live`: the run may still be appending (its last line may be half written)."""
    records = []
    for where, record in read_jsonl(path, "records", live=live):
        missing = [k for k in REQUIRED_FIELDS if not isinstance(record, dict) or k not in record]
        if missing:
            raise ValueError(f"{where} lacks {missing}: not an evaluation records file (`dblast eval` writes them)")
        records.append(clip_last_cycle(record))
    return records


def read_run_records(path: str, *, live: bool = False) -> List[dict]:
    """The records of a `dblast eval` output directory (those of the prompts its summary.json
    lists, when it has one), or of a records file given directly."""
    if not os.path.isdir(path):
        return read_records(path, live=live)
    records = read_records(os.path.join(path, "records.jsonl"), live=live)
    summary_path = os.path.join(path, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            listed = json.load(f).get("prompts")
        if listed is not None:
            prompts = {tuple(key) for key in listed}
            records = [r for r in records if (r["dataset"], r["prompt_id"]) in prompts]
    return records


def read_done_records(path: str, settings: dict, key: Callable[[dict], tuple],
                      read: Callable[[str], List[dict]] = read_records) -> Dict[tuple, dict]:
    """The records a resumed run already made, by `key`; refuses a file made with other settings.
    `read` reads the file (default: evaluation records; other resumable outputs pass their own)."""
    done = {}
    if os.path.isfile(path):
        for r in read(path):
            if r.get("settings") != settings:
                raise ValueError(f"{path} holds records made with other settings ({r.get('settings')}); "
                                 f"use another output directory or delete it (this run: {settings})")
            done[key(r)] = r
    return done
