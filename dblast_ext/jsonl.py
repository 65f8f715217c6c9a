"""JSON-lines files written a batch at a time by resumable runs (evaluation records,
training data): appends that survive a kill, and reads that name a line cut short. A path
ending in .gz is read through gzip (kept training-data shards are stored compressed)."""
import gzip
import json
import os
from typing import Iterator, Sequence, Tuple


def append_jsonl(path: str, records: Sequence[dict]) -> None:
    """One line per record, flushed and synced at once, so an interrupted run keeps what it finished."""
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str, what: str, *, live: bool = False) -> Iterator[Tuple[str, object]]:
    """(where, value) per non-empty line, `where` = "PATH: line N" for error messages;
    `what` names the file's kind when it does not exist. `live`: another process may be
    appending, so a last line without its newline is one being written and is skipped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {what} file at {path}")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {line_number}"
            if live and not line.endswith("\n"):
                return
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                # the last line of a killed run may be cut short: say so instead of failing obscurely
                cut = "" if line.endswith("\n") else " (cut short: the run was probably interrupted)"
                raise ValueError(f"{where} is not valid JSON ({e.msg}){cut}; delete that line to resume") from None
            yield where, value
