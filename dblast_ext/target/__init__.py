"""The target: a Hugging Face causal LM as the decode loop and the drafters see it.

- `adapter`: `TargetAdapter`, one forward giving logits and the hidden states the drafter reads
  (chain and trie), over any of the caches below;
- `loading`: loading a target (the embedded SmolLM2, a local folder or a hub name), its
  tokenizer, chat template and stop tokens; `default`: where the embedded target comes from;
- the three KV caches: `reserved_cache` (grows in place), `ragged_cache` (a batch's rows of
  different lengths, compacted after each cycle), `slot_cache` (fixed slots, fixed shapes, what
  CUDA graphs need).

May import: the package's face and shared vocabulary (the top-level modules) only.
"""
from .adapter import TargetAdapter

__all__ = ["TargetAdapter"]
