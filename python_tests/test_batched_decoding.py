"""Batches of prompts in one decode loop (`SpeculativeDecoder.generate_batch`): rows accept
different numbers of drafts each cycle and finish at different times, yet each row's output is
the one it would have alone, greedy outputs equal the target's, sampled rows follow the
target's distribution, and a cycle reads the device once."""
import inspect
import os

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers")
import dblast_ext  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from decoding_cases import (MASK, SMALL_VOCAB, BatchOracleProposer, exact_prefix_joint, hf_greedy,  # noqa: E402
                            make_decoder, ragged_prefill)
from losslessness import chi_square_pvalue  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

PROMPTS = [[3, 17, 42, 8, 25], [9, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68], [11, 5, 7]]
FULL = pytest.mark.slow


def oracle_batch_decoder(dec, branches, prompts):
    """`dec`'s target driven by a BatchOracleProposer, with `dec`'s target cache."""
    oracle = BatchOracleProposer(dec, branches, prompts)
    return SpeculativeDecoder(dec.target.model, proposer=oracle, target_cache=dec.target_cache, controller="off"), oracle


@pytest.mark.parametrize("family,branches,target_cache", [
    ("qwen3", 1, "dynamic"), ("qwen3", 4, "dynamic"), ("llama", 4, "dynamic"),
    ("qwen3", 1, "static"), ("llama", 4, "static"),
])
def test_batched_greedy_equals_each_prompts_own_greedy_output(tmp_path, family, branches, target_cache, device):
    """Prompts of different lengths; drafts the target accepts (a batch oracle), so rows commit
    different numbers of tokens per cycle; a stop token ends some rows early. With either
    target cache (compacted after each cycle, or fixed slots)."""
    dec = make_decoder(tmp_path, family, branches, block_size=4, target_cache=target_cache, device=device)
    expected = [hf_greedy(dec.target.model, p, 30) for p in PROMPTS]
    stop = expected[1][6]  # ends row 1 (at least) early; the others run to the limit or their own stop
    batch_dec, oracle = oracle_batch_decoder(dec, branches, PROMPTS)
    outs = batch_dec.generate_batch(PROMPTS, SamplingParams(temperature=0.0), max_new_tokens=30,
                                    stop_token_ids=[stop], on_tokens=oracle.on_tokens)
    for prompt, want, out in zip(PROMPTS, expected, outs):
        cut = want[: want.index(stop) + 1] if stop in want else want
        assert out.token_ids == cut
        assert out.stopped_by_eos == (stop in want)
        assert 1 + sum(c.num_accepted + 1 for c in out.cycles) == len(out.token_ids)
        assert oracle.prefixes[PROMPTS.index(prompt)] == prompt + out.token_ids
    accepted = [[c.num_accepted for c in out.cycles] for out in outs]
    assert len({tuple(a) for a in accepted}) > 1, "the rows should commit different numbers of tokens"
    # the real drafter too (rarely accepted: every row mostly commits one token a cycle)
    plain = dec.generate_batch(PROMPTS, SamplingParams(temperature=0.0), max_new_tokens=12)
    assert [o.token_ids for o in plain] == [e[:12] for e in expected]


@pytest.mark.parametrize("target_cache", ["dynamic", "static"])
def test_a_rows_output_does_not_depend_on_the_rest_of_the_batch(tmp_path, target_cache, device):
    """At T > 0, row r with seed s gives what generate(prompt r, seed=s) gives, in any batch
    order and beside any other rows; and the same with either target cache."""
    dec = make_decoder(tmp_path, "qwen3", branches=4, block_size=4, target_cache=target_cache, device=device)
    sampling = SamplingParams(1.0, 20, 0.95)
    seeds = [11, 22, 33, 44]
    alone = [dec.generate(p, sampling, max_new_tokens=20, seed=s).token_ids for p, s in zip(PROMPTS, seeds)]
    batch = dec.generate_batch(PROMPTS, sampling, max_new_tokens=20, seeds=seeds)
    assert [o.token_ids for o in batch] == alone
    order = [2, 0, 3, 1]
    shuffled = dec.generate_batch([PROMPTS[i] for i in order], sampling, max_new_tokens=20,
                                  seeds=[seeds[i] for i in order])
    assert [o.token_ids for o in shuffled] == [alone[i] for i in order]
    pair = dec.generate_batch([PROMPTS[0], PROMPTS[0]], sampling, max_new_tokens=20, seeds=[11, 12])
    assert pair[0].token_ids == alone[0] and pair[1].token_ids != alone[0]
    dec.target_cache = "static" if target_cache == "dynamic" else "dynamic"
    assert [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens=20, seeds=seeds)] == alone


@pytest.mark.parametrize("branches,sampling,samples,target_cache", [
    (4, SamplingParams(1.0, 0, 1.0), 400, "dynamic"),
    (4, SamplingParams(1.0, 6, 0.9), 400, "dynamic"),
    (4, SamplingParams(1.0, 6, 0.9), 400, "static"),
    pytest.param(4, SamplingParams(1.0, 0, 1.0), 2000, "dynamic", marks=FULL),
    pytest.param(1, SamplingParams(0.7, 6, 0.9), 2000, "dynamic", marks=FULL),
    pytest.param(4, SamplingParams(1.0, 0, 1.0), 2000, "static", marks=FULL),
])
def test_each_rows_tokens_follow_the_targets_distribution(tmp_path, branches, sampling, samples, target_cache):
    """Two prompts interleaved in batches of 100 rows, drafts the target often accepts (the batch
    oracle), so rows of one batch accept and finish at different points: the joint of each
    prompt's first four tokens and each position's marginal against the exact distribution."""
    dec = make_decoder(tmp_path, branches=branches, block_size=4, vocab=SMALL_VOCAB, mask=MASK, layers=2,
                       target_layer_ids=(0, 1), target_cache=target_cache)
    with torch.no_grad():  # a peaked target (top token ~0.6): drafts get accepted, deep positions get reached
        dec.target.model.lm_head.weight.mul_(12.0)
    prompts = [[3, 7, 1, 8, 5], [2, 9]]
    length, batch = 4, 100
    exact = [exact_prefix_joint(dec.target.model, p, sampling, length) for p in prompts]
    counts = [np.zeros_like(e) for e in exact]
    commits = set()
    for first in range(0, 2 * samples, batch):
        rows = [prompts[i % 2] for i in range(batch)]
        batch_dec, oracle = oracle_batch_decoder(dec, branches, rows)
        outs = batch_dec.generate_batch(rows, sampling, max_new_tokens=6, seeds=range(first, first + batch),
                                        on_tokens=oracle.on_tokens)
        for i, out in enumerate(outs):
            counts[i % 2][tuple(out.token_ids[:length])] += 1
            commits.add(tuple(c.num_accepted for c in out.cycles))
    assert len(commits) > 5  # rows took many different paths through the cycles
    for count, want in zip(counts, exact):
        assert count.sum() == samples and count[want == 0].sum() == 0
        assert chi_square_pvalue(count.ravel(), want.ravel() * samples) > 1e-3
        for position in range(length):
            axes = tuple(a for a in range(length) if a != position)
            assert chi_square_pvalue(count.sum(axes), want.sum(axes) * samples) > 1e-3, position


PACKAGE = os.path.dirname(dblast_ext.__file__)
HOST_READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the tensor-to-host reads (item, tolist, int(...), .cpu(), ...) made by code in
    dblast_ext (not by transformers or torch), with where each happened. (`.to(device)` is
    not counted: on a CPU it cannot be told from a same-device no-op.)"""

    def __init__(self):
        super().__init__()
        self.where = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            caller = inspect.currentframe().f_back
            while caller and caller.f_code.co_filename.startswith(os.path.dirname(torch.__file__)):
                caller = caller.f_back
            if caller and caller.f_code.co_filename.startswith(PACKAGE):
                self.where.append(f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("branches,target_cache", [(1, "dynamic"), (4, "dynamic"), (4, "static")])
def test_a_cycle_reads_the_device_once(tmp_path, branches, target_cache, device):
    """The loop's host reads: the prefill's first tokens, one per cycle (accepted counts and
    tokens together), the records once at the end. Branch choice, uniforms, the drafter's
    cache and the target's mask, positions and commit never read the device."""
    dec = make_decoder(tmp_path, "qwen3", branches, block_size=4, target_cache=target_cache, device=device)
    with HostReads() as reads:
        outs = dec.generate_batch(PROMPTS, SamplingParams(1.0, 20, 0.9), max_new_tokens=24, seeds=[1, 2, 3, 4])
    cycles = max(len(o.cycles) for o in outs)
    assert cycles >= 5
    assert len(reads.where) == cycles + 2, reads.where


@pytest.mark.parametrize("target_cache", ["dynamic", "static"])
def test_the_target_alone_batched_matches_its_own_greedy_output(tmp_path, target_cache, device):
    """The baseline batched the same way (either target cache): greedy equals the target's
    own, and a row's sampled tokens do not depend on the batch."""
    dec = make_decoder(tmp_path, "qwen3", 1, block_size=4, target_cache=target_cache, device=device)
    expected = [hf_greedy(dec.target.model, p, 16) for p in PROMPTS]
    stop = expected[2][3]
    outs = dec.generate_autoregressive_batch(PROMPTS, SamplingParams(temperature=0.0), max_new_tokens=16,
                                             stop_token_ids=[stop])
    assert [o.token_ids for o in outs] == [e[: e.index(stop) + 1] if stop in e else e for e in expected]
    sampling = SamplingParams(1.0)
    alone = [dec.generate_autoregressive_batch([p], sampling, max_new_tokens=10, seeds=[7])[0].token_ids
             for p in PROMPTS]
    together = dec.generate_autoregressive_batch(PROMPTS, sampling, max_new_tokens=10, seeds=[7] * 4)
    assert [o.token_ids for o in together] == alone


def test_ragged_rows_keep_each_rows_cache_entries(tmp_path):
    """After commits of different lengths and a row dropping out, every row's cache entries
    are those of the same tokens run alone (a compaction that moved the wrong slots, or a
    mask that let a row see another's padding, changes them)."""
    adapter = make_decoder(tmp_path, "qwen3", 1).target
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    layout, cache, _ = ragged_prefill(adapter, prompts)
    blocks = [[[20, 21, 22], [23, 24, 25], [26, 27, 28]], [[30, 31, 32], [33, 34, 35], [36, 37, 38]]]
    keeps = [[1, 3, 2], [2, 1, 3]]
    for block, kept in zip(blocks, keeps):
        mask, positions = layout.block_inputs(3, "cpu")
        adapter.forward(torch.tensor(block), cache, attention_mask=mask, position_ids=positions)
        layout.commit(cache, kept)
        for row, k in enumerate(kept):
            prompts[row] = prompts[row] + block[row][:k]
    layout.select(cache, [0, 2])
    for row, prompt in zip((0, 1), (prompts[0], prompts[2])):
        alone = adapter.new_cache()
        adapter.forward(torch.tensor([prompt]), alone)
        start, end = layout.starts[row], layout.ends[row]
        for batched, single in zip(cache.layers, alone.layers):
            torch.testing.assert_close(batched.keys[row, :, start:end], single.keys[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(batched.values[row, :, start:end], single.values[0], rtol=1e-4, atol=1e-5)


def test_bad_batches_are_refused_before_any_model_runs(tmp_path):
    dec = make_decoder(tmp_path)
    with pytest.raises(ValueError, match=r"prompts\[1\].*empty"):
        dec.generate_batch([[1, 2], []])
    with pytest.raises(ValueError, match="one seed per prompt"):
        dec.generate_batch([[1, 2], [3]], seeds=[0])
    with pytest.raises(ValueError, match="prompts is empty"):
        dec.generate_batch([])
    tree = make_decoder(tmp_path, branches=2, verify="tree")
    with pytest.raises(ValueError, match="one prompt at a time"):
        tree.generate_batch([[1, 2]])
