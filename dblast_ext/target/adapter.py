"""The target model as the decode loop and training see it: a Hugging Face causal LM used
unmodified, plus the shims that keep one code path working across transformers versions
(the cache argument's name, keeping only the last position's logits).

Loading a target from disk is `target_loading`; this module only wraps a loaded model."""
import contextlib
import inspect
import os
from typing import Sequence

import torch

# transformers' switch for handing sdpa the grouped K/V heads as they are (`enable_gqa`) where it
# would otherwise repeat them to the query heads; read at every attention call (transformers >= 5,
# ignored by older versions)
FORCE_GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def cache_argument(model) -> str:
    """The name a Hugging Face model's forward gives its KV cache: `cache` in recent
    transformers, `past_key_values` in older ones."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def last_position_logits_arguments(model) -> dict:
    """Forward arguments that keep the logits to the last position (`logits_to_keep` in
    recent transformers, `num_logits_to_keep` in older ones; none when neither exists), for
    passes that need hidden states only or sample from the last position only."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return {name: 1}
    return {}


@contextlib.contextmanager
def grouped_heads_under_masks(device: torch.device):
    """Around a forward with an attention mask on a CPU: transformers repeats a grouped-query
    model's K/V heads to every query head before sdpa whenever a mask is given (CUDA's fused
    kernels take grouped heads only without one), a copy of the whole cache in every layer. Torch's
    CPU kernel takes grouped heads with a mask and gives the same values (a test checks), so the
    switch is set for the forward and restored after it: 1.5 ms of a 58 ms trie cycle of the
    embedded pair. Left alone on other devices, where the user set the switch, and inside
    torch.compile (which cannot trace a change of the environment, and fuses the repetition)."""
    if device.type != "cpu" or FORCE_GQA_SWITCH in os.environ or torch.compiler.is_compiling():
        yield
        return
    os.environ[FORCE_GQA_SWITCH] = "1"
    try:
        yield
    finally:
        os.environ.pop(FORCE_GQA_SWITCH, None)


class TargetAdapter:
    """A Hugging Face causal LM (Qwen3, Llama, ...) used unmodified: one forward returns the
    logits of every position (of the last one only for a prefill) and the hidden states of the
    drafter's target layers."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self._cache_arg = cache_argument(model)
        self._last_logits_kwargs = last_position_logits_arguments(model)

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    def new_cache(self):
        """transformers' DynamicCache appending in place (dblast_ext.target.reserved_cache)."""
        from .reserved_cache import new_reserved_cache

        return new_reserved_cache()

    def forward(self, input_ids: torch.Tensor, cache, hidden_states: bool = True, last_logits_only: bool = False,
                attention_mask: torch.Tensor = None, position_ids: torch.Tensor = None):
        """`last_logits_only` for a prefill, which samples from its last position only: [T, V]
        logits over the whole prompt would be about a fifth of the pass (SmolLM2) for nothing.
        `attention_mask` (2D over the cache's slots and the new tokens, dblast_ext.target.ragged_cache; or
        4D additive, dblast_ext.target.slot_cache) and `position_ids` for batches of ragged rows; None:
        the model's defaults."""
        extra = dict(self._last_logits_kwargs) if last_logits_only else {}
        if attention_mask is not None:
            extra.update(attention_mask=attention_mask, position_ids=position_ids)
        with grouped_heads_under_masks(input_ids.device):
            out = self.model(input_ids=input_ids, use_cache=True, output_hidden_states=hidden_states,
                             **{self._cache_arg: cache}, **extra)
        if not hidden_states:
            return out.logits, None
        return out.logits, self.features(out.hidden_states)

    def forward_tree(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor):
        """One forward over a token tree (dblast_ext.decoding.trie): explicit positions and a 4D additive
        mask, which transformers uses as given. Every row's logits and features; the cache gains
        every row's keys and values, to be narrowed with `keep_rows`."""
        with grouped_heads_under_masks(input_ids.device):
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=True, output_hidden_states=True, **{self._cache_arg: cache})
        return out.logits, self.features(out.hidden_states)

    @staticmethod
    def keep_rows(cache, start: int, rows) -> None:
        """Keeps the cache's first `start` tokens, then the entries at start + rows (a tree
        forward's committed path, in order: a list of ints or an int64 tensor) and nothing after: a
        gather along the sequence of every layer, or a crop where the path is the forward's first
        rows (the root alone: half the cycles at T 1). Sliding-window layers keep a ring, which a
        gather cannot narrow: refused."""
        for index, layer in enumerate(cache.layers):
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise NotImplementedError(f"tree verification needs full-attention cache layers; layer {index} is "
                                          f"{type(layer).__name__} (sliding window)")
        keep = len(rows)
        if not torch.is_tensor(rows):
            if list(rows) == list(range(keep)):
                TargetAdapter.crop(cache, start + keep)
                return
            rows = torch.tensor(rows, dtype=torch.int64, device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys[..., start : start + keep, :] = layer.keys[..., start + rows, :]
            layer.values[..., start : start + keep, :] = layer.values[..., start + rows, :]
            layer.keys = layer.keys[..., : start + keep, :]
            layer.values = layer.values[..., : start + keep, :]

    @staticmethod
    def cache_length(cache) -> int:
        return cache.get_seq_length()

    def features(self, hidden_states) -> torch.Tensor:
        """The drafter's context features: concat(hidden_states[l + 1] for l in the drafter's
        target layers), [.., T, L*H]; index 0 of a transformers output is the embedding's."""
        return torch.cat([hidden_states[l + 1] for l in self.layer_ids], dim=-1)

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keeps the first `length` tokens (a negative count removes tokens in every
        transformers version; positive absolute lengths are refused by recent ones)."""
        excess = cache.get_seq_length() - length
        if excess > 0:
            cache.crop(-excess)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size
