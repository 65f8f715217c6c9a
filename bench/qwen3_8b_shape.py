"""A Qwen3-8B-shaped target and a DFlash-Qwen3-8B-shaped drafter with random bf16 weights on
the GPU (about 18 GB): the shapes of the GPU latency figures (bench/test_bench_decoding.py,
bench/gpu_cycle.py). Random weights: latency only, acceptance means nothing here."""
import torch

from dblast_ext import DBlastDrafter, DrafterConfig

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=False, rope_theta=1e6)


def qwen3_8b_pair(device="cuda"):
    """(target, drafter): the target with QWEN3_8B's shape, and a 5-layer block-16 drafter reading
    its layers 1, 9, 17, 25, 33 (the public DFlash Qwen3-8B layout), both bf16 and in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B)).eval()
            config = DrafterConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                                   num_target_layers=36, target_layer_ids=[1, 9, 17, 25, 33],
                                   mask_token_id=151669, vocab_size=151936)
            drafter = DBlastDrafter(config).eval()
    finally:
        torch.set_default_dtype(default)
    return target, drafter
