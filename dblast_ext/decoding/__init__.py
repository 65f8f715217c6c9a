"""The decode loop: speculative sampling of a target with a drafter, exact at any temperature.

- `decoder`: `SpeculativeDecoder`, its settings and entry points (`generate`, `generate_batch`);
- the loop's parts: the one-branch cycle's device steps (`chain_cycle`), the batch loop
  (`batch_loop`), trie verification (`trie`, `trie_loop`), the target alone (`autoregressive`)
  and what they share (`generation`: outputs, cycle records, prompts and random streams);
- how deep each cycle drafts: the controllers (`adaptive`), the costs they learn while decoding
  (`learned_costs`) and the measured cost tables (`cost_calibration`);
- `cuda_graphs`: replaying the chain cycle's device steps from CUDA graphs (staged);
- `fastest_settings`: the fastest settings that leave the output unchanged, per device.

May import: the package's face and shared vocabulary (the top-level modules), `target` and
`drafting`.
"""
from .decoder import (SpeculativeDecoder, SamplingParams, GenerationOutput, CycleRecord, sample_autoregressive,
                      sample_autoregressive_batch, choose_branch, VERIFY_MODES, TARGET_CACHES, TREE_EXTRA_LEAVES)

__all__ = ["SpeculativeDecoder", "SamplingParams", "GenerationOutput", "CycleRecord", "sample_autoregressive",
           "sample_autoregressive_batch", "choose_branch", "VERIFY_MODES", "TARGET_CACHES", "TREE_EXTRA_LEAVES"]
