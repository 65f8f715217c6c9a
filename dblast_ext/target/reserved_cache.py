"""A target KV cache that appends in place: transformers' DynamicCache with layers that keep
their keys and values in buffers reserved ahead of the sequence, so appending a token (or a
block of drafts) writes those entries only, instead of `torch.cat` copying the whole cache
every step. On 2 CPU cores at batch 32 and 200 cached tokens those copies were about a fifth
of a SmolLM2 decode step. Imported only where transformers is (an optional dependency).

The layer's `keys` / `values` stay ordinary tensors: views of the buffers' first `length`
slots. Everything that edits a cache by slicing (`crop`, `TargetAdapter.keep_rows`,
`RaggedRows.commit`) keeps such a prefix view, and the next append writes after it. Code that
replaces them with new tensors (`batch_select_indices`, `RaggedRows.select`) is noticed on the
next append, which moves them into a fresh buffer once.
"""
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["ReservedLayer", "new_reserved_cache", "is_prefix_view"]

MIN_RESERVE = 64  # slots reserved beyond the first append, at least


def is_prefix_view(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `tensor` is buffer[:, :, :n] for some n (same storage, start and strides)."""
    return (tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride()
            and tensor.shape[:2] == buffer.shape[:2] and tensor.shape[3:] == buffer.shape[3:]
            and tensor.shape[2] <= buffer.shape[2] and tensor.dtype == buffer.dtype
            and tensor.device == buffer.device)


class ReservedLayer(DynamicLayer):
    """transformers' DynamicLayer appending in place into reserved buffers (module docstring)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # what DynamicLayer.lazy_initialization sets (its signature varies)
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            self.is_initialized = True
        keys, values = self.keys, self.values
        old = keys.shape[-2] if keys.dim() == 4 else 0
        new = old + key_states.shape[-2]
        buffers = getattr(self, "_reserved", None)
        if (buffers is None or keys.dim() != 4 or new > buffers[0].shape[2]
                or not (is_prefix_view(keys, buffers[0]) and is_prefix_view(values, buffers[1]))):
            buffers = self._reserve(key_states, value_states, keys, values, old, new)
        key_buffer, value_buffer = buffers
        key_buffer[:, :, old:new] = key_states
        value_buffer[:, :, old:new] = value_states
        self.keys, self.values = key_buffer[:, :, :new], value_buffer[:, :, :new]
        return self.keys, self.values

    def _reserve(self, key_states, value_states, keys, values, old: int, new: int):
        """Fresh buffers with room for `new` slots and as many again (doubling keeps the copies
        to O(length) over a whole generation), holding the current entries."""
        capacity = max(2 * new, new + MIN_RESERVE)
        key_buffer = key_states.new_empty(key_states.shape[:2] + (capacity,) + key_states.shape[3:])
        value_buffer = value_states.new_empty(value_states.shape[:2] + (capacity,) + value_states.shape[3:])
        if old:
            key_buffer[:, :, :old] = keys
            value_buffer[:, :, :old] = values
        self._reserved = (key_buffer, value_buffer)
        return self._reserved

    def reset(self) -> None:
        self._reserved = None
        super().reset()


def new_reserved_cache():
    """A DynamicCache whose layers (created as the model first writes them) are ReservedLayers."""
    cache = DynamicCache()
    if getattr(cache, "layer_class_to_replicate", None) is None or cache.layers:
        raise RuntimeError("this transformers version's DynamicCache does not create its layers from "
                           "layer_class_to_replicate; dblast_ext needs transformers >= 4.57")
    cache.layer_class_to_replicate = ReservedLayer
    return cache
