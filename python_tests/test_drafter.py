"""The DFlash-compatible drafter: checkpoint format, K-branch head, cached inference."""
import json
import types

import pytest
import torch

from dblast_ext import DrafterCache, load_drafter, save_pretrained
from dblast_ext.drafting.drafter import rope

from tiny_models import (H, HEAD_DIM, HEADS, KV_HEADS, TARGET_LAYERS, VOCAB, dflash_state,
                         write_dflash_checkpoint)


@pytest.fixture
def dflash_dir(tmp_path):
    return lambda dtype=torch.float32, **overrides: write_dflash_checkpoint(tmp_path / "dflash", dtype, **overrides)


def inputs(rows=2, context=7, block=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, block, H, generator=g), torch.randn(rows, context, len(TARGET_LAYERS) * H, generator=g))


@torch.no_grad()
def run(drafter, block, features, use_kernels=True, capacity=64):
    cache = DrafterCache(drafter.config, block.shape[0], capacity, block.device, block.dtype)
    return drafter(block, features, cache, use_kernels=use_kernels), cache


@torch.no_grad()
def dflash_semantics(drafter, block, features):
    """Independent full recompute, written the DFlash way: queries from the block (embeddings x
    input_embedding_scale), keys and values from [context, block], RoPE at absolute positions;
    a sliding layer (or any layer with is_causal) sees keys at or before the query, within the
    window counted from the query (both directions when not causal)."""
    c = drafter.config
    rows, b, t = block.shape[0], block.shape[1], features.shape[1]
    ctx = drafter.hidden_norm(drafter.fc(features))
    pos = torch.arange(t + b).expand(rows, -1)
    h = block * c.input_embedding_scale
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_norm(a.q_proj(x).view(rows, b, HEADS, HEAD_DIM)).transpose(1, 2)
        both = torch.cat([ctx, x], dim=1)
        k = a.k_norm(a.k_proj(both).view(rows, t + b, KV_HEADS, HEAD_DIM)).transpose(1, 2)
        v = a.v_proj(both).view(rows, t + b, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rope(q, pos[:, t:], c.rope_theta), rope(k, pos, c.rope_theta)
        sliding = bool(c.layer_types) and c.layer_types[i] == "sliding_attention"
        causal = sliding if c.is_causal is None else c.is_causal
        visible = torch.ones(b, t + b, dtype=torch.bool)
        for qi in range(b):
            for kj in range(t + b):
                qp = t + qi
                if causal and kj > qp:
                    visible[qi, kj] = False
                if sliding and c.sliding_window is not None and abs(qp - kj) >= c.sliding_window:
                    visible[qi, kj] = False
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1),
            attn_mask=visible)
        h = h + a.o_proj(out.transpose(1, 2).reshape(rows, b, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


def test_loads_a_dflash_checkpoint_unchanged(dflash_dir):
    drafter = load_drafter(dflash_dir(torch.bfloat16))
    state = dflash_state(torch.bfloat16)
    assert set(drafter.state_dict()) == set(state)
    for name, value in state.items():
        assert torch.equal(drafter.state_dict()[name], value), name
    assert drafter.num_branches == 1 and drafter.config.mask_token_id == 97
    assert drafter.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("layer_types,is_causal,scale", [
    (None, None, 1.0), (["sliding_attention", "full_attention"], None, 1.0),
    (["sliding_attention", "full_attention"], False, 1.0), (None, True, 2.5)])
def test_forward_matches_dflash_semantics(dflash_dir, device, use_kernels, layer_types, is_causal, scale):
    extra = {} if is_causal is None else {"is_causal": is_causal}
    nested = {"mask_token_id": 97, "target_layer_ids": TARGET_LAYERS, "input_embedding_scale": scale}
    drafter = load_drafter(dflash_dir(layer_types=layer_types, sliding_window=3, use_sliding_window=True,
                                      dflash_config=nested, **extra))
    block, features = inputs()
    expected = dflash_semantics(drafter, block, features)  # on the CPU, in float32
    out, _ = run(drafter.to(device), block.to(device), features.to(device), use_kernels)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_incremental_context_cache_matches_a_full_recompute(dflash_dir):
    drafter = load_drafter(dflash_dir())
    block, features = inputs(context=9)
    cache = DrafterCache(drafter.config, 2, 32, "cpu", torch.float32)
    drafter(block, features[:, :5], cache)  # cycle 1: five context tokens
    cache.crop(5)                           # (the block itself is never cached)
    second = drafter(block, features[:, 5:], cache)  # cycle 2: four more
    assert cache.length == 9
    torch.testing.assert_close(second, run(drafter, block, features)[0], atol=1e-5, rtol=1e-4)
    cache.crop(7)  # a rejection: forget two tokens, re-feed them
    again = drafter(block, features[:, 7:], cache)
    torch.testing.assert_close(again, second, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("branches", [1, 4])
def test_save_load_round_trip_gives_identical_outputs(dflash_dir, tmp_path, branches):
    drafter = load_drafter(dflash_dir(torch_dtype="float32"), num_branches=branches if branches > 1 else None)
    save_pretrained(drafter, str(tmp_path / "saved"))
    again = load_drafter(str(tmp_path / "saved"))
    assert again.num_branches == branches
    block, features = inputs()
    a, b = run(drafter, block, features)[0], run(again, block, features)[0]
    assert torch.equal(a, b)
    head = torch.randn(VOCAB, H)
    assert torch.equal(drafter.branch_tokens(a, head, VOCAB), again.branch_tokens(b, head, VOCAB))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 97, "target_layer_ids": TARGET_LAYERS}
    assert ("dblast_config" in config) == (branches > 1)
    assert config["torch_dtype"] == "float32"  # unknown fields survive
    # the model vLLM builds: its own DFlash class for K = 1, dblast_ext's plugin class for K > 1
    assert config["architectures"] == ["DFlashDraftModel" if branches == 1 else "DFlashDBLastDraftModel"]


@torch.no_grad()
def test_branch_head_starts_near_dflash_but_branches_differ(dflash_dir):
    drafter = load_drafter(dflash_dir(), num_branches=4)
    h = torch.randn(6, H)
    offsets = (h @ drafter.branch_expander.weight.T + drafter.branch_expander.bias).view(6, 4, H)
    assert (offsets.norm(dim=-1) < 0.01 * h.norm(dim=-1, keepdim=True)).all()  # h_z = h + small offset
    assert not torch.allclose(offsets[:, 0], offsets[:, 1])  # symmetry broken
    prior = drafter.branch_prior(h)
    torch.testing.assert_close(prior.sum(-1), torch.ones(6))
    greedy = drafter.branch_prior(h, category_temperature=0)
    assert torch.equal(greedy.argmax(-1), prior.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(6))


@torch.no_grad()
def test_branch_tokens_are_each_branch_argmax(dflash_dir):
    drafter = load_drafter(dflash_dir(), num_branches=3)
    torch.nn.init.normal_(drafter.branch_expander.weight, std=0.5)  # distinct branches
    hidden = torch.randn(2, 4, H)
    head = torch.randn(VOCAB + 3, H)
    tokens = drafter.branch_tokens(hidden, head, VOCAB)
    assert tokens.shape == (2, 3, 3)
    states = hidden[:, 1:, None, :] + (hidden[:, 1:] @ drafter.branch_expander.weight.T
                                       + drafter.branch_expander.bias).view(2, 3, 3, H)
    expected = (states @ head[:VOCAB].T).argmax(-1).transpose(1, 2)
    assert torch.equal(tokens, expected)


def test_missing_files_and_bad_configs_fail_clearly(dflash_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(str(tmp_path / "nowhere"))
    path = dflash_dir()
    raw = json.loads(open(f"{path}/config.json").read())
    del raw["dflash_config"]["target_layer_ids"]
    open(f"{path}/config.json", "w").write(json.dumps(raw))
    with pytest.raises(ValueError, match="target_layer_ids"):
        load_drafter(path)
    with pytest.raises(ValueError, match="rope_scaling"):
        load_drafter(dflash_dir(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_parameters"):
        load_drafter(dflash_dir(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}))
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        load_drafter(dflash_dir(use_sliding_window=True, sliding_window=0))
    with pytest.raises(ValueError, match="layer_types"):
        load_drafter(dflash_dir(layer_types=["full_attention"]))


@pytest.mark.parametrize("fields,window,causal", [
    # a sliding layer without use_sliding_window: causal, no window
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4), [-1, -1], [True, False]),
    # use_sliding_window without layer_types: layers from max_window_layers on slide
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), [-1, 4], [False, True]),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), [4, 4], [True, True]),
    # Qwen3's defaults: no window, every layer full
    (dict(sliding_window=4, max_window_layers=0), [-1, -1], [False, False]),
    (dict(use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"],
          is_causal=False), [-1, 4], [False, False]),
])
def test_sliding_layers_resolve_like_dflash_s_qwen3_config(dflash_dir, tmp_path, fields, window, causal):
    """DFlash reads its config as a transformers Qwen3Config: the window is in force only with
    use_sliding_window, missing layer_types follow max_window_layers, and sliding layers are
    causal unless is_causal says otherwise. A saved copy reads back the same."""
    drafter = load_drafter(dflash_dir(**fields))
    save_pretrained(drafter, str(tmp_path / "saved"))
    for c in (drafter.config, load_drafter(str(tmp_path / "saved")).config):
        assert [c.window(i) for i in range(2)] == window and [c.causal(i) for i in range(2)] == causal


@pytest.mark.parametrize("key,value", [("conv_kernel_size", 4), ("selector_rank", 8), ("causal", True),
                                       ("use_swa", True)])
def test_dflash_variants_the_drafter_does_not_implement_are_refused(dflash_dir, key, value):
    """Settings that change the math in other DFlash variants fail by name instead of being ignored
    (DFlash2's convolution and selector each need their second size: test_dflash2.py)."""
    with pytest.raises(ValueError, match=key):
        load_drafter(dflash_dir(**{key: value}))


def test_settings_that_leave_the_math_alone_load(dflash_dir):
    assert load_drafter(dflash_dir(use_swa=False, final_logit_softcapping=None, output_multiplier=1.0)).num_branches == 1
    with pytest.raises(ValueError, match="rope_parameters per layer type"):
        load_drafter(dflash_dir(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}}))


def test_config_fields_resolve_like_dflash(dflash_dir, tmp_path):
    """DFlash reads its settings from dflash_config first, then the top level; transformers 5
    writes the RoPE base inside rope_parameters; other dflash_config entries survive a save."""
    top_level = dict(mask_token_id=97, target_layer_ids=TARGET_LAYERS, dflash_config={"note": "kept"},
                     rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    raw = json.loads(open(f"{dflash_dir(block_size=None)}/config.json").read())
    raw.update(top_level)
    del raw["rope_theta"], raw["block_size"]
    open(f"{tmp_path}/dflash/config.json", "w").write(json.dumps(raw))
    drafter = load_drafter(str(tmp_path / "dflash"))
    c = drafter.config
    assert (c.mask_token_id, c.target_layer_ids, c.rope_theta, c.block_size) == (97, TARGET_LAYERS, 1e7, 16)
    save_pretrained(drafter, str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["dflash_config"] == {"note": "kept", "mask_token_id": 97, "target_layer_ids": TARGET_LAYERS}
    assert load_drafter(str(tmp_path / "saved")).config.rope_theta == 1e7


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 32, "hidden size"), ("vocab_size", 50, "mask token"), ("num_hidden_layers", 3, "target_layer_ids"),
])
def test_target_mismatch_fails_clearly(dflash_dir, field, value, message):
    config = types.SimpleNamespace(hidden_size=H, vocab_size=VOCAB, num_hidden_layers=6)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        load_drafter(dflash_dir(), target=types.SimpleNamespace(config=config))


def test_kernel_path_refuses_to_run_with_gradients(dflash_dir):
    drafter = load_drafter(dflash_dir())
    block, features = inputs()
    cache = DrafterCache(drafter.config, 2, 16, "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="inference-only"):
        drafter(block, features, cache)
    out = drafter(block, features, cache, use_kernels=False)  # training path: differentiable
    out.sum().backward()
    assert drafter.fc.weight.grad is not None


@torch.no_grad()
def test_cache_overflow_and_bad_crop_fail_clearly(dflash_dir):
    drafter = load_drafter(dflash_dir())
    block, features = inputs(context=9)
    cache = DrafterCache(drafter.config, 2, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="cache holds 8"):
        drafter(block, features, cache)
    with pytest.raises(ValueError, match="crop length"):
        cache.crop(3)
