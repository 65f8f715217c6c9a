"""Per-channel scaling of the target features: training reads features * scale through `fc`,
saving folds the scale into `fc.weight`, and the folded checkpoint (plain DFlash format)
computes what the scaled drafter did."""
import math

import pytest
import torch
from safetensors.torch import load_file

from dblast_ext import DBlastDrafter, DrafterConfig, load_drafter, save_pretrained
from dblast_ext.drafting.drafter import DrafterCache
from dblast_ext.drafting.drafter_io import folded_state_dict, set_feature_scale
from dblast_ext.training.block_forward import block_inputs, drafter_block_hidden
from dblast_ext.training.feature_cache import rms_feature_scale

H, LAYERS, VOCAB = 32, 2, 60


def tiny_drafter(seed=0, branches=4):
    torch.manual_seed(seed)
    drafter = DBlastDrafter(DrafterConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, block_size=4, num_target_layers=4, target_layer_ids=[0, 2], mask_token_id=VOCAB - 1,
        vocab_size=VOCAB))
    if branches > 1:
        drafter.add_branch_head(branches, generator=torch.Generator().manual_seed(seed))
    return drafter


def random_inputs(seed=0, rows=2, T=10):
    g = torch.Generator().manual_seed(seed)
    # a few huge channels and a huge first token, as raw target features have
    features = torch.randn(rows, T, LAYERS * H, generator=g)
    features[..., :4] *= 50
    features[:, 0] *= 30
    table = torch.randn(VOCAB, H, generator=g)
    input_ids = torch.randint(0, VOCAB - 1, (rows, T), generator=g)
    scale = torch.rand(LAYERS * H, generator=g) * 2 + 0.05
    return features, (lambda ids: table[ids]), input_ids, scale


def training_pass(drafter, features, embed, input_ids, anchors):
    inputs = block_inputs(drafter, embed, input_ids, anchors)
    return drafter_block_hidden(drafter, inputs["embeddings"], inputs["positions"], features, anchors)


def test_the_folded_fc_is_the_weight_times_the_scale_by_hand():
    drafter = tiny_drafter()
    weight = drafter.fc.weight.detach().clone()
    scale = torch.arange(1, LAYERS * H + 1, dtype=torch.float32) / 10
    set_feature_scale(drafter, scale, keep_function=False)
    folded = folded_state_dict(drafter)
    assert folded.keys() == tiny_drafter().state_dict().keys()          # DFlash's names, no scale tensor
    for row in (0, 5):
        for channel in (0, 17, LAYERS * H - 1):
            assert float(folded["fc.weight"][row, channel]) == pytest.approx(
                float(weight[row, channel]) * (channel + 1) / 10, rel=1e-6)
    assert torch.equal(drafter.fc.weight, weight)                       # folding leaves the training weight alone


def test_fc_reads_scaled_features_and_its_gradient_is_a_plain_linears():
    drafter = tiny_drafter(branches=1)
    features, _, _, scale = random_inputs()
    set_feature_scale(drafter, scale, keep_function=False)
    x = features[0, :3]
    out = drafter.fc(x)
    torch.testing.assert_close(out, (x * scale) @ drafter.fc.weight.T)
    upstream = torch.randn(out.shape)
    (out * upstream).sum().backward()
    torch.testing.assert_close(drafter.fc.weight.grad, upstream.T @ (x * scale))


def test_the_folded_drafter_equals_the_scaled_one(tmp_path):
    drafter = tiny_drafter()
    features, embed, input_ids, scale = random_inputs()
    set_feature_scale(drafter, scale, keep_function=False)
    anchors = torch.tensor([[2, 5], [7, 1]])
    with torch.no_grad():
        trained = training_pass(drafter, features, embed, input_ids, anchors)
    save_pretrained(drafter, str(tmp_path / "d"))
    assert set(load_file(str(tmp_path / "d" / "model.safetensors"))) == set(tiny_drafter().state_dict())
    loaded = load_drafter(str(tmp_path / "d"))
    assert type(loaded.fc) is torch.nn.Linear and loaded.fc.bias is None  # plain DFlash fc
    with torch.no_grad():
        again = training_pass(loaded, features, embed, input_ids, anchors)
        torch.testing.assert_close(again, trained, rtol=1e-5, atol=1e-5)
        # and the inference pass of the loaded drafter, block by block
        for n in range(2):
            for m in range(2):
                a = int(anchors[n, m])
                cache = DrafterCache(loaded.config, 1, 16, "cpu", torch.float32)
                block = torch.full((1, 4), loaded.config.mask_token_id)
                block[0, 0] = input_ids[n, a]
                want = loaded(embed(block), features[n:n + 1, :a], cache, use_kernels=False)
                torch.testing.assert_close(trained[n, m * 4:(m + 1) * 4], want[0], rtol=1e-5, atol=1e-5)


def test_keeping_the_function_starts_from_what_the_checkpoint_computed():
    drafter = tiny_drafter()
    features, embed, input_ids, scale = random_inputs(1)
    anchors = torch.tensor([[3, 6], [4, 8]])
    with torch.no_grad():
        before = training_pass(drafter, features, embed, input_ids, anchors)
        set_feature_scale(drafter, scale, keep_function=True)
        after = training_pass(drafter, features, embed, input_ids, anchors)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_rms_scale_by_hand():
    sq_sum = torch.tensor([4.0 * 3, 0.0, 0.25 * 3], dtype=torch.float64)     # three tokens: RMS 2, 0, 0.5
    assert rms_feature_scale(sq_sum, 3).tolist() == [0.5, 1.0, 2.0]          # a dead channel keeps scale 1
    with pytest.raises(ValueError, match="response tokens"):
        rms_feature_scale(sq_sum, 0)
    features = torch.tensor([[3.0, 4.0], [0.0, -2.0]])                        # per channel: RMS sqrt(4.5), sqrt(10)
    got = rms_feature_scale(features.double().pow(2).sum(0), 2)
    assert got.tolist() == pytest.approx([1 / math.sqrt(4.5), 1 / math.sqrt(10)])


def test_bad_scales_are_refused():
    drafter = tiny_drafter()
    with pytest.raises(ValueError, match="shape"):
        set_feature_scale(drafter, torch.ones(3), keep_function=False)
    bad = torch.ones(LAYERS * H)
    bad[4] = 0
    with pytest.raises(ValueError, match="> 0"):
        set_feature_scale(drafter, bad, keep_function=False)
    set_feature_scale(drafter, torch.ones(LAYERS * H), keep_function=False)
    with pytest.raises(ValueError, match="scaled already"):
        set_feature_scale(drafter, torch.ones(LAYERS * H), keep_function=False)
