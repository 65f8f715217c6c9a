"""The decode cycle replayed from CUDA graphs (`SpeculativeDecoder(cuda_graphs=True)`,
dblast_ext.decoding.cuda_graphs), staged behind its switch.

Everywhere: the switch (a CPU target refuses it with an error naming the argument; the
environment variable leaves a CPU decoder eager), bucket selection, and the graphs'
bookkeeping run without capture (`CycleGraphs(capture=False)`: every part eager on the fixed
buffers, padding rows and all), which must give the eager loop's tokens. Where CUDA exists:
graph replay equals the eager loop token for token (greedy and a fixed seed at T 1.0, batch 1
and a ragged batch, depths that change every cycle), the sampled tokens follow the target's
distribution, and a replayed generation never synchronises with the host."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from dblast_ext.decoding.adaptive import ScriptedDepth  # noqa: E402
from dblast_ext.decoding.cuda_graphs import BATCH_BUCKETS, ENV_VAR, CycleGraphs, bucket_for, env_switch  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from decoding_cases import (MASK, PROMPT, SMALL_VOCAB, exact_prefix_joint, hf_greedy,  # noqa: E402
                            make_decoder)
from losslessness import chi_square_pvalue  # noqa: E402

PROMPTS = [[3, 17, 42, 8, 25], [9, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68], [11, 5, 7]]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


# ---- everywhere: the switch, buckets, the bookkeeping without capture


def test_buckets_are_the_smallest_that_hold_the_rows():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24, 25, 33, 256)] == [1, 2, 4, 4, 8, 8, 16, 24, 24,
                                                                                  32, 48, 256]
    assert bucket_for(257) is None  # more rows than the largest bucket: eager
    assert bucket_for(3, buckets=(8, 2)) == 8
    assert list(BATCH_BUCKETS) == sorted(BATCH_BUCKETS)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="rows must be an integer >= 1"):
            bucket_for(bad)


def test_the_environment_switch(monkeypatch):
    for value, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv(ENV_VAR, value)
        assert env_switch() is on
    monkeypatch.delenv(ENV_VAR)
    assert env_switch() is False
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be 1 or 0.*'maybe'"):
        env_switch()


def test_asking_for_graphs_where_they_cannot_run_is_refused(tmp_path, monkeypatch):
    """cuda_graphs=True names what is missing: a CUDA target (on a CPU, or moved there
    later), the static cache, a drafter; a value other than True / False / None is refused."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the target on a CUDA device; it is on cpu"):
        make_decoder(tmp_path, target_cache="static", cuda_graphs=True)
    dec = make_decoder(tmp_path, target_cache="static")
    with pytest.raises(ValueError, match="cuda_graphs=True needs the target on a CUDA device"):
        dec.cuda_graphs = True
    assert dec.cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        dec.cuda_graphs = "yes"
    proposer_dec = SpeculativeDecoder(dec.target.model, proposer=dec.proposer, target_cache="static")
    assert proposer_dec.cuda_graphs is False
    if torch.cuda.is_available():  # the rest needs a CUDA target to get past the device check
        cuda = make_decoder(tmp_path, target_cache="dynamic", device="cuda")
        with pytest.raises(ValueError, match="cuda_graphs=True needs target_cache='static'.*'dynamic'"):
            cuda.cuda_graphs = True
        cuda.target_cache = "static"
        cuda.cuda_graphs = True
        with pytest.raises(ValueError, match="cuda_graphs=True needs target_cache='static'"):
            cuda.target_cache = "dynamic"
        cuda.target.model.to("cpu")
        cuda.drafter.to("cpu")
        with pytest.raises(ValueError, match="cuda_graphs=True needs the target on a CUDA device; it is on cpu"):
            cuda.generate(PROMPT, max_new_tokens=4)


def test_by_default_nothing_changes(tmp_path, monkeypatch):
    """Off by default (no argument, no environment variable): no CycleGraphs is made and the
    loop never calls one. DBLAST_CUDA_GRAPHS=1 on a CPU decoder leaves it eager, without error."""
    monkeypatch.delenv(ENV_VAR, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the default path must not reach the graphs")

    monkeypatch.setattr(CycleGraphs, "cycle", refuse)
    monkeypatch.setattr(CycleGraphs, "plain_step", refuse)
    dec = make_decoder(tmp_path, branches=4, target_cache="static")
    assert dec.cuda_graphs is False and dec._cycle_graphs is None
    eager = dec.generate_batch(PROMPTS, SamplingParams(1.0), max_new_tokens=12, seeds=[1, 2, 3, 4])
    monkeypatch.setenv(ENV_VAR, "1")
    env = make_decoder(tmp_path, branches=4, target_cache="static")
    assert env.cuda_graphs is False
    assert ([o.token_ids for o in env.generate_batch(PROMPTS, SamplingParams(1.0), max_new_tokens=12,
                                                     seeds=[1, 2, 3, 4])] == [o.token_ids for o in eager])


def emulated(dec, monkeypatch, **kwargs) -> CycleGraphs:
    """`dec` driven through CycleGraphs without capture (every part eager on the fixed buffers)."""
    graphs = CycleGraphs(capture=False, **kwargs)
    monkeypatch.setattr(dec, "_graphs_for_generation", lambda: graphs)
    return graphs


@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(1.0, 20, 0.9)])
def test_the_fixed_buffers_give_the_eager_tokens(tmp_path, monkeypatch, sampling):
    """Without capture, the graphs' bookkeeping (the caches adopted into fixed buffers, inputs
    copied in, padding rows, outputs copied out, a smaller bucket when rows finish, states kept
    across generations) gives the eager loop's tokens and records, batch 1 and a ragged batch
    whose rows stop at different cycles."""
    dec = make_decoder(tmp_path, "qwen3", 4, block_size=4, target_cache="static")
    seeds = [5, 6, 7, 8]
    stop = dec.generate_batch(PROMPTS, sampling, max_new_tokens=20, seeds=seeds)[1].token_ids[5]
    eager_one = dec.generate(PROMPT, sampling, max_new_tokens=20, seed=3)
    eager = dec.generate_batch(PROMPTS, sampling, max_new_tokens=20, stop_token_ids=[stop], seeds=seeds)
    assert len({len(o.token_ids) for o in eager}) > 1  # rows finish at different cycles
    graphs = emulated(dec, monkeypatch)
    for _ in range(2):  # the second generation reuses the first one's buffers
        one = dec.generate(PROMPT, sampling, max_new_tokens=20, seed=3)
        assert one.token_ids == eager_one.token_ids
        assert [(c.num_accepted, c.branch) for c in one.cycles] == [(c.num_accepted, c.branch)
                                                                    for c in eager_one.cycles]
        batch = dec.generate_batch(PROMPTS, sampling, max_new_tokens=20, stop_token_ids=[stop], seeds=seeds)
        assert [o.token_ids for o in batch] == [o.token_ids for o in eager]
        for got, want in zip(batch, eager):
            assert [(c.num_accepted, c.branch) for c in got.cycles] == [(c.num_accepted, c.branch) for c in want.cycles]
            torch.testing.assert_close(torch.tensor([c.prior for c in got.cycles]),
                                       torch.tensor([c.prior for c in want.cycles]))
    assert graphs.stats["replayed"] > 40
    assert {key[0] for key in graphs.states} >= {1, 4}  # batch 1, and the ragged batch's bucket
    captured = graphs.stats["captured"]
    dec.generate(PROMPT, sampling, max_new_tokens=20, seed=3)
    assert graphs.stats["captured"] == captured  # same shapes: nothing built again


def test_depths_that_change_every_cycle_give_the_eager_tokens(tmp_path, monkeypatch):
    """Plain steps (depth 0), short and whole blocks in turn: each (context width, depth) has its
    own graph, plain steps their own, and the tokens are the eager loop's; past `max_graphs`
    shapes the loop runs eagerly, with the same tokens."""
    sampling = SamplingParams(1.0, 20, 0.95)
    dec = make_decoder(tmp_path, "llama", 4, block_size=4, target_cache="static",
                       controller=ScriptedDepth([3, 0, 1, 2, 0, 0, 3]))
    eager = [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens=24, seeds=[1, 2, 3, 4])]
    greedy = [o.token_ids for o in dec.generate_batch(PROMPTS[:1], SamplingParams(0.0), max_new_tokens=24)]
    graphs = emulated(dec, monkeypatch)
    assert [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens=24, seeds=[1, 2, 3, 4])] == eager
    assert [o.token_ids for o in dec.generate_batch(PROMPTS[:1], SamplingParams(0.0), max_new_tokens=24)] == greedy
    assert greedy[0] == hf_greedy(dec.target.model, PROMPTS[0], 24)
    kinds = {key[0] for state in graphs.states.values() for key in state.graphs}
    assert kinds == {"cycle", "plain"}
    assert max(len(state.graphs) for state in graphs.states.values()) >= 4
    few = emulated(dec, monkeypatch, max_graphs=1)
    assert [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens=24, seeds=[1, 2, 3, 4])] == eager
    assert all(len(state.graphs) == 1 for state in few.states.values())


class ContractOnly:
    """A ChainCycle that lets the replay reach only what `chain_cycle` names as its contract with
    the graphs (the models, the kernel switch and the four steps), and records what it used."""

    CONTRACT = {"target", "proposer", "use_kernels", "draft", "score", "verify", "plain_step"}

    def __init__(self, steps):
        self._steps, self.used = steps, set()

    def __getattr__(self, name):
        if name not in self.CONTRACT:
            raise AttributeError(f"the replay reached ChainCycle.{name}, outside its contract")
        self.used.add(name)
        return getattr(self._steps, name)


def test_the_replay_needs_only_the_chain_cycle(tmp_path, monkeypatch):
    """What the graphs need from the decoder is the ChainCycle the loop hands them, and of that
    only its contract: with everything else hidden, plain steps and drafted cycles replay the
    eager loop's tokens, and every part of the contract was used."""
    sampling = SamplingParams(1.0, 20, 0.95)
    dec = make_decoder(tmp_path, "qwen3", 4, block_size=4, target_cache="static",
                       controller=ScriptedDepth([3, 0, 2]))
    eager = [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens=16, seeds=[1, 2, 3, 4])]
    graphs = emulated(dec, monkeypatch)
    seen = []
    for hook in ("cycle", "plain_step"):
        def through_contract(steps, *args, _real=getattr(graphs, hook), **kwargs):
            seen.append(ContractOnly(steps))
            return _real(seen[-1], *args, **kwargs)

        monkeypatch.setattr(graphs, hook, through_contract)
    assert [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens=16, seeds=[1, 2, 3, 4])] == eager
    assert graphs.stats["replayed"] > 0
    assert set().union(*(proxy.used for proxy in seen)) == ContractOnly.CONTRACT


def test_padding_rows_stay_inside_their_buffers(tmp_path, monkeypatch):
    """Rows that finished (a stop token ends one row early, the limit the rest) leave padding
    rows in the bucket: their lengths are reset to PAD_LENGTH, so their writes stay inside
    the capacity however long they were; the others' tokens are unchanged (batch 3 in bucket 4,
    then 2, then 1)."""
    from dblast_ext.decoding import cuda_graphs

    dec = make_decoder(tmp_path, "qwen3", 1, block_size=4, target_cache="static")
    prompts = PROMPTS[:3]
    full = [hf_greedy(dec.target.model, p, 20) for p in prompts]
    # a stop that ends row 0 after a few cycles and no other row before it
    stops = [next(t for t in full[0][3:] if t not in full[1][:8] + full[2][:8])]
    eager = [o.token_ids for o in dec.generate_batch(prompts, SamplingParams(0.0), 20, stop_token_ids=stops)]
    graphs = emulated(dec, monkeypatch)
    seen = []
    load = cuda_graphs._State.load

    def checked(state, n, *args, **kwargs):
        load(state, n, *args, **kwargs)
        seen.append((state.rows, n))
        assert (state.slot_lengths[n:] == cuda_graphs.PAD_LENGTH).all()
        assert (state.context_lens[n:] == 0).all() and (state.drafter_lengths[n:] == cuda_graphs.PAD_LENGTH).all()
        assert int(state.slot_lengths.max()) + dec.proposer.block_size <= state.layout.capacity

    monkeypatch.setattr(cuda_graphs._State, "load", checked)
    got = [o.token_ids for o in dec.generate_batch(prompts, SamplingParams(0.0), 20, stop_token_ids=stops)]
    assert got == eager and len({len(t) for t in got}) > 1
    assert (4, 3) in seen and len({rows for rows, _ in seen}) > 1  # padding, then a smaller bucket
    assert graphs.stats["copied"] > 0


def test_bad_graph_settings_are_refused():
    with pytest.raises(ValueError, match="max_graphs and max_states must be >= 1"):
        CycleGraphs(max_graphs=0)


# ---- where CUDA exists: graphs captured and replayed


def cuda_pair(tmp_path, branches=4, block_size=4, **kwargs):
    """The same pair twice on CUDA: eager, and replaying from graphs."""
    eager = make_decoder(tmp_path, "qwen3", branches, block_size=block_size, target_cache="static", device="cuda",
                         **kwargs)
    graphs = SpeculativeDecoder(eager.target.model, eager.drafter, target_cache="static", cuda_graphs=True,
                                controller=kwargs.get("controller", "off"))
    return eager, graphs


@CUDA
@pytest.mark.parametrize("branches,block_size", [(1, 16), (4, 4), (4, 16)])
def test_replay_equals_eager_at_batch_one(tmp_path, branches, block_size):
    eager, graphed = cuda_pair(tmp_path, branches, block_size)
    greedy = graphed.generate(PROMPT, SamplingParams(0.0), max_new_tokens=40)
    assert greedy.token_ids == eager.generate(PROMPT, SamplingParams(0.0), max_new_tokens=40).token_ids
    assert greedy.token_ids == hf_greedy(eager.target.model, PROMPT, 40)
    for seed in (0, 1):
        want = eager.generate(PROMPT, SamplingParams(1.0), max_new_tokens=40, seed=seed)
        got = graphed.generate(PROMPT, SamplingParams(1.0), max_new_tokens=40, seed=seed)
        assert got.token_ids == want.token_ids
        assert [(c.num_accepted, c.branch) for c in got.cycles] == [(c.num_accepted, c.branch) for c in want.cycles]
    runner = graphed._cycle_graphs
    assert runner.stats["replayed"] >= 30 and runner.stats["captured"] >= 1
    assert not runner.eager_parts, runner.eager_parts  # every part captured, none left eager


@CUDA
@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(1.0, 20, 0.9)])
def test_replay_equals_eager_on_a_ragged_batch(tmp_path, sampling):
    """Prompts of different lengths, rows stopping at different cycles (padding rows, smaller
    buckets), twice (the second generation replays the first one's graphs)."""
    eager, graphed = cuda_pair(tmp_path)
    stop = hf_greedy(eager.target.model, PROMPTS[1], 30)[6]
    want = [o.token_ids for o in eager.generate_batch(PROMPTS, sampling, 30, stop_token_ids=[stop], seeds=[5, 6, 7, 8])]
    for _ in range(2):
        got = graphed.generate_batch(PROMPTS, sampling, 30, stop_token_ids=[stop], seeds=[5, 6, 7, 8])
        assert [o.token_ids for o in got] == want
    assert not graphed._cycle_graphs.eager_parts


@CUDA
def test_replay_equals_eager_when_depths_change(tmp_path):
    eager, graphed = cuda_pair(tmp_path, controller=ScriptedDepth([3, 0, 1, 2, 0, 0, 3]))
    sampling = SamplingParams(1.0, 20, 0.95)
    want = [o.token_ids for o in eager.generate_batch(PROMPTS, sampling, 24, seeds=[1, 2, 3, 4])]
    assert [o.token_ids for o in graphed.generate_batch(PROMPTS, sampling, 24, seeds=[1, 2, 3, 4])] == want


@CUDA
def test_a_replayed_generation_never_synchronises(tmp_path):
    """Once the shapes are captured, a whole cycle (inputs in, three replays, outputs out) runs
    under torch.cuda.set_sync_debug_mode("error"): no host synchronisation inside it."""
    _, graphed = cuda_pair(tmp_path)
    runner = graphed._cycle_graphs
    sampling = SamplingParams(1.0, 20, 0.9)
    first = graphed.generate_batch(PROMPTS, sampling, 24, seeds=[1, 2, 3, 4])
    captured, cycle = runner.stats["captured"], runner.cycle

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return cycle(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.cycle = strict
    again = graphed.generate_batch(PROMPTS, sampling, 24, seeds=[1, 2, 3, 4])
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert runner.stats["captured"] == captured  # replays only


@CUDA
@pytest.mark.parametrize("branches,sampling", [(4, SamplingParams(1.0, 0, 1.0)), (4, SamplingParams(1.0, 6, 0.9))])
def test_replayed_tokens_follow_the_targets_distribution(tmp_path, branches, sampling):
    """Batches of 100 rows of two prompts (bucket 128: 28 padding rows, fewer as rows finish):
    the joint of each prompt's first four tokens, three of them committed by replayed cycles
    (the first cycle runs eagerly), and each position's marginal against the exact distribution."""
    dec = make_decoder(tmp_path, branches=branches, block_size=3, vocab=SMALL_VOCAB, mask=MASK, layers=2,
                       target_layer_ids=(0, 1), target_cache="static", device="cuda", cuda_graphs=True)
    with torch.no_grad():  # a peaked target: drafts get accepted, deep positions get reached
        dec.target.model.lm_head.weight.mul_(12.0)
    prompts, length, batch, samples = [[3, 7, 1, 8, 5], [2, 9]], 4, 100, 600
    exact = [exact_prefix_joint(dec.target.model.cpu(), p, sampling, length) for p in prompts]
    dec.target.model.to("cuda")
    dec.reset_cuda_graphs()
    counts = [np.zeros_like(e) for e in exact]
    for first in range(0, 2 * samples, batch):
        rows = [prompts[i % 2] for i in range(batch)]
        outs = dec.generate_batch(rows, sampling, max_new_tokens=6, seeds=range(first, first + batch))
        for i, out in enumerate(outs):
            counts[i % 2][tuple(out.token_ids[:length])] += 1
    assert dec._cycle_graphs.stats["replayed"] > 0
    for count, want in zip(counts, exact):
        assert count.sum() == samples and count[want == 0].sum() == 0
        assert chi_square_pvalue(count.ravel(), want.ravel() * samples) > 1e-3
        for position in range(length):
            axes = tuple(a for a in range(length) if a != position)
            assert chi_square_pvalue(count.sum(axes), want.sum(axes) * samples) > 1e-3, position
