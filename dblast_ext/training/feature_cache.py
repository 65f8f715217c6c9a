"""The target's outputs on a training-data file, computed once and kept on disk.

The target is frozen, so what the drafter learns from at every position of a record is the
same every epoch and for every drafter that reads the same layers: the target forward, about
half of an online training step on a CPU, runs once per data file instead of once per batch.
One forward gives, at every position t:

- the context features (the hidden states of the drafter's target layers), in bfloat16
  whether cached or computed online (`target_pass`), so a run reads the same features either
  way, at half the disk and memory of float32;
- the target's 32 likeliest next tokens (position t predicts token t + 1) with their
  log-probabilities, log_softmax of the raw logits at temperature 1, and the logits'
  log-sum-exp: the soft labels of distillation. The logits are computed a few hundred rows
  at a time from the final hidden states, so [tokens, V] never exists.

The cache is a safetensors file, opened memory-mapped, with every record's rows back to back
and `offsets` [records + 1] delimiting them:

    features         [tokens, L*H]  bfloat16
    topk_ids         [tokens, k]    int32      k = 32 (the vocabulary if smaller)
    topk_logprobs    [tokens, k]    float32
    logsumexp        [tokens]       float32
    response_sq_sum  [L*H]          float64    sum of squared features over response tokens
    response_count   [1]            int64      the number of response tokens

A list of data files (shards) gets a cache per file, read as one set (`FeatureCacheSet`): it is
built a shard at a time, in one shard's memory, and a shard added later leaves the others'
caches as they are. Its metadata names the format, the data file's content hash, the target, the layers, the
dtypes and k; a cache that does not match (one of an earlier format included) is rebuilt,
never read. Two trainers that start together do not both build it: a file lock makes the
second wait.
"""
import bisect
import fcntl
import hashlib
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..target.adapter import last_position_logits_arguments
from ..progress import progress_bar

__all__ = ["FeatureCache", "FeatureCacheSet", "open_feature_caches", "TargetPass", "cache_key", "target_pass",
           "response_feature_stats", "rms_feature_scale",
           "FEATURE_DTYPE", "TOP_K"]

FORMAT = "2"                   # 1: features in the target's dtype, nothing else
FEATURE_DTYPE = torch.bfloat16
TOP_K = 32
TENSORS = ("features", "topk_ids", "topk_logprobs", "logsumexp")   # per token, rows delimited by offsets
LOGIT_ROWS = 256               # target logits rows at a time: [256, V] float32 is 50 MB for V = 49,152


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


def cache_key(data_path: str, target_name: str, layer_ids: Sequence[int], dtype: torch.dtype, top_k: int) -> dict:
    """What a cache file must have been made from to be read (its safetensors metadata).
    `dtype` is the target's compute dtype; `top_k` the number of next-token ids kept."""
    return {"format": FORMAT, "data_sha256": file_digest(data_path), "target": os.path.abspath(target_name)
            if os.path.isdir(target_name) else target_name, "target_files": _target_fingerprint(target_name),
            "layer_ids": ",".join(str(int(i)) for i in layer_ids), "dtype": str(dtype).replace("torch.", ""),
            "feature_dtype": str(FEATURE_DTYPE).replace("torch.", ""), "top_k": str(int(top_k))}


# ---------------------------------------------------------------------------------------------
# one target forward


@dataclass
class TargetPass:
    features: torch.Tensor                        # [N, T, L*H] FEATURE_DTYPE
    topk_ids: Optional[torch.Tensor] = None       # [N, T, k] int64: position t's likeliest next tokens
    topk_logprobs: Optional[torch.Tensor] = None  # [N, T, k] float32: their log_softmax (temperature 1)
    logsumexp: Optional[torch.Tensor] = None      # [N, T] float32: log sum exp of the logits


def topk_logprobs(lm_head, final_hidden: torch.Tensor, k: int, vocab_size: int, rows: int = LOGIT_ROWS) \
        -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [..., k] int64, log-probs [..., k] float32, log-sum-exp [...] float32) of the
    logits lm_head(final_hidden)[..., :vocab_size], `rows` positions at a time."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    ids, logprobs, lse = [], [], []
    for start in range(0, flat.shape[0], rows):
        logits = lm_head(flat[start:start + rows])[..., :vocab_size].float()
        norm = torch.logsumexp(logits, dim=-1)
        values, top = logits.topk(k, dim=-1)
        ids.append(top)
        logprobs.append(values - norm[:, None])
        lse.append(norm)
    shape = final_hidden.shape[:-1]
    if not ids:
        return (torch.zeros(*shape, k, dtype=torch.long), torch.zeros(*shape, k), torch.zeros(shape))
    return torch.cat(ids).view(*shape, k), torch.cat(logprobs).view(*shape, k), torch.cat(lse).view(shape)


def _check_head_gives_logits(lm_head, final_hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The top-k is computed as lm_head(last hidden state); a target whose logits are anything
    else (logit scaling, soft-capping, a pre-norm last hidden state) would be misread: refuse it."""
    ours, theirs = lm_head(final_hidden).float(), logits.float()
    if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * (1 + float(theirs.abs().max()))):
        raise ValueError("the target's logits are not its LM head applied to its last hidden state (logit "
                         "scaling or soft-capping?): its top-k log-probabilities cannot be computed here")


@torch.no_grad()
def target_pass(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, top_k: int = 0) -> TargetPass:
    """One inference-mode forward of the target (a TargetAdapter) over right-padded rows: the
    context features of every position and, with `top_k` > 0, its top-k next-token
    log-probabilities (full-vocabulary logits only `LOGIT_ROWS` positions at a time)."""
    out = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                       **last_position_logits_arguments(target.model))
    features = target.features(out.hidden_states).to(FEATURE_DTYPE)
    if not top_k:
        return TargetPass(features)
    head, final = target.model.get_output_embeddings(), out.hidden_states[-1]
    _check_head_gives_logits(head, final[:, -1], out.logits[:, -1])
    ids, logprobs, lse = topk_logprobs(head, final, min(top_k, target.vocab_size), target.vocab_size)
    return TargetPass(features, ids, logprobs, lse)


def _padded_batches(records: List[dict], batch_size: int, device) \
        -> Iterator[Tuple[List[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(record indices, input ids, attention mask, loss mask), right-padded, records sorted by
    length (little padding per batch)."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["input_ids"]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        longest = max(len(records[i]["input_ids"]) for i in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        loss_mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for n, i in enumerate(chunk):
            tokens = records[i]["input_ids"]
            ids[n, : len(tokens)] = torch.tensor(tokens)
            mask[n, : len(tokens)] = 1
            loss_mask[n, : len(tokens)] = torch.tensor(records[i]["loss_mask"])
        yield chunk, ids.to(device), mask.to(device), loss_mask


def _add_response_stats(sq_sum: torch.Tensor, count: int, features: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """Adds the squared features of the response tokens into sq_sum [F] (float64); returns the
    new token count."""
    picked = features[loss_mask.to(features.device).bool()].double()
    sq_sum += picked.pow(2).sum(0).cpu()
    return count + picked.shape[0]


# ---------------------------------------------------------------------------------------------
# feature scaling statistics


def response_feature_stats(records: List[dict], target, *, batch_size: int = 8, progress: bool = True) \
        -> Tuple[torch.Tensor, int]:
    """(sum of squared features [L*H] float64, token count) over the response tokens of
    `records`, by one target pass (what a feature cache stores, for runs without one)."""
    sq_sum, count = torch.zeros(len(target.layer_ids) * target.model.config.hidden_size, dtype=torch.float64), 0
    bar = progress_bar(len(records), desc="feature statistics", unit="record", enabled=progress)
    for chunk, ids, mask, loss_mask in _padded_batches(records, batch_size, target.device):
        count = _add_response_stats(sq_sum, count, target_pass(target, ids, mask).features, loss_mask)
        bar.update(len(chunk))
    bar.close()
    return sq_sum, count


def rms_feature_scale(sq_sum: torch.Tensor, count: int) -> torch.Tensor:
    """1 / RMS of each feature channel over the response tokens, float32 [L*H]: every channel
    then reaches `fc` with unit RMS, where raw features have a few channels holding most of a
    token's energy. A channel that is zero throughout keeps scale 1."""
    if count <= 0:
        raise ValueError("feature scaling needs response tokens in the training data; it has none")
    rms = (sq_sum / count).sqrt()
    return torch.where(rms > 0, 1.0 / rms.clamp(min=1e-30), torch.ones_like(rms)).float()


# ---------------------------------------------------------------------------------------------
# the cache


class _PaddedBatches:
    """Batches padded like `objective.collate` pads the tokens, from `_rows(name, index)`: one
    record's rows of "features", "topk_ids", "topk_logprobs" or "logsumexp"."""

    def _rows(self, name: str, index: int) -> torch.Tensor:
        raise NotImplementedError

    def record(self, index: int) -> torch.Tensor:
        """The features [tokens, L*H] of one record."""
        return self._rows("features", index)

    def _padded(self, name: str, indices: Sequence[int], length: int, dtype=None) -> torch.Tensor:
        """Rows of `name` for each record, zero after each record's end (positions no loss reads)."""
        rows = [self._rows(name, i) for i in indices]
        out = torch.zeros(len(rows), length, *rows[0].shape[1:], dtype=dtype or rows[0].dtype)
        for n, row in enumerate(rows):
            out[n, : row.shape[0]] = row
        return out

    def batch(self, indices: Sequence[int], length: int, device) -> torch.Tensor:
        """Features [N, length, L*H] (bfloat16), zero after each record's end."""
        return self._padded("features", indices, length).to(device)

    def batch_topk(self, indices: Sequence[int], length: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k next tokens at every position: ids [N, length, k] int64 and
        log-probabilities [N, length, k] float32, zero after each record's end."""
        return (self._padded("topk_ids", indices, length, torch.long).to(device),
                self._padded("topk_logprobs", indices, length).to(device))

    def batch_logsumexp(self, indices: Sequence[int], length: int, device) -> torch.Tensor:
        """The target logits' log-sum-exp [N, length] float32, zero after each record's end."""
        return self._padded("logsumexp", indices, length).to(device)


class FeatureCache(_PaddedBatches):
    """The target's outputs on every record of one data file: `batch(indices, length)` and
    `batch_topk(indices, length)` give them padded like `objective.collate` pads the tokens."""

    def __init__(self, path: str):
        self.path = path
        self._file = safe_open(path, framework="pt")
        self.offsets = self._file.get_tensor("offsets").tolist()
        self._slices = {name: self._file.get_slice(name) for name in TENSORS}

    @classmethod
    def open_or_build(cls, directory: str, records: List[dict], data_path: str, target_name: str, target,
                      *, batch_size: int = 8, progress: bool = True, bar=None) -> "FeatureCache":
        """The cache of `records` (read from `data_path`) under `directory`, built first if
        it is missing or was made from anything else. `target` is the TargetAdapter; `bar`,
        a progress bar to advance by the records built instead of one of its own."""
        dtype = next(target.model.parameters()).dtype
        key = cache_key(data_path, target_name, target.layer_ids, dtype, min(TOP_K, target.vocab_size))
        stem = os.path.basename(data_path)
        for suffix in (".gz", ".jsonl"):
            stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
        # another compute dtype another file (float32's keep their names), so caches of both coexist
        precision = "" if dtype == torch.float32 else f"-{key['dtype']}"
        name = f"{stem}-{key['data_sha256'][:12]}-L{key['layer_ids'].replace(',', '_')}{precision}.safetensors"
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # a second trainer waits here while the first builds
            if not _matches(path, key, len(records)):
                _build(path, records, target, key, batch_size, progress, bar)
        return cls(path)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def top_k(self) -> int:
        return self._slices["topk_ids"].get_shape()[1]

    def _rows(self, name: str, index: int) -> torch.Tensor:
        return self._slices[name][self.offsets[index]:self.offsets[index + 1]]

    def response_feature_stats(self) -> Tuple[torch.Tensor, int]:
        """(sum of squared features [L*H] float64, token count) over the response tokens."""
        return self._file.get_tensor("response_sq_sum"), int(self._file.get_tensor("response_count")[0])


class FeatureCacheSet(_PaddedBatches):
    """The caches of several data files read as one set of records, in order (record i of the
    set is record i - start of the file it falls in): a cache per file, so a set of shards is
    built a shard at a time, in a shard's memory, and a new shard leaves the others' caches be."""

    def __init__(self, parts: Sequence[FeatureCache]):
        if not parts:
            raise ValueError("a feature cache set needs at least one cache")
        if len({p.top_k for p in parts}) != 1:
            raise ValueError(f"the caches of one set keep different top-k counts: {[p.top_k for p in parts]}")
        self.parts = list(parts)
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    @classmethod
    def open_or_build(cls, directory: str, files: Sequence[Tuple[str, List[dict]]], target_name: str, target,
                      *, batch_size: int = 8, progress: bool = True) -> "FeatureCacheSet":
        """The cache of each (data path, its records) under `directory`, built where missing,
        with one progress bar over all the records built."""
        bar = progress_bar(sum(len(records) for _, records in files), desc="target features", unit="record",
                           enabled=progress)
        try:
            parts = []
            for path, records in files:
                before = bar.n
                parts.append(FeatureCache.open_or_build(directory, records, path, target_name, target,
                                                        batch_size=batch_size, progress=False, bar=bar))
                if bar.n == before:   # already built: counted as done
                    bar.update(len(records))
        finally:
            bar.close()
        return cls(parts)

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def top_k(self) -> int:
        return self.parts[0].top_k

    def _rows(self, name: str, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of a set of {len(self)}")
        part = bisect.bisect_right(self.starts, index) - 1
        return self.parts[part]._rows(name, index - self.starts[part])

    def response_feature_stats(self) -> Tuple[torch.Tensor, int]:
        """(sum of squared features [L*H] float64, token count) over every file's response tokens."""
        stats = [p.response_feature_stats() for p in self.parts]
        return sum(s for s, _ in stats), sum(c for _, c in stats)


def open_feature_caches(directory: str, files: Sequence[Tuple[str, List[dict]]], target_name: str, target, *,
                        batch_size: int = 8, progress: bool = True):
    """The cache of one data file (a FeatureCache), or of several read as one set (a FeatureCacheSet)."""
    if len(files) == 1:
        path, records = files[0]
        return FeatureCache.open_or_build(directory, records, path, target_name, target, batch_size=batch_size,
                                          progress=progress)
    return FeatureCacheSet.open_or_build(directory, files, target_name, target, batch_size=batch_size,
                                         progress=progress)


def _matches(path: str, key: dict, count: int) -> bool:
    """An existing cache file made from `key` that holds `count` records."""
    if not os.path.exists(path):
        return False
    with safe_open(path, framework="pt") as f:
        return (f.metadata() or {}) == key and f.get_slice("offsets").get_shape()[0] - 1 == count


@torch.no_grad()
def _build(path: str, records: List[dict], target, key: dict, batch_size: int, progress: bool, bar=None) -> None:
    """Writes the cache of `records`: the tensors are allocated at their final size (the record
    lengths are known up front) and filled batch by batch, so the build holds one copy of them."""
    top_k = int(key["top_k"])
    lengths = torch.tensor([0] + [len(r["input_ids"]) for r in records])
    offsets = torch.cumsum(lengths, 0)
    tokens, width = int(offsets[-1]), len(target.layer_ids) * target.model.config.hidden_size
    tensors = {"features": torch.empty(tokens, width, dtype=FEATURE_DTYPE),
               "topk_ids": torch.empty(tokens, top_k, dtype=torch.int32),
               "topk_logprobs": torch.empty(tokens, top_k, dtype=torch.float32),
               "logsumexp": torch.empty(tokens, dtype=torch.float32)}
    sq_sum, count = torch.zeros(width, dtype=torch.float64), 0
    own_bar = bar is None
    if own_bar:
        bar = progress_bar(len(records), desc="target features", unit="record", enabled=progress)
    for chunk, ids, mask, loss_mask in _padded_batches(records, batch_size, target.device):
        out = target_pass(target, ids, mask, top_k=top_k)
        count = _add_response_stats(sq_sum, count, out.features, loss_mask)
        for n, i in enumerate(chunk):
            start, end = int(offsets[i]), int(offsets[i + 1])
            tensors["features"][start:end] = out.features[n, : end - start]
            tensors["topk_ids"][start:end] = out.topk_ids[n, : end - start]
            tensors["topk_logprobs"][start:end] = out.topk_logprobs[n, : end - start]
            tensors["logsumexp"][start:end] = out.logsumexp[n, : end - start]
        bar.update(len(chunk))
    if own_bar:
        bar.close()
    tensors.update(offsets=offsets, response_sq_sum=sq_sum, response_count=torch.tensor([count], dtype=torch.int64))
    partial = path + ".partial"
    save_file(tensors, partial, metadata=key)
    os.replace(partial, path)   # readers never see a half-written cache
