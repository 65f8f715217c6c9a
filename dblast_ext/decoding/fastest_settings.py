"""The fastest settings that leave the output distribution unchanged, for the embedded pair.

Four choices change how fast speculative sampling runs but never what it samples
(verification is exact whatever the drafts): the dtype the models run in, the inference block
length (how many positions a cycle drafts and verifies), the draft vocabulary (which token
ids the drafter may propose) and the verification rule (one branch, or a trie of the branches'
likeliest-reached nodes in the same pass). On a GPU the defaults are already the fast ones
(bfloat16, the trained block, the whole vocabulary, one branch). On a CPU a target pass costs in proportion to the
positions it scores and the drafter's LM head is the largest share of drafting, so a shorter
block and the first 8,192 ids (a byte-level BPE tokenizer numbers its tokens most frequent first)
pay, and for a K-branch drafter a small trie (a few more rows than one branch, more tokens per
pass); bfloat16 pays only where the CPU computes it natively (AVX-512 BF16 or AMX).

The per-drafter CPU values are measurements, not guesses: results/smollm2/README.md ("What makes
a cycle cheaper on a CPU", `recipes/smollm2/measure/demo_sweep.sh`). Measure again when the drafters
change. `dblast demo` and `dblast generate` apply them to the flags left at their defaults and say
so on one line; Python users pass them to `SpeculativeDecoder` themselves:

    settings = fastest_exact_settings("cpu", "dblast-k4")
    drafter.config.block_size = settings.block_size or drafter.config.block_size
    decoder = SpeculativeDecoder(target, drafter, draft_vocab=settings.draft_vocab,
                                 verify=settings.verify, max_tree_nodes=settings.max_tree_nodes)
"""
from dataclasses import dataclass
from typing import Dict, Optional

import torch

__all__ = ["ExactSpeedSettings", "CpuFastest", "fastest_exact_settings", "cpu_has_native_bf16", "CPU_FASTEST"]

@dataclass(frozen=True)
class CpuFastest:
    """An embedded drafter's fastest measured CPU settings: inference block, draft vocabulary, and
    the verification rule with its node budget (dblast_ext.decoding.decoder.SpeculativeDecoder)."""
    block_size: int
    draft_vocab: int
    verify: str = "branch"
    max_tree_nodes: Optional[int] = None


# Measured with dblast demo on 2 cores, 2026-12-01 (block 8 + 8,192 ids: 0.87x against 0.57x for
# block 16 + all ids), and again for the retrained block-8 drafters on 2026-12-04 (dblast-k4,
# bfloat16: 1.31x; block 4, block 6 and 4,096 ids no faster). The verification rule and node budget:
# recipes/smollm2/measure/tree_budget.py on 16 held-out prompts, 2026-12-04 (round-9 drafters, T 1.0,
# bfloat16, 4 extra leaves; tokens per second, the target alone 24-25): dblast-k4 branch 29.2, trie
# of every node (28 rows) 27.4, of its 16 / 12 likeliest-reached nodes 30.5 / 30.2, of 10 / 8 / 6 / 4
# 33.1 / 32.2 / 32.2 / 30.7 (a pass of up to 14 rows costs what a branch pass of 8 does here);
# dflash-k1 branch 27.8, trie (its 7 drafts + 4 leaves) 29.7. With the shipped drafters (round 14
# dblast-k4), 2026-12-05, these settings but the block, two interleaved rounds: block 8 1.57x / 1.57x,
# block 4 1.47x / 1.47x, block 6 1.45x / 1.42x (recipes/smollm2/logs/demo-sweep-2026-12-05.log)
CPU_FASTEST: Dict[str, CpuFastest] = {
    "dflash-k1": CpuFastest(8, 8192, "tree"),
    "dblast-k4": CpuFastest(8, 8192, "tree", 10),
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX-512 BF16 or AMX tiles); without,
    torch emulates them and a bfloat16 model runs slower than a float32 one."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


@dataclass(frozen=True)
class ExactSpeedSettings:
    """dtype: a --dtype name, `why` its reason; block_size / draft_vocab: None keeps the drafter's
    trained block / the whole vocabulary; verify / max_tree_nodes: the verification rule and its
    node budget (None: every node); `source` says where they were measured."""
    dtype: str
    why: str
    block_size: Optional[int] = None
    draft_vocab: Optional[int] = None
    source: str = ""
    verify: str = "branch"
    max_tree_nodes: Optional[int] = None


def fastest_exact_settings(device_type: str, drafter: Optional[str] = None) -> ExactSpeedSettings:
    """The settings for `device_type` ("cpu" or "cuda") and `drafter` (an embedded drafter's name;
    None or another drafter: only the dtype is chosen, its block and vocabulary were never
    measured here)."""
    if device_type != "cpu":
        return ExactSpeedSettings("bfloat16", "bfloat16 on the GPU")
    native = cpu_has_native_bf16()
    dtype, why = ("bfloat16", "bfloat16 (native on this CPU)") if native else \
        ("float32", "float32 (this CPU has no native bfloat16)")
    if drafter not in CPU_FASTEST:
        return ExactSpeedSettings(dtype, why)
    fastest = CPU_FASTEST[drafter]
    return ExactSpeedSettings(dtype, why, fastest.block_size, fastest.draft_vocab,
                              f"measured fastest for {drafter} on a CPU", fastest.verify, fastest.max_tree_nodes)
