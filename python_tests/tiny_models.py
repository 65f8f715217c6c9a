"""Tiny models built in the tests from configs (no downloads): a DFlash-format drafter
checkpoint with the public key names, and random Qwen3 / Llama targets it fits."""
import json
import os

import torch
from safetensors.torch import save_file

H, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 64, 4, 2, 16, 128, 2, 100
TARGET_LAYERS = [1, 4]


def lm_head_rows(model):
    """Records how many positions each LM-head call of `model` projects."""
    rows = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    return rows


def dflash_state(dtype=torch.float32, seed=0):
    """Exact key names and shapes of a DFlash checkpoint for a small Qwen3 config."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, len(TARGET_LAYERS) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H), p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H), p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
            p + "mlp.down_proj.weight": (H, INTER),
        })
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        else:
            state[name] = (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(dtype)
    return state


def dflash_config(**overrides):
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "attention_bias": False, "vocab_size": VOCAB, "block_size": 4, "num_target_layers": 6,
              "dflash_config": {"mask_token_id": 97, "target_layer_ids": TARGET_LAYERS}}
    config.update(overrides)
    return config


def write_dflash_checkpoint(path, dtype=torch.float32, seed=0, **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dflash_config(**overrides), f)
    save_file(dflash_state(dtype, seed), os.path.join(path, "model.safetensors"))
    return str(path)


def dflash2_config(**overrides):
    """A DFlash2 config in the published layout (dflash_config holds the block and the DFlash2
    settings; every layer sliding, not causal) for the tiny Qwen3 shapes."""
    config = dflash_config(architectures=["DFlash2DraftModel"], block_size=None, is_causal=False,
                           layer_types=["sliding_attention"] * LAYERS, sliding_window=2048, use_sliding_window=True,
                           dflash_config={"block_size": 4, "mask_token_id": 97, "target_layer_ids": TARGET_LAYERS,
                                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                          "selector_top_k": 4, "output_multiplier": 0.5,
                                          "final_logit_softcapping": 20.0})
    del config["block_size"]
    config.update(overrides)
    return config


def dflash2_state(dtype=torch.float32, seed=0, codebook_suffix="", vocab=VOCAB):
    """DFlash's tensors plus DFlash2's, by their published names (codebooks bare unless
    `codebook_suffix` is ".weight"; `vocab` rows)."""
    g = torch.Generator().manual_seed(seed + 1)
    state = dflash_state(dtype, seed)
    groups = H // 16
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.3 * torch.randn(2, 2, H, generator=g)
            base[:, 0] += 1.0  # near the identity, as a trained drafter starts
            state[f"layers.{i}.{conv}.base_kernel"] = base.to(dtype)
            state[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                0.1 * torch.randn(2 * 2 * groups, H, generator=g) / H ** 0.5).to(dtype)
    state["candidate_selector.hidden_projection.weight"] = (torch.randn(8, H, generator=g) / H ** 0.5).to(dtype)
    for name in ("predecessor", "successor"):
        state[f"candidate_selector.{name}_codebook{codebook_suffix}"] = torch.randn(vocab, 8, generator=g).to(dtype)
    return state


def write_dflash2_checkpoint(path, dtype=torch.float32, seed=0, codebook_suffix="", **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    config = dflash2_config(**overrides)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dflash2_state(dtype, seed, codebook_suffix, config["vocab_size"]), os.path.join(path, "model.safetensors"))
    return str(path)


def tiny_target(family: str = "qwen3", seed: int = 0, vocab_size: int = VOCAB, layers: int = 6):
    """A random causal LM of the drafter's hidden size with `layers` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=H, intermediate_size=INTER, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(family)
    return model.eval()


CHAT_TEMPLATE = ("{% for m in messages %}<|turn|> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|turn|> assistant {% endif %}")


def tiny_tokenizer(vocab_size: int = VOCAB, eos_id: int = 1):
    """A word-level tokenizer over the words t0..t{V-1} (id i is "t{i}"), with an unknown
    token, an end-of-sequence token and a chat template: enough for the CLI's text path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab_size)}
    words["<unk>"], words["<|eos|>"], words["<|turn|>"] = 0, eos_id, 2
    del words["t0"], words[f"t{eos_id}"], words["t2"]
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|eos|>",
                                   chat_template=CHAT_TEMPLATE)


def write_tiny_target_dir(path, family: str = "qwen3", eos_id: int = 1, logit_scale: float = 1.0, **kwargs) -> str:
    """A tiny random target saved like a Hugging Face model directory, tokenizer included.
    `logit_scale` multiplies the LM head: a random model's next-token distributions are
    nearly uniform, a scaled one has structure a drafter can learn."""
    model = tiny_target(family, **kwargs)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size, eos_id).save_pretrained(path)
    return str(path)
