"""The feature cache of a sharded training set, built a window of shards at a time and, with a
bound, never larger on disk than that bound.

A cached token costs L*H bfloat16 features plus the target's top-32 (ids and log-probabilities)
and a log-sum-exp: `bytes_per_token`, about 6 KB for SmolLM2-135M read at 5 layers, so a cache
over 10M tokens would need some 60 GB. Caching pays only while a cache is read more than once
(several epochs, several runs on the same shards); with a bound (`feature_cache_max_gb`) the
shards' caches are kept as long as they fit and the least recently used one is deleted to make
room for the next window's, so the disk holds at most the bound, and shards evicted are rebuilt
(one target pass over them) when a later epoch or run needs them again. Recency is a cache
file's modification time, touched on use, so it holds across runs that share the folder.

Each shard's cache is a `FeatureCache` file as before (same name, same key), so a folder made
without a bound is read with one, and the other way round.
"""
import os
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..progress import progress_bar
from .feature_cache import FEATURE_DTYPE, TOP_K, FeatureCache, _PaddedBatches
from .shards import ShardedData

__all__ = ["ShardFeatureCaches", "bytes_per_token", "cache_bytes", "folder_bytes", "GB"]

GB = 1e9
HEADER_BYTES = 4096      # a safetensors header: tensor names, shapes and the key's metadata


def bytes_per_token(feature_width: int, top_k: int) -> int:
    """Disk bytes a cached token takes: features, top-k ids (int32) and log-probs (float32), log-sum-exp."""
    return feature_width * torch.finfo(FEATURE_DTYPE).bits // 8 + top_k * 8 + 4


def cache_bytes(records: Sequence[dict], feature_width: int, top_k: int) -> int:
    """The size of the cache file of `records` (to within its header)."""
    tokens = sum(len(r["input_ids"]) for r in records)
    return tokens * bytes_per_token(feature_width, top_k) + 8 * (len(records) + 1) + 8 * feature_width + 8 \
        + HEADER_BYTES


def folder_bytes(directory: str) -> int:
    """The bytes of a cache folder's cache files (finished and being written)."""
    if not os.path.isdir(directory):
        return 0
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.endswith((".safetensors", ".safetensors.partial")))


class ShardFeatureCaches(_PaddedBatches):
    """The target's outputs on the records of a `ShardedData` (indexed like it), from a cache
    file per shard under `directory`. `ensure(shards)` builds the caches of those shards that
    are missing; `max_bytes` bounds the folder, evicting the least recently used caches not
    in `pinned` (paths, e.g. the held-out set's) nor among the shards being ensured."""

    def __init__(self, directory: str, data: ShardedData, target_name: str, target, *,
                 max_bytes: Optional[int] = None, pinned: Iterable[str] = (), batch_size: int = 8,
                 progress: bool = True):
        self.directory, self.data, self.target_name, self.target = directory, data, target_name, target
        self.max_bytes, self.pinned = max_bytes, {os.path.abspath(p) for p in pinned}
        self.batch_size, self.progress = batch_size, progress
        self.parts: List[Optional[FeatureCache]] = [None] * len(data.paths)
        self.feature_width = len(target.layer_ids) * target.model.config.hidden_size
        self.top_k = min(TOP_K, target.vocab_size)
        self.built = 0           # shard caches this object built (a measure of what a bound costs)
        self._touched: Set[int] = set()
        os.makedirs(directory, exist_ok=True)

    def __len__(self) -> int:
        return len(self.data)

    def _present(self, shard: int) -> bool:
        part = self.parts[shard]
        return part is not None and os.path.exists(part.path)

    def ensure(self, shards: Sequence[int]) -> None:
        """Makes the caches of `shards` readable: opened, or built where missing (another run's
        eviction included), within the bound."""
        shards = list(dict.fromkeys(shards))
        missing = [s for s in shards if not self._present(s)]
        if set(shards) != self._touched or missing:
            for s in shards:   # recently used: the last to be evicted
                if self._present(s):
                    os.utime(self.parts[s].path)
            self._touched = set(shards)
        if not missing:
            return
        bar = progress_bar(sum(self.data.counts[s] for s in missing), desc="target features", unit="record",
                           enabled=self.progress)
        try:
            for s in missing:
                records = self.data.shard_records(s)
                if self.max_bytes is not None:
                    self._make_room(cache_bytes(records, self.feature_width, self.top_k), shards)
                before = bar.n
                self.parts[s] = FeatureCache.open_or_build(self.directory, records, self.data.paths[s],
                                                           self.target_name, self.target, batch_size=self.batch_size,
                                                           progress=False, bar=bar)
                if bar.n == before:   # another run had built it
                    bar.update(len(records))
                else:
                    self.built += 1
                if self.max_bytes is not None:   # the file as written, should the estimate have fallen short
                    self._make_room(0, shards)
        finally:
            bar.close()

    def _make_room(self, needed: int, keep: Sequence[int]) -> None:
        """Deletes the least recently used cache files (not pinned, not of `keep`) until the
        folder plus `needed` bytes fits the bound; an error when even that cannot make it fit."""
        kept = self.pinned | {os.path.abspath(self.parts[s].path) for s in keep if self._present(s)}
        files = [os.path.join(self.directory, f) for f in os.listdir(self.directory) if f.endswith(".safetensors")]
        candidates = sorted((p for p in files if os.path.abspath(p) not in kept), key=os.path.getmtime)
        used = folder_bytes(self.directory)
        while used + needed > self.max_bytes and candidates:
            victim = candidates.pop(0)
            used -= os.path.getsize(victim)
            os.remove(victim)
            for s, part in enumerate(self.parts):
                if part is not None and os.path.abspath(part.path) == os.path.abspath(victim):
                    self.parts[s] = None
        if used + needed > self.max_bytes:
            raise ValueError(
                f"training config: feature_cache_max_gb {self.max_bytes / GB:g} is too small: the caches of the "
                f"{len(keep)} shards a batch reads from (its shard_window) and the held-out set's need "
                f"{(used + needed) / GB:.3g} GB; raise feature_cache_max_gb, lower shard_window, or set features "
                "to online")

    def _rows(self, name: str, index: int) -> torch.Tensor:
        shard, line = self.data.locate(index)
        part = self.parts[shard]
        if part is None:
            raise RuntimeError(f"the feature cache of shard {self.data.paths[shard]!r} was not ensured before use")
        return part._rows(name, line)

    def response_feature_stats(self, shards: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, int]:
        """(sum of squared features [L*H] float64, token count) over the response tokens of
        `shards` (all by default), each shard's cache ensured in turn (so within the bound)."""
        total, count = torch.zeros(self.feature_width, dtype=torch.float64), 0
        for s in range(len(self.data.paths)) if shards is None else shards:
            self.ensure([s])
            part_sum, part_count = self.parts[s].response_feature_stats()
            total, count = total + part_sum, count + part_count
        return total, count

    def stats(self) -> Dict[str, float]:
        """The folder's size and this run's builds, for the run's summary."""
        return {"folder_gb": folder_bytes(self.directory) / GB, "shards_built": self.built}
