"""The fixed-shape target cache (`dblast_ext.target.slot_cache`, `SpeculativeDecoder(target_cache="static")`):
each row's cache entries are those of its tokens run alone, every verify forward has the same
shapes and writes into the same buffers (what replaying it from a CUDA graph needs), and the
decode loop gives the dynamic cache's outputs. (The loop's outputs with it, greedy and sampled,
batched and alone, are also checked in test_batched_decoding.py.)"""
import pytest
import torch

pytest.importorskip("transformers")
from dblast_ext.decoding.decoder import SamplingParams, sample_autoregressive_batch  # noqa: E402
from dblast_ext.target.slot_cache import SlotRows  # noqa: E402
from decoding_cases import make_decoder, ragged_prefill  # noqa: E402

PROMPTS = [[3, 17, 42, 8, 25], [9, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68], [11, 5, 7]]


def test_slot_rows_keep_each_rows_cache_entries(tmp_path):
    """After commits of different lengths (device tensors) and a row dropping out, row r's
    first lengths[r] slots hold the keys and values of its tokens run alone: a prefill copied
    to the wrong slots, a block written at another row's length or a mask that lets a row see
    stale slots changes them."""
    adapter = make_decoder(tmp_path, "qwen3", 1).target
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    ragged, cache, _ = ragged_prefill(adapter, prompts)
    rows, cache = SlotRows.from_prefill(cache, ragged, capacity=16)
    blocks = [[[20, 21, 22], [23, 24, 25], [26, 27, 28]], [[30, 31, 32], [33, 34, 35], [36, 37, 38]]]
    keeps = [[1, 3, 2], [2, 1, 3]]
    for block, kept in zip(blocks, keeps):
        mask, positions = rows.block_inputs(3, "cpu")
        assert mask.shape == (3, 1, 3, 16) and positions.shape == (3, 3)
        adapter.forward(torch.tensor(block), cache, attention_mask=mask, position_ids=positions)
        rows.commit(cache, torch.tensor(kept))
        for row, k in enumerate(kept):
            prompts[row] = prompts[row] + block[row][:k]
    rows.select(cache, [0, 2])
    assert rows.lengths.tolist() == [len(prompts[0]), len(prompts[2])]
    for row, prompt in zip((0, 1), (prompts[0], prompts[2])):
        alone = adapter.new_cache()
        adapter.forward(torch.tensor([prompt]), alone)
        for slotted, single in zip(cache.layers, alone.layers):
            torch.testing.assert_close(slotted.keys[row, :, : len(prompt)], single.keys[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(slotted.values[row, :, : len(prompt)], single.values[0], rtol=1e-4, atol=1e-5)


def record_verify_forwards(decoder):
    """Wraps the decoder's target forward: for every forward after the prefill, the shapes of
    its inputs, mask and positions and the addresses of the cache's buffers."""
    calls, forward = [], decoder.target.forward

    def recording(input_ids, cache, **kwargs):
        if kwargs.get("last_logits_only"):
            return forward(input_ids, cache, **kwargs)
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        calls.append((tuple(input_ids.shape), tuple(mask.shape), tuple(positions.shape),
                      tuple(p for layer in cache.layers for p in (layer.keys.data_ptr(), layer.values.data_ptr()))))
        return forward(input_ids, cache, **kwargs)

    decoder.target.forward = recording
    return calls


@pytest.mark.parametrize("branches", [1, 4])
def test_every_verify_forward_has_the_same_shapes_and_buffers(tmp_path, branches, device):
    """One prompt: every cycle's forward has the same input, mask and position shapes and
    writes into the same buffers, however many tokens each cycle committed. A batch: the same
    between two rows' finishing (a finished row drops out, which changes the batch size)."""
    dec = make_decoder(tmp_path, "qwen3", branches, block_size=4, target_cache="static", device=device)
    calls = record_verify_forwards(dec)
    out = dec.generate(PROMPTS[0], SamplingParams(1.0, 20, 0.9), max_new_tokens=40, seed=3)
    assert len(calls) == len(out.cycles) >= 10
    assert len(set(calls)) == 1, set(calls)
    assert calls[0][1] == (1, 1, 4, len(PROMPTS[0]) + 40 + 4)
    calls.clear()
    outs = dec.generate_batch(PROMPTS, SamplingParams(1.0, 20, 0.9), max_new_tokens=30,
                              seeds=[1, 2, 3, 4])
    assert len(calls) == max(len(o.cycles) for o in outs)
    by_rows = {}
    for call in calls:
        by_rows.setdefault(call[0][0], set()).add(call)
    assert all(len(shapes) == 1 for shapes in by_rows.values()), by_rows


def prepared_cycle(dec, prompts):
    """The state after generate_batch's prefill with the static cache, for one cycle: anchors,
    the drafter's context and its lengths, the drafter cache, the SlotRows and its cache."""
    adapter, block = dec.target, dec.proposer.block_size
    layout, cache, features = ragged_prefill(adapter, prompts)
    context, lens = layout.left_align(features), torch.tensor(layout.lengths, device=adapter.device)
    rows, slotted = SlotRows.from_prefill(cache, layout, layout.end + 16 + block)
    proposer_cache = dec.proposer.new_cache(len(prompts), layout.end + 16 + 2 * block, adapter.device)
    anchors = torch.tensor([30, 31, 32], device=adapter.device)[: len(prompts)]
    return anchors, context, lens, proposer_cache, rows, slotted


@pytest.mark.parametrize("branches", [1, 4])
def test_the_cycle_traces_as_one_graph(tmp_path, branches, device):
    """The cycle's device-side steps (propose, branch choice, the static-cache target forward,
    branch_verify without validation) trace with torch.compile(fullgraph=True) into one graph
    with no host read in it (no item / tolist: dynamo would otherwise trace a read as a scalar
    op), which capturing the cycle in a CUDA graph needs. Run from that graph, they give the
    eager cycle's accepted counts, tokens and features and leave the caches in the same state."""
    dec = make_decoder(tmp_path, "qwen3", branches, block_size=4, target_cache="static", device=device)
    sampling = SamplingParams(1.0, 20, 0.9)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    uniforms = torch.rand(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)

    def cycle(anchors, context, lens, proposer_cache, rows, slotted):
        proposal, branch, draft = dec.chain_cycle.draft(anchors, context, lens, proposer_cache, uniforms)
        result, features = dec.chain_cycle.score_and_verify(anchors, draft, proposal, branch, uniforms, rows, slotted,
                                                            sampling, validate=False)
        return result.num_accepted, result.output_tokens, features

    graphs = []

    def keep_graph(graph_module, example_inputs):  # a dynamo backend: run the traced graph as it is
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(cycle, fullgraph=True, backend=keep_graph, dynamic=False)
    with torch.inference_mode():
        eager_state, compiled_state = prepared_cycle(dec, prompts), prepared_cycle(dec, prompts)
        eager, traced = cycle(*eager_state), compiled(*compiled_state)
    reads = [str(node.target) for node in graphs[0].graph.nodes
             if str(node.target) in ("item", "tolist", "numpy", "cpu") or "local_scalar_dense" in str(node.target)]
    assert len(graphs) == 1 and not reads, reads
    for a, b in zip(eager, traced):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(eager_state[3].lengths, compiled_state[3].lengths, rtol=0, atol=0)
    for a, b in zip(eager_state[5].layers, compiled_state[5].layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)


@pytest.mark.parametrize("max_new_tokens", [2, 3, 9])
def test_the_last_block_fits_its_slots(tmp_path, max_new_tokens, device, monkeypatch):
    """The fixed capacity (longest prompt + max_new_tokens + block) holds every cycle's block
    whatever the limit (each write slot is checked against it, rather than left to the
    scatter's bounds check), and the outputs are the dynamic cache's."""
    dec = make_decoder(tmp_path, "llama", 4, block_size=4, device=device)
    sampling = SamplingParams(1.0, 20, 0.9)
    dynamic = [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens, seeds=[5, 6, 7, 8])]
    highest, block_inputs = [], SlotRows.block_inputs

    def checked(rows, block, where):
        mask, positions = block_inputs(rows, block, where)
        highest.append((int(positions.max()), rows.capacity))
        return mask, positions

    monkeypatch.setattr(SlotRows, "block_inputs", checked)
    dec.target_cache = "static"
    static = [o.token_ids for o in dec.generate_batch(PROMPTS, sampling, max_new_tokens, seeds=[5, 6, 7, 8])]
    assert static == dynamic and all(len(t) == max_new_tokens for t in static)
    assert highest and all(slot < capacity for slot, capacity in highest), highest
    assert max(capacity - slot for slot, capacity in highest) <= max(map(len, PROMPTS)) + max_new_tokens


def test_bad_target_cache_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="target_cache must be one of dynamic, static, got 'fixed'"):
        make_decoder(tmp_path, target_cache="fixed")
    with pytest.raises(ValueError, match="target_cache='static' verifies one branch.*verify='tree'"):
        make_decoder(tmp_path, branches=2, verify="tree", target_cache="static")
    tree = make_decoder(tmp_path, branches=2, verify="tree")
    with pytest.raises(ValueError, match="target_cache='static' verifies one branch"):
        tree.target_cache = "static"  # set later: checked the same
    dec = make_decoder(tmp_path)
    with pytest.raises(ValueError, match="target_cache must be one of"):
        dec.target_cache = "Static"
    with pytest.raises(ValueError, match="target_cache must be one of"):
        sample_autoregressive_batch(dec.target, [[1, 2]], target_cache="fixed")
    dec.target.model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="needs the target's attention to be 'sdpa' or 'eager'.*flash_attention_2"):
        dec.target_cache = "static"
    rows = SlotRows(torch.tensor([3]), 8, torch.float32)
    with pytest.raises(ValueError, match="block must be >= 1"):
        rows.block_inputs(0, "cpu")
    adapter = make_decoder(tmp_path).target
    ragged, cache, _ = ragged_prefill(adapter, [[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="capacity must hold the longest prompt: 4 < 5"):
        SlotRows.from_prefill(cache, ragged, capacity=4)
    rows, slotted = SlotRows.from_prefill(cache, ragged, capacity=12)
    with pytest.raises(RuntimeError, match="needs SlotRows.block_inputs"):
        adapter.forward(torch.tensor([[6, 7]]), slotted, attention_mask=torch.zeros(1, 1, 2, 12),
                        position_ids=torch.tensor([[5, 6]]))
    with pytest.raises(NotImplementedError, match="use SlotRows.commit / select"):
        slotted.crop(-1)  # a crop would leave the rows' lengths wrong
