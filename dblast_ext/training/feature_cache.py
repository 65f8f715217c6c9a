"""The target's context features of a training-data file, computed once and kept on disk.

The target is frozen, so the features the drafter reads (the hidden states of its target
layers at every position of a record) are the same every epoch and for every drafter that
reads the same layers: the target forward, about half of an online training step on a CPU,
runs once per data file instead of once per batch. The cache is a safetensors file, opened
memory-mapped, with every record's features back to back (`features` [total tokens, L*H] in
the target's dtype) and `offsets` [records + 1]; its metadata names the data file's content
hash, the target and the layers, and a cache that does not match is rebuilt, never read.
Two trainers that start together do not both build it: a file lock makes the second wait.
"""
import fcntl
import hashlib
import os
from typing import List, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..target import last_position_logits_arguments
from ..progress import progress_bar

__all__ = ["FeatureCache", "cache_key"]


def file_digest(path: str) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def _target_fingerprint(target_name: str) -> str:
    """Size and modification time of each file of a local target directory: new weights in
    the same directory make another cache (hashing gigabytes of weights per run would not pay)."""
    if not os.path.isdir(target_name):
        return ""
    files = sorted(f for f in os.listdir(target_name) if os.path.isfile(os.path.join(target_name, f)))
    stats = [(f, os.stat(os.path.join(target_name, f))) for f in files]
    return ";".join(f"{f}:{st.st_size}:{st.st_mtime_ns}" for f, st in stats)


def cache_key(data_path: str, target_name: str, layer_ids: Sequence[int], dtype: torch.dtype) -> dict:
    """What a cache file must have been made from to be read (its safetensors metadata)."""
    return {"data_sha256": file_digest(data_path), "target": os.path.abspath(target_name)
            if os.path.isdir(target_name) else target_name, "target_files": _target_fingerprint(target_name),
            "layer_ids": ",".join(str(int(i)) for i in layer_ids), "dtype": str(dtype).replace("torch.", "")}


class FeatureCache:
    """Features of every record of one data file: `batch(indices, length)` gives them padded
    like `objective.collate` pads the tokens."""

    def __init__(self, path: str):
        self.path = path
        self._file = safe_open(path, framework="pt")
        self.offsets = self._file.get_tensor("offsets").tolist()
        self._features = self._file.get_slice("features")

    @classmethod
    def open_or_build(cls, directory: str, records: List[dict], data_path: str, target_name: str, target,
                      *, batch_size: int = 8, progress: bool = True) -> "FeatureCache":
        """The cache of `records` (read from `data_path`) under `directory`, built first if
        it is missing or was made from anything else. `target` is the TargetAdapter."""
        dtype = next(target.model.parameters()).dtype
        key = cache_key(data_path, target_name, target.layer_ids, dtype)
        name = f"{os.path.splitext(os.path.basename(data_path))[0]}-{key['data_sha256'][:12]}-" \
               f"L{key['layer_ids'].replace(',', '_')}.safetensors"
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # a second trainer waits here while the first builds
            if not _matches(path, key, len(records)):
                _build(path, records, target, key, batch_size, progress)
        return cls(path)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def record(self, index: int) -> torch.Tensor:
        return self._features[self.offsets[index]:self.offsets[index + 1]]

    def batch(self, indices: Sequence[int], length: int, device) -> torch.Tensor:
        """[N, length, L*H], zero after each record's end (positions no query ever sees)."""
        rows = [self.record(i) for i in indices]
        out = torch.zeros(len(rows), length, rows[0].shape[-1], dtype=rows[0].dtype)
        for n, row in enumerate(rows):
            out[n, : row.shape[0]] = row
        return out.to(device)


def _matches(path: str, key: dict, count: int) -> bool:
    """An existing cache file made from `key` that holds `count` records."""
    if not os.path.exists(path):
        return False
    with safe_open(path, framework="pt") as f:
        return (f.metadata() or {}) == key and f.get_slice("offsets").get_shape()[0] - 1 == count


@torch.no_grad()
def _build(path: str, records: List[dict], target, key: dict, batch_size: int, progress: bool) -> None:
    extra = last_position_logits_arguments(target.model)
    device = target.device
    order = sorted(range(len(records)), key=lambda i: len(records[i]["input_ids"]))  # little padding per batch
    pieces: List[torch.Tensor] = [None] * len(records)
    bar = progress_bar(len(records), desc="target features", unit="record", enabled=progress)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        longest = max(len(records[i]["input_ids"]) for i in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for n, i in enumerate(chunk):
            tokens = records[i]["input_ids"]
            ids[n, : len(tokens)] = torch.tensor(tokens)
            mask[n, : len(tokens)] = 1
        out = target.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                           **extra)
        features = target.features(out.hidden_states).cpu()
        for n, i in enumerate(chunk):
            pieces[i] = features[n, : len(records[i]["input_ids"])].clone()
        bar.update(len(chunk))
    bar.close()
    lengths = torch.tensor([0] + [p.shape[0] for p in pieces])
    tensors = {"features": torch.cat(pieces), "offsets": torch.cumsum(lengths, 0)}
    partial = path + ".partial"
    save_file(tensors, partial, metadata=key)
    os.replace(partial, path)   # readers never see a half-written cache
