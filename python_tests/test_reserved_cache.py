"""The target cache that appends in place (dblast_ext.target.reserved_cache): the same entries and the
same model outputs as transformers' DynamicCache through every edit the decode loops make
(appends, crops, row gathers along the sequence, dropping rows), with appends writing into the
reserved buffers instead of copying the cache."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from dblast_ext.target.reserved_cache import ReservedLayer, is_prefix_view, new_reserved_cache  # noqa: E402
from dblast_ext.target.adapter import TargetAdapter, cache_argument  # noqa: E402
from tiny_models import tiny_target  # noqa: E402

HEADS, DIM = 2, 8


def _states(gen, rows, length):
    return (torch.randn(rows, HEADS, length, DIM, generator=gen),
            torch.randn(rows, HEADS, length, DIM, generator=gen))


def _assert_same(reserved, dynamic):
    assert reserved.get_seq_length() == dynamic.get_seq_length()
    for mine, theirs in zip(reserved.layers, dynamic.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=0)


def _update_both(reserved, dynamic, gen, rows, length, layers=2):
    for layer in range(layers):
        k, v = _states(gen, rows, length)
        got = reserved.update(k, v, layer)
        want = dynamic.update(k, v, layer)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_reserved_cache_matches_dynamic_cache_through_every_edit():
    gen = torch.Generator().manual_seed(0)
    reserved, dynamic = new_reserved_cache(), DynamicCache()
    _update_both(reserved, dynamic, gen, rows=3, length=11)  # prefill
    assert all(isinstance(layer, ReservedLayer) for layer in reserved.layers)
    for _ in range(5):  # single-token steps
        _update_both(reserved, dynamic, gen, rows=3, length=1)
    _assert_same(reserved, dynamic)
    _update_both(reserved, dynamic, gen, rows=3, length=6)  # a block of drafts, then a rejection
    TargetAdapter.crop(reserved, 19)
    TargetAdapter.crop(dynamic, 19)
    _assert_same(reserved, dynamic)
    _update_both(reserved, dynamic, gen, rows=3, length=4)  # tree pass, then the committed path
    TargetAdapter.keep_rows(reserved, 19, torch.tensor([0, 2]))
    TargetAdapter.keep_rows(dynamic, 19, torch.tensor([0, 2]))
    _assert_same(reserved, dynamic)
    _update_both(reserved, dynamic, gen, rows=3, length=2)
    reserved.batch_select_indices(torch.tensor([2, 0]))  # rows drop out
    dynamic.batch_select_indices(torch.tensor([2, 0]))
    _update_both(reserved, dynamic, gen, rows=2, length=1)
    _assert_same(reserved, dynamic)
    # growing far past the first reservation
    for _ in range(3):
        _update_both(reserved, dynamic, gen, rows=2, length=40)
    _assert_same(reserved, dynamic)


def test_appends_write_into_the_reserved_buffers():
    gen = torch.Generator().manual_seed(1)
    cache = new_reserved_cache()
    cache.update(*_states(gen, 2, 10), 0)
    layer = cache.layers[0]
    buffer = layer._reserved[0]
    assert buffer.shape[2] > 10  # room reserved beyond the prefill
    before = layer.keys.clone()
    for step in range(buffer.shape[2] - 10):
        k, v = _states(gen, 2, 1)
        cache.update(k, v, 0)
        assert layer._reserved[0] is buffer, f"append {step} reallocated while room remained"
        assert is_prefix_view(layer.keys, buffer) and is_prefix_view(layer.values, layer._reserved[1])
        torch.testing.assert_close(layer.keys[:, :, -1:], k, rtol=0, atol=0)
    torch.testing.assert_close(layer.keys[:, :, :10], before, rtol=0, atol=0)  # earlier entries untouched
    cache.update(*_states(gen, 2, 1), 0)  # full: a new, bigger reservation holding everything
    assert layer._reserved[0] is not buffer and layer._reserved[0].shape[2] > buffer.shape[2]
    torch.testing.assert_close(layer.keys[:, :, :10], before, rtol=0, atol=0)


def test_is_prefix_view_only_for_the_buffers_leading_slots():
    buffer = torch.randn(2, 3, 16, 4)
    assert is_prefix_view(buffer[:, :, :5], buffer)
    assert is_prefix_view(buffer, buffer)
    assert not is_prefix_view(buffer[:, :, 1:5], buffer)  # another start
    assert not is_prefix_view(buffer[:1, :, :5], buffer)  # fewer rows
    assert not is_prefix_view(buffer[:, :, :5].clone(), buffer)  # a copy


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_outputs_equal_dynamic_cache_outputs(family):
    """A real decode through a tiny model: prefill, steps, a rejected block, a left-padded batch."""
    model = tiny_target(family)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 90, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :3] = 0  # row 1 left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [new_reserved_cache(), DynamicCache()]
    outs = [model(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_argument(model): c})
            for c in caches]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=0, atol=0)
    for step in range(6):
        ids = torch.randint(3, 90, (2, 3 if step == 2 else 1), generator=gen)
        mask = torch.cat([mask, mask.new_ones(2, ids.shape[1])], dim=1)
        positions = positions[:, -1:] + 1 + torch.arange(ids.shape[1])
        outs = [model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_argument(model): c})
                for c in caches]
        torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=0, atol=0)
        if step == 2:  # reject the block's last two tokens
            for c in caches:
                TargetAdapter.crop(c, c.get_seq_length() - 2)
            mask, positions = mask[:, :-2], positions[:, :-2]
    _assert_same(*caches)
