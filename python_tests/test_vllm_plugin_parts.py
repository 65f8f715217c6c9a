"""The parts of the vLLM plugin that need no vLLM: the branch choice, the chosen branch's states,
the CPU expand-kernel mend, what save_pretrained writes for vLLM, that importing the plugin
package leaves vLLM unimported, and the per-batch-size schedule `dblast serve` passes. The plugin
inside vLLM is tested in test_vllm.py."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dblast_ext import load_drafter, reference, save_pretrained
from dblast_ext.vllm.branch_choice import anchor_uniforms, choose_branches, chosen_branch_states
from dblast_ext.vllm.cpu_expand_fix import expand_any_dtype, fallback_loses_floats
from tiny_models import write_dflash_checkpoint


def test_anchor_uniforms_are_uniform_reproducible_and_keyed_by_position_and_anchor():
    positions = torch.arange(20_000)
    anchors = torch.full_like(positions, 17)
    u = anchor_uniforms(3, positions, anchors)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, anchor_uniforms(3, positions, anchors))
    # a uniform's deciles hold a tenth of the draws each (binomial sd ~0.002 at 20,000)
    deciles = torch.histc(u.float(), bins=10, min=0, max=1) / len(u)
    assert bool(((deciles - 0.1).abs() < 0.01).all()), deciles
    # neighbouring positions are not correlated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.03
    # another seed, another anchor token: other draws
    assert (anchor_uniforms(4, positions, anchors) != u).float().mean() > 0.99
    assert (anchor_uniforms(3, positions, anchors + 1) != u).float().mean() > 0.99


def test_choose_branches_takes_the_argmax_at_temperature_zero():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    assert choose_branches(logits, 0.0, None).tolist() == [1, 0]  # the lowest index on ties


def test_choose_branches_draws_from_the_tempered_prior():
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0]])
    temperature, draws = 1.5, 40_000
    grid = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws  # inverse CDF on an even grid of uniforms
    chosen = choose_branches(logits.expand(draws, -1), temperature, grid)
    frequencies = torch.bincount(chosen, minlength=4).double() / draws
    expected = torch.softmax(logits[0].double() / temperature, dim=0)
    assert torch.allclose(frequencies, expected, atol=2 / draws)


def test_chosen_branch_states_equal_the_reference_branch_states():
    g = torch.Generator().manual_seed(0)
    rows, width, k = 6, 16, 4
    hidden = torch.randn(rows, width, generator=g)
    weight, bias = torch.randn(k * width, width, generator=g) / 4, torch.randn(k * width, generator=g)
    branch = torch.tensor([0, 3, 1, 2, 3, 0])
    expected = reference.branch_states(hidden, weight, bias)[torch.arange(rows), branch]
    torch.testing.assert_close(chosen_branch_states(hidden, branch, weight, bias), expected)


def _int64_only(output, input_val, cu_num_tokens, replace_from, replace_to, max_num_tokens=None):
    """vLLM-CPU's faulty fallback: writes into an int64 copy of the output."""
    out = output if output.dtype == torch.int64 else output.to(torch.int64)
    start = 0
    for value, end in zip(input_val.tolist(), cu_num_tokens.tolist()):
        out[start:end] = int(replace_to if value == replace_from else value)
        start = end


def test_expand_fix_detects_the_fault_and_writes_every_dtype():
    assert fallback_loses_floats(_int64_only)
    fixed = expand_any_dtype(_int64_only)
    assert not fallback_loses_floats(fixed)
    temperatures = torch.empty(6)
    fixed(temperatures, torch.tensor([0.7, -1.0, 1.3]), torch.tensor([2, 5, 6], dtype=torch.int32), -1.0, 1, 16)
    # the greedy marker -1 replaced by 1
    assert torch.equal(temperatures, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.3]))
    ids = torch.zeros(4, dtype=torch.int64)
    fixed(ids, torch.tensor([5, 9]), torch.tensor([1, 4]), 0, 0, 16)  # int64 goes to the kernel
    assert ids.tolist() == [5, 9, 9, 9]


def test_save_pretrained_names_the_architecture_vllm_loads(tmp_path):
    drafter = load_drafter(write_dflash_checkpoint(str(tmp_path / "dflash")))
    save_pretrained(drafter, str(tmp_path / "k1"))
    drafter.add_branch_head(4)
    save_pretrained(drafter, str(tmp_path / "k4"))
    for name, architecture in (("k1", "DFlashDraftModel"), ("k4", "DFlashDBLastDraftModel")):
        with open(os.path.join(tmp_path, name, "config.json")) as f:
            config = json.load(f)
        assert config["architectures"] == [architecture] and config["model_type"] == "qwen3"


def test_the_embedded_drafters_name_their_vllm_architecture():
    from dblast_ext.drafting.embedded_drafters import embedded_drafter_dir

    for name, architecture in (("dflash-k1", "DFlashDraftModel"), ("dblast-k4", "DFlashDBLastDraftModel")):
        with open(os.path.join(embedded_drafter_dir(name), "config.json")) as f:
            assert json.load(f)["architectures"] == [architecture]


def test_importing_the_plugin_package_does_not_import_vllm():
    code = "import sys, dblast_ext.vllm; assert 'vllm' not in sys.modules, 'vllm imported'; print('ok')"
    # from a neutral folder: a source checkout in the working directory would shadow the built package
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_batch_schedule_drafts_where_it_pays_and_covers_every_batch_size():
    from dblast_ext.decoding.adaptive import CostTable
    from dblast_ext.vllm.serving_schedule import batch_schedule

    # a cycle verifying d drafts costs 1 + 0.05 d steps at batch 1, 1 + 0.5 d at batch 16
    table = CostTable(chain={1: [1.0 + 0.05 * d for d in range(8)], 16: [1.0 + 0.5 * d for d in range(8)]})
    schedule = batch_schedule(table, [0.7] * 7, 7)
    assert schedule[0][:2] == [1, 1] and schedule[0][2] >= 5 and schedule[-1][1] == 2 ** 31 - 1
    assert schedule[-1][2] == 0  # big batches: plain decoding
    assert all(a[1] + 1 == b[0] for a, b in zip(schedule, schedule[1:]))  # contiguous, no overlap
    assert [r[2] for r in schedule] == sorted((r[2] for r in schedule), reverse=True)
    capped = batch_schedule(table, [0.7] * 7, 3)
    assert max(r[2] for r in capped) <= 3
    with pytest.raises(ValueError, match="acceptance"):
        batch_schedule(table, [0.7, 1.5], 2)


def test_dblast_serve_passes_the_schedule_in_the_speculative_config():
    import json

    from dblast_ext.cli import build_parser
    from dblast_ext.cli.serve import serve_command

    args = build_parser().parse_args(["serve", "--drafter", "dblast-k4", "--num-speculative-tokens", "3"])
    argv, _ = serve_command(args, [[1, 2, 3], [3, 2 ** 31 - 1, 0]])
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["num_speculative_tokens"] == 3
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 2 ** 31 - 1, 0]]
    argv, _ = serve_command(args)
    assert "num_speculative_tokens_per_batch_size" not in json.loads(argv[argv.index("--speculative-config") + 1])


def test_the_pairs_acceptance_is_measured_over_every_position(tmp_path):
    from decoding_cases import make_decoder
    from dblast_ext.vllm.serving_schedule import measure_acceptance

    dec = make_decoder(tmp_path, branches=2, block_size=4, controller="adaptive")
    rates = measure_acceptance(dec, [[3, 17, 42, 8, 25], [9, 4]], max_new_tokens=12)
    assert len(rates) == 3 and all(0 <= r <= 1 for r in rates)
    assert dec.controller == "adaptive"
