"""Per-cycle latency of speculative decoding (draft + verify) for K in {1, 2, 4, 8}.

CPU: a tiny random Qwen3 target, kernels next to the reference ops; each round generates
32 tokens at T = 1.0. CUDA (the device check): a Qwen3-8B-shaped target and a DFlash-
Qwen3-8B-shaped drafter (5 layers, block 16) with random bf16 weights, latency only; each
round generates 64 tokens after a 512-token prompt. extra_info carries the mean draft,
verify and cycle times, so summarize.py can report the overhead of K branches over K = 1
(DBLast measured +1.4% for K = 4; the target here is at most +1.5%).
"""
import copy
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_tests"))

from dblast_ext import load_drafter  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from tiny_models import tiny_target, write_dflash_checkpoint  # noqa: E402

import qwen3_8b_shape  # noqa: E402  (bench/)

PROMPT = [3, 17, 42, 8, 25, 61, 9, 77]
BRANCHES = [1, 2, 4, 8]


def record_cycles(benchmark, out):
    cycles = out.cycles
    draft = sum(c.draft_time for c in cycles) / len(cycles)
    verify = sum(c.verify_time for c in cycles) / len(cycles)
    benchmark.extra_info.update(cycles=len(cycles), draft_ms=1e3 * draft, verify_ms=1e3 * verify,
                                cycle_ms=1e3 * (draft + verify))


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("branches", BRANCHES)
def test_decode_cycle(benchmark, tmp_path, branches, impl):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the decode latency run uses Qwen3-8B shapes (test_decode_cycle_qwen3_8b_shape)")
    target = tiny_target("qwen3")
    drafter = load_drafter(write_dflash_checkpoint(tmp_path / "d", block_size=16), target=target,
                           num_branches=branches if branches > 1 else None)
    # controller off: the benchmark times the cycle at the whole block, not the adaptive controller
    decoder = SpeculativeDecoder(target, drafter, use_kernels=impl == "op", controller="off")
    benchmark.group = f"decode cycle cpu tiny-qwen3 K={branches} block=16"
    out = benchmark(lambda: decoder.generate(PROMPT, SamplingParams(1.0), max_new_tokens=32, seed=0))
    record_cycles(benchmark, out)


@pytest.fixture(scope="module")
def qwen3_8b_pair():
    return qwen3_8b_shape.qwen3_8b_pair()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (about 18 GB)")
@pytest.mark.parametrize("branches", BRANCHES)
def test_decode_cycle_qwen3_8b_shape(benchmark, qwen3_8b_pair, branches):
    target, base = qwen3_8b_pair
    drafter = copy.deepcopy(base)
    if branches > 1:
        drafter.add_branch_head(branches, generator=torch.Generator().manual_seed(branches))
    decoder = SpeculativeDecoder(target, drafter, controller="off")
    prompt = torch.randint(0, 151000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    benchmark.group = f"decode cycle cuda Qwen3-8B-shape K={branches} block=16 bf16"

    out = benchmark.pedantic(generate_synchronized, args=(decoder, prompt), rounds=3, warmup_rounds=1)
    record_cycles(benchmark, out)
    del drafter, decoder
    torch.cuda.empty_cache()


def generate_synchronized(decoder, prompt):
    """64 tokens at T 1.0, timed to the end of the device's work."""
    out = decoder.generate(prompt, SamplingParams(1.0), max_new_tokens=64, seed=0)
    torch.cuda.synchronize()
    return out
