"""Training data as many shards, streamed: a folder, a glob or a list of `dblast data generate`
files (.jsonl or .jsonl.gz) read as one set, with at most a window of shards in memory.

A set of 10M response tokens is about 40,000 records; held as Python lists they take gigabytes,
and parsing all of them before the first step takes minutes. So the set is indexed by counting
each shard's lines (no parsing), and a shard's records are read when a batch first needs them
and dropped when the window moves on (an LRU of `window` shards).

The order is a function of (seed, epoch) only, so a run resumed at step s reads exactly the
records an uninterrupted one would, on any machine:
- no window (or one as large as the set): one seeded permutation over every record per epoch,
  the shards in the order given (the trainer's order before shards were streamed);
- a window of W shards: per epoch the shards in a seeded order, cut into windows of W, and the
  records of each window in a seeded permutation. A batch then reads from W shards only; the
  price is a shuffle that mixes records across W shards rather than across the whole set.
"""
import bisect
import glob
import gzip
import os
import zlib
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .data import read_training_data

__all__ = ["DATA_SUFFIXES", "resolve_data", "is_pattern", "count_records", "seed_of", "ShardedData"]

DATA_SUFFIXES = (".jsonl", ".jsonl.gz")


def seed_of(*parts) -> int:
    """A generator seed from the parts' text (the trainer's seeds: per epoch, step, window)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def is_pattern(value: str) -> bool:
    return any(c in value for c in "*?[")


def resolve_data(value: Union[str, List[str], None], key: str = "data") -> List[str]:
    """The files of a `data` / `eval_data` field, in reading order: a file; a folder (its
    .jsonl and .jsonl.gz files, sorted by name, not its subfolders); a glob (its matching files,
    sorted); or a list of files, in the order given. None: no files. Errors name `key`."""
    if value is None:
        return []
    if isinstance(value, list):
        return list(value)
    if os.path.isdir(value):
        found = sorted(os.path.join(value, f) for f in os.listdir(value)
                       if f.endswith(DATA_SUFFIXES) and os.path.isfile(os.path.join(value, f)))
        if not found:
            raise FileNotFoundError(f"training config: {key} folder {value!r} holds no .jsonl or .jsonl.gz file")
        return found
    if is_pattern(value):
        found = sorted(p for p in glob.glob(value) if os.path.isfile(p) and p.endswith(DATA_SUFFIXES))
        if not found:
            raise FileNotFoundError(f"training config: {key} pattern {value!r} matches no .jsonl or .jsonl.gz file")
        return found
    return [value]


def count_records(path: str) -> int:
    """The records of a data file: its non-empty lines (what `read_jsonl` reads), unparsed."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class ShardedData:
    """The records of `paths` as one set (record i is line i - start of the shard it falls in),
    in the order of `index_at(position)`: position p of the run's stream of records, epochs
    back to back. `window`: shards in memory at once and the shuffle's span (None: all)."""

    def __init__(self, paths: Sequence[str], seed: int, window: Optional[int] = None):
        if not paths:
            raise ValueError("training data: no files")
        self.paths, self.seed = list(paths), seed
        self.counts = [count_records(p) for p in self.paths]
        empty = [p for p, n in zip(self.paths, self.counts) if n == 0]
        if empty:
            raise ValueError(f"training data: {empty[0]!r} holds no records")
        self.starts = [0]
        for n in self.counts:
            self.starts.append(self.starts[-1] + n)
        self.window = len(self.paths) if window is None else min(window, len(self.paths))
        self._loaded: "OrderedDict[int, List[dict]]" = OrderedDict()
        self._orders: Dict[int, Tuple] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def windowed(self) -> bool:
        return self.window < len(self.paths)

    def locate(self, index: int) -> Tuple[int, int]:
        """(shard, line) of record `index` of the set."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of a set of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def shard_records(self, shard: int) -> List[dict]:
        """Every record of one shard, read (and checked) when first needed; at most `window`
        shards are kept, the least recently used dropped first."""
        if shard in self._loaded:
            self._loaded.move_to_end(shard)
            return self._loaded[shard]
        records = read_training_data(self.paths[shard])
        if len(records) != self.counts[shard]:
            raise ValueError(f"training data: {self.paths[shard]!r} changed while the run read it "
                             f"({self.counts[shard]} records when indexed, {len(records)} now)")
        self._loaded[shard] = records
        while len(self._loaded) > self.window:
            self._loaded.popitem(last=False)
        return records

    def records(self, indices: Sequence[int]) -> List[dict]:
        out = []
        for index in indices:
            shard, line = self.locate(index)
            out.append(self.shard_records(shard)[line])
        return out

    def _order(self, epoch: int):
        """(window start positions, per window the global record indices in reading order, per
        window its shards) of one epoch; the last two epochs' are kept."""
        if epoch not in self._orders:
            if not self.windowed:   # one permutation over every record, as the trainer always read them
                perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(
                    seed_of(self.seed, "epoch", epoch)))
                order = ([0], [perm], [list(range(len(self.paths)))])
            else:
                shards = torch.randperm(len(self.paths), generator=torch.Generator().manual_seed(
                    seed_of(self.seed, "shards", epoch))).tolist()
                starts, indices, groups = [0], [], []
                for w, first in enumerate(range(0, len(shards), self.window)):
                    group = shards[first:first + self.window]
                    members = torch.cat([torch.arange(self.starts[s], self.starts[s + 1]) for s in group])
                    perm = torch.randperm(len(members), generator=torch.Generator().manual_seed(
                        seed_of(self.seed, "epoch", epoch, "window", w)))
                    indices.append(members[perm])
                    groups.append(group)
                    starts.append(starts[-1] + len(members))
                order = (starts, indices, groups)
            self._orders[epoch] = order
            for old in sorted(self._orders)[:-2]:
                del self._orders[old]
        return self._orders[epoch]

    def _place(self, position: int) -> Tuple[int, int, int]:
        """(epoch, window, offset in the window) of a stream position."""
        epoch, offset = divmod(position, len(self))
        starts = self._order(epoch)[0]
        window = bisect.bisect_right(starts, offset) - 1
        return epoch, window, offset - starts[window]

    def index_at(self, position: int) -> int:
        """The set's record at stream position `position` (epochs back to back)."""
        epoch, window, offset = self._place(position)
        return int(self._order(epoch)[1][window][offset])

    def window_shards(self, position: int) -> List[int]:
        """The shards of the window that stream position `position` reads from."""
        epoch, window, _ = self._place(position)
        return list(self._order(epoch)[2][window])

    def position_info(self, position: int) -> dict:
        """Where the stream stands at `position` (kept in checkpoints, for the reader)."""
        epoch, window, offset = self._place(position)
        return {"position": position, "epoch": epoch, "window": window, "offset_in_window": offset,
                "shards": [os.path.basename(self.paths[s]) for s in self.window_shards(position)]
                if self.windowed else None}
