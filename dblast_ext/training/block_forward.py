"""The drafter's training forward: many blocks of one sequence in a single pass.

A block starts at an anchor a (a committed token): positions a..a+B-1 hold [x_a, mask x (B-1)]
and position k predicts x_{a+k}. Its queries see the context features strictly before the
anchor and their own block (in a sliding-window or causal layer, only the keys
`reference.key_visible` allows), and no other block: the attention the inference pass has
after committing x_0..x_a (docs/design.md, the drafter), so one training pass serves M blocks. The
mask is dense and goes through scaled_dot_product_attention on every device.
"""
from typing import Dict

import torch
import torch.nn.functional as F

from ..drafting.drafter import DBlastDrafter, rotary_tables
from ..reference import key_visible


def training_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int,
                            window: int = -1, causal: bool = False) -> torch.Tensor:
    """Boolean [N, M*B, T + M*B] (True = visible) for anchors [N, M] over T context features:
    query (m, k), at position a_m + k, sees context key t iff t < a_m, and block key (m', k')
    iff m' == m, each only where `key_visible` allows (window, causal)."""
    rows, blocks = anchors.shape
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)[:, :, None]           # [N, M*B, 1]
    offset = torch.arange(block_size, device=device).repeat(blocks)                   # k of every query / key
    query_position = query_anchor + offset[None, :, None]
    t = torch.arange(context_len, device=device)[None, None, :]
    context = (t < query_anchor) & key_visible(query_position, t, window=window, causal=causal)
    block_of = torch.arange(blocks, device=device).repeat_interleave(block_size)
    own = (block_of[:, None] == block_of[None, :]) & key_visible(offset[:, None], offset[None, :], window=window,
                                                                 causal=causal)
    return torch.cat([context, own.expand(rows, -1, -1)], dim=-1)


def block_inputs(drafter: DBlastDrafter, embed, input_ids: torch.Tensor, anchors: torch.Tensor) -> Dict:
    """Block embeddings [N, M*B, H] ([x_a, mask...] per anchor) and their absolute positions."""
    block = drafter.config.block_size
    rows, blocks = anchors.shape
    tokens = torch.full((rows, blocks, block), drafter.config.mask_token_id, dtype=torch.long,
                        device=input_ids.device)
    tokens[:, :, 0] = input_ids.gather(1, anchors)
    positions = anchors[:, :, None] + torch.arange(block, device=anchors.device)
    return {"embeddings": embed(tokens.view(rows, blocks * block)), "positions": positions.view(rows, blocks * block)}


def drafter_block_hidden(drafter: DBlastDrafter, block_embeddings: torch.Tensor, block_positions: torch.Tensor,
                         context_features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [N, M*B, H] of every block, differentiable (plain PyTorch)."""
    c = drafter.config
    rows, context_len = context_features.shape[:2]
    dtype = drafter.fc.weight.dtype
    # with feature scaling, fc is drafter_io.FeatureScaledLinear: fc(x * scale), as at inference
    context = drafter.hidden_norm(drafter.fc(context_features.to(dtype)))
    ctx_positions = torch.arange(context_len, device=context.device).expand(rows, context_len)
    ctx_rope = rotary_tables(ctx_positions, c.head_dim, c.rope_theta)
    blk_rope = rotary_tables(block_positions, c.head_dim, c.rope_theta)
    masks = {}
    h = drafter.scale_embeddings(block_embeddings.to(dtype))
    for i, layer in enumerate(drafter.layers):
        kind = c.window(i), c.causal(i)
        if kind not in masks:
            masks[kind] = training_attention_mask(anchors, context_len, c.block_size, *kind)[:, None]
        attn = layer.self_attn
        k_ctx, v_ctx = attn.project_keys_values(context, ctx_rope)

        def attend(q, k_blk, v_blk, k_ctx=k_ctx, v_ctx=v_ctx, mask=masks[kind], gqa=attn.heads != attn.kv_heads):
            return F.scaled_dot_product_attention(q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2),
                                                  attn_mask=mask, enable_gqa=gqa)

        h = layer(h, blk_rope, attend, c.block_size)  # DFlash2 convolutions: per block
    return drafter.norm(h)
