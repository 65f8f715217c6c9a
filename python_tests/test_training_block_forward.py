"""The training mask against a brute-force construction, and the many-block training pass
against the inference pass of one block at a time."""
import pytest
import torch

from dblast_ext import load_drafter
from dblast_ext.drafting.drafter import DrafterCache
from dblast_ext.training.block_forward import block_inputs, drafter_block_hidden, training_attention_mask
from tiny_models import TARGET_LAYERS, write_dflash_checkpoint


@pytest.mark.parametrize("window,causal", [(-1, False), (3, False), (3, True), (-1, True)])
def test_mask_equals_brute_force(window, causal):
    """Query k of block m (position a_m + k) sees context feature t < a_m within the window, and
    key k' of its own block if causal order and the window allow (DFlash's sliding layers)."""
    anchors = torch.tensor([[2, 7, 5], [0, 9, 4]])
    T, B = 11, 4
    mask = training_attention_mask(anchors, T, B, window, causal)
    assert mask.shape == (2, 3 * B, T + 3 * B)

    def near(distance):
        return window <= 0 or distance < window

    for n in range(2):
        for m in range(3):
            a = int(anchors[n, m])
            for k in range(B):
                for j in range(T + 3 * B):
                    if j < T:
                        want = j < a and near(a + k - j)
                    else:
                        other, kk = divmod(j - T, B)
                        want = other == m and (not causal or kk <= k) and near(abs(k - kk))
                    assert bool(mask[n, m * B + k, j]) == want, (n, m, k, j)


@pytest.mark.parametrize("layer_types,is_causal", [(None, None), (["sliding_attention", "full_attention"], None),
                                                   (["sliding_attention", "full_attention"], False), (None, True)])
def test_training_pass_equals_the_inference_pass_per_block(tmp_path, layer_types, is_causal):
    extra = {"layer_types": layer_types, "sliding_window": 3, "use_sliding_window": True} if layer_types else {}
    if is_causal is not None:
        extra["is_causal"] = is_causal
    extra["dflash_config"] = {"mask_token_id": 97, "target_layer_ids": TARGET_LAYERS, "input_embedding_scale": 1.5}
    drafter = load_drafter(write_dflash_checkpoint(tmp_path / "d", block_size=4, **extra))
    c = drafter.config
    g = torch.Generator().manual_seed(0)
    rows, T, H = 2, 12, c.hidden_size
    features = torch.randn(rows, T, len(c.target_layer_ids) * H, generator=g)
    input_ids = torch.randint(0, 90, (rows, T), generator=g)
    table = torch.randn(100, H, generator=g)
    embed = lambda ids: table[ids]  # noqa: E731
    anchors = torch.tensor([[3, 8, 1], [10, 5, 6]])
    inputs = block_inputs(drafter, embed, input_ids, anchors)
    hidden = drafter_block_hidden(drafter, inputs["embeddings"], inputs["positions"], features, anchors)
    with torch.no_grad():
        for n in range(rows):
            for m in range(3):
                a = int(anchors[n, m])
                cache = DrafterCache(c, 1, T + c.block_size, "cpu", torch.float32)
                block = torch.full((1, c.block_size), c.mask_token_id)
                block[0, 0] = input_ids[n, a]
                want = drafter(embed(block), features[n : n + 1, :a], cache, use_kernels=True)
                got = hidden[n, m * c.block_size : (m + 1) * c.block_size]
                torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    hidden.sum().backward()  # differentiable end to end
    assert drafter.fc.weight.grad is not None and torch.isfinite(drafter.fc.weight.grad).all()
