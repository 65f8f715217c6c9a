"""Per-cycle latency of speculative decoding (draft + verify) for K in {1, 2, 4, 8} on a tiny
random Qwen3 target (CPU), kernels next to the reference ops. Each round generates 32 tokens
at T = 1.0; extra_info carries the mean draft and verify time per cycle."""
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_tests"))

from dblast_ext import load_drafter  # noqa: E402
from dblast_ext.decoding import SamplingParams, SpeculativeDecoder  # noqa: E402
from tiny_models import tiny_target, write_dflash_checkpoint  # noqa: E402

PROMPT = [3, 17, 42, 8, 25, 61, 9, 77]


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("branches", [1, 2, 4, 8])
def test_decode_cycle(benchmark, tmp_path, branches, impl):
    if torch.cuda.is_available():
        pytest.skip("the GPU latency run (Qwen3-8B shapes) belongs to the device check")
    target = tiny_target("qwen3")
    drafter = load_drafter(write_dflash_checkpoint(tmp_path / "d", block_size=16), target=target,
                           num_branches=branches if branches > 1 else None)
    decoder = SpeculativeDecoder(target, drafter, use_kernels=impl == "op")
    benchmark.group = f"decode cycle cpu tiny-qwen3 K={branches} block=16"
    out = benchmark(lambda: decoder.generate(PROMPT, SamplingParams(1.0), max_new_tokens=32, seed=0))
    cycles = out.cycles
    benchmark.extra_info["cycles"] = len(cycles)
    benchmark.extra_info["draft_ms"] = 1e3 * sum(c.draft_time for c in cycles) / len(cycles)
    benchmark.extra_info["verify_ms"] = 1e3 * sum(c.verify_time for c in cycles) / len(cycles)
