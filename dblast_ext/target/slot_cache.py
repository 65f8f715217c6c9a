"""A fixed-shape target KV cache for batches of ragged rows: the shapes a CUDA graph needs.

Every layer keeps its keys and values in buffers of `capacity` slots, [N, heads, capacity, D],
allocated once per response. Row r's committed tokens fill slots [0, lengths[r]) and a verify
forward writes its block at slots [lengths[r], lengths[r] + block) of its own row, so rows never
share a write position and nothing has to be moved afterwards: committing the first kept[r]
tokens of the block is `lengths += kept`, one addition on the device (what is left behind in
the block's later slots is hidden by the mask and overwritten by the next block). Attention
reads every slot under a 4D additive mask [N, 1, block, capacity] and positions [N, block], both
computed on the device from `lengths`: a forward's shapes and its host work are the same every
cycle, whatever each row accepted.

The price is attending over `capacity` slots instead of the committed ones, so on a CPU it is
no faster than dblast_ext.target.ragged_cache (which compacts the cache after each cycle and attends
over the longest row only); it is the layout for replaying the cycle from a graph. The prefill
runs on the ragged cache (its prompt lengths differ and it runs once) and is then copied in,
each row's prompt left-aligned. Imported only where transformers is.
"""
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .ragged_cache import RaggedRows, full_attention_layers

__all__ = ["SlotRows", "SlotLayer"]


class SlotLayer(DynamicLayer):
    """One layer's fixed buffers; `update` writes a block at the slots its SlotRows (`layout`)
    chose for this forward and returns the whole buffers (the mask hides what a row must not
    see). Editing the buffers behind the layout's back (crop, beam reordering) is refused."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, layout: "SlotRows"):
        super().__init__()
        self.keys, self.values, self.layout = keys, values, layout
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slots = self.layout.write_slots
        if slots is None or slots.shape != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError("a forward over a SlotRows cache needs SlotRows.block_inputs(block) first, for "
                               f"the block it appends ({key_states.shape[2]} tokens per row)")
        index = slots[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        """The slots. transformers 4.x asks on every forward to build `cache_position`, which
        it then passes to `update` only (ignored here: the layout says where rows write)."""
        return self.keys.shape[-2]

    def get_mask_sizes(self, *args, **kwargs):
        """(key length, offset) for a mask transformers would build; the loop always passes
        its own 4D mask."""
        return self.keys.shape[-2], 0

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("a SlotLayer's entries are kept by its SlotRows: use SlotRows.commit / select")

    crop = batch_select_indices = reorder_cache = batch_repeat_interleave = _refuse


class SlotRows:
    """Per-row committed lengths (`lengths`, a device tensor) over a SlotLayer cache (module
    docstring). The decode loop's per-cycle methods of RaggedRows (`block_inputs`, `commit`,
    `select`), so it drives either; `commit` takes the kept counts as a device tensor and never
    reads them. The prefill stays RaggedRows' (`from_prefill`)."""

    commits_on_device = True

    def __init__(self, lengths: torch.Tensor, capacity: int, mask_dtype: torch.dtype):
        self.lengths, self.capacity, self.mask_dtype = lengths, capacity, mask_dtype
        self.write_slots = None

    @classmethod
    def from_prefill(cls, cache, layout: RaggedRows, capacity: int):
        """After a prefill over `layout`'s left-padded rows in `cache` (a transformers cache of
        full-attention layers): a SlotLayer cache of `capacity` slots holding each row's prompt
        in its first slots, and the SlotRows that drives it."""
        layers = full_attention_layers(cache)
        if capacity < layout.end:
            raise ValueError(f"capacity must hold the longest prompt: {capacity} < {layout.end}")
        keys = layers[0].keys
        rows = cls(torch.tensor(layout.lengths, device=keys.device), capacity, keys.dtype)
        width = layout.end
        # slot s of row r reads padded slot starts[r] + s (past the row's end: garbage, masked)
        source = (torch.tensor(layout.starts, device=keys.device)[:, None]
                  + torch.arange(width, device=keys.device)).clamp(max=width - 1)
        slot_cache = DynamicCache()
        slot_cache.layer_class_to_replicate = None  # every layer is made here
        slot_cache.layers = []
        for layer in layers:
            buffers = []
            for tensor in (layer.keys, layer.values):
                buffer = tensor.new_zeros(tensor.shape[:2] + (capacity,) + tensor.shape[3:])
                index = source[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                buffer[:, :, :width] = tensor[:, :, :width].gather(2, index)
                buffers.append(buffer)
            slot_cache.layers.append(SlotLayer(*buffers, rows))
        return rows, slot_cache

    def block_inputs(self, block: int, device):
        """The 4D additive mask [N, 1, block, capacity] and positions [N, block] for a forward
        appending `block` tokens to every row, and where each row writes them; all on the
        device, from `lengths`. Query i of row r sees slots [0, lengths[r] + i]."""
        if int(block) < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        offsets = torch.arange(block, device=device)
        positions = self.lengths[:, None] + offsets                       # [N, block]
        self.write_slots = positions
        slots = torch.arange(self.capacity, device=device)
        visible = slots[None, None, :] <= positions[:, :, None]           # [N, block, capacity]
        mask = torch.zeros(visible.shape, dtype=self.mask_dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(self.mask_dtype).min)
        return mask[:, None], positions

    def commit(self, cache, kept: torch.Tensor) -> None:
        """Row r keeps the first kept[r] tokens of the block just appended (a device tensor)."""
        self.lengths = self.lengths + kept.to(self.lengths)
        self.write_slots = None

    def select(self, cache, rows: Sequence[int]) -> None:
        """Keeps only `rows` (finished prompts drop out)."""
        index = torch.tensor(list(rows), device=self.lengths.device)
        self.lengths = self.lengths.index_select(0, index)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.write_slots = None
