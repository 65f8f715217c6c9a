"""Many prompts in one Hugging Face KV cache, each row committing its own number of tokens.

The cache is the model's own (a transformers DynamicCache, [N, heads, slots, D] per layer).
Row r's committed tokens lie in slots [starts[r], ends[r]): prompts are left-padded, so they
all end at the same slot, and after a cycle each row keeps a different number of the block's
tokens. Every forward appends its block at slot `end` (the largest row end) for all rows; a
2D attention mask hides each row's empty slots and explicit positions count only its own
tokens, so a row's computation is the one it would have alone. `commit` then moves each row's
kept tokens right after its own committed ones (a gather of at most a block per row and layer)
and trims the cache to the new `end`, so holes never pile up.

While every row is dense (no padding, all rows the same length; always the case with one
prompt) the forward gets no mask and no positions and `commit` is a plain crop: the
single-prompt path is exactly the unbatched one.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from .adapter import TargetAdapter


def full_attention_layers(cache):
    """The cache's per-layer entries, refusing sliding-window layers (a ring buffer cannot be
    compacted by slot)."""
    layers = cache.layers
    for index, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(f"batches of ragged rows need full-attention cache layers; layer {index} is "
                                      f"{type(layer).__name__} (sliding window)")
    return layers


class RaggedRows:
    """The slot layout of N rows in one KV cache (see the module docstring). Host-side lists:
    the loop updates them from the accepted counts it reads once per cycle, so building a
    forward's mask and positions never reads the device."""

    commits_on_device = False  # `commit` takes host counts (dblast_ext.target.slot_cache.SlotRows: a device tensor)

    def __init__(self, starts: Sequence[int], ends: Sequence[int]):
        self.starts, self.ends = list(starts), list(ends)

    @classmethod
    def left_padded(cls, lengths: Sequence[int]) -> "RaggedRows":
        width = max(lengths)
        return cls([width - length for length in lengths], [width] * len(lengths))

    @property
    def rows(self) -> int:
        return len(self.ends)

    @property
    def end(self) -> int:
        """The cache's slot count: where the next block goes."""
        return max(self.ends)

    @property
    def lengths(self) -> List[int]:
        """Committed tokens per row (the next block's first position)."""
        return [e - s for s, e in zip(self.starts, self.ends)]

    @property
    def dense(self) -> bool:
        return all(s == 0 for s in self.starts) and all(e == self.ends[0] for e in self.ends)

    def prefill_inputs(self, prompts: Sequence[Sequence[int]], device, pad_id: int = 0):
        """Left-padded ids [N, T], and the attention mask and positions (None when dense)."""
        width = self.end
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.int64, device=device)
        if self.dense:
            return ids, None, None
        slots = torch.arange(width, device=device)
        starts = torch.tensor(self.starts, device=device)[:, None]
        return ids, (slots >= starts).long(), (slots - starts).clamp(min=0)

    def block_inputs(self, block: int, device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Attention mask [N, end + block] and positions [N, block] for a forward appending
        `block` tokens to every row (None, None when dense: the model's defaults are the same)."""
        if self.dense:
            return None, None
        slots = torch.arange(self.end, device=device)
        starts = torch.tensor(self.starts, device=device)[:, None]
        ends = torch.tensor(self.ends, device=device)[:, None]
        committed = (slots >= starts) & (slots < ends)
        mask = torch.cat([committed, committed.new_ones(self.rows, block)], dim=1).long()
        positions = (ends - starts) + torch.arange(block, device=device)
        return mask, positions

    def left_align(self, values: torch.Tensor) -> torch.Tensor:
        """values [N, end, ...] over the slots -> each row's committed entries first (the
        drafter's context is indexed by position, not by slot)."""
        if all(s == 0 for s in self.starts):
            return values
        width = values.shape[1]
        index = (torch.tensor(self.starts, device=values.device)[:, None]
                 + torch.arange(width, device=values.device)).clamp(max=width - 1)
        index = index.view(index.shape + (1,) * (values.dim() - 2)).expand(values.shape)
        return values.gather(1, index)

    def commit(self, cache, kept: Sequence[int]) -> None:
        """After a forward that appended a block at `end`: row r keeps the block's first
        kept[r] tokens, moved to follow its committed ones; the rest is dropped."""
        end = self.end
        if all(e == end for e in self.ends) and all(k == kept[0] for k in kept):  # no row moves
            TargetAdapter.crop(cache, end + kept[0])
            self.ends = [end + kept[0]] * self.rows
            return
        new_ends = [e + k for e, k in zip(self.ends, kept)]
        layers = full_attention_layers(cache)
        block = layers[0].keys.shape[-2] - end
        device = layers[0].keys.device
        rows = torch.arange(self.rows, device=device)[:, None]
        dest = torch.tensor(self.ends, device=device)[:, None] + torch.arange(block, device=device)  # [N, block]
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                # an index put, not scatter_: on a CPU scatter_ over bfloat16 took 30x longer, which made
                # every cycle after rows diverged cost 15% more at batch 16 (2026-12-05)
                tensor[rows, :, dest] = tensor[:, :, end:].transpose(1, 2).clone()
                setattr(layer, name, tensor[:, :, : max(new_ends)])
        self.ends = new_ends

    def select(self, cache, rows: Sequence[int]) -> None:
        """Keeps only `rows` (finished prompts drop out), trimming the padding no row needs."""
        self.starts = [self.starts[r] for r in rows]
        self.ends = [self.ends[r] for r in rows]
        shift = min(self.starts)
        layers = full_attention_layers(cache)
        index = torch.tensor(list(rows), device=layers[0].keys.device)
        for layer in layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, shift : self.end]
            layer.values = layer.values.index_select(0, index)[:, :, shift : self.end]
        self.starts = [s - shift for s in self.starts]
        self.ends = [e - shift for e in self.ends]


__all__ = ["RaggedRows", "full_attention_layers"]
