"""The fastest exact settings that `dblast demo` and `dblast generate` pick for flags left at their
defaults (dblast_ext.decoding.fastest_settings): which dtype, block, draft vocabulary and verification rule
per device and drafter, that a flag given by the user always wins, and the line that says what was
picked."""
import argparse

import pytest

from dblast_ext.decoding import fastest_settings
from dblast_ext.cli import common
from dblast_ext.decoding.fastest_settings import CPU_FASTEST, fastest_exact_settings


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Sets whether the CPU computes bfloat16 natively: fastest_exact_settings asks at each call."""
    def set_native(native: bool):
        monkeypatch.setattr(fastest_settings, "cpu_has_native_bf16", lambda: native)
    return set_native


def _args(**overrides):
    values = dict(dtype="auto", block_size=None, draft_vocab=None, device="cpu", drafter="dblast-k4",
                  target="default", verify=None, max_tree_nodes=None, extra_leaves=None)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("native,dtype", [(False, "float32"), (True, "bfloat16")])
@pytest.mark.parametrize("drafter", sorted(CPU_FASTEST))
def test_cpu_picks_the_measured_block_and_vocabulary_and_bf16_only_where_native(cpu_bf16, native, dtype, drafter):
    cpu_bf16(native)
    settings = fastest_exact_settings("cpu", drafter)
    assert settings.dtype == dtype
    fastest = CPU_FASTEST[drafter]
    assert (settings.block_size, settings.draft_vocab) == (fastest.block_size, fastest.draft_vocab) == (8, 8192)
    assert (settings.verify, settings.max_tree_nodes) == (fastest.verify, fastest.max_tree_nodes)
    assert ("native" in settings.why) and (("no native" in settings.why) != native)


def test_unmeasured_drafters_and_gpus_keep_the_trained_block_and_whole_vocabulary(cpu_bf16):
    cpu_bf16(False)
    other = fastest_exact_settings("cpu", None)
    assert (other.dtype, other.block_size, other.draft_vocab, other.verify) == ("float32", None, None, "branch")
    gpu = fastest_exact_settings("cuda", "dblast-k4")
    assert (gpu.dtype, gpu.block_size, gpu.draft_vocab, gpu.verify) == ("bfloat16", None, None, "branch")


def test_cpu_has_native_bf16_follows_torchs_probes(monkeypatch):
    import torch

    for avx512_bf16, amx, expected in [(False, False, False), (True, False, True), (False, True, True)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert fastest_settings.cpu_has_native_bf16() is expected


def test_defaults_are_filled_and_the_line_says_what_was_picked(cpu_bf16):
    cpu_bf16(False)
    args = _args()
    line = common.pick_fastest_settings(args)
    assert (args.dtype, args.block_size, args.draft_vocab) == ("float32", 8, 8192)
    assert (args.verify, args.max_tree_nodes) == ("tree", 10)
    assert line.startswith("fastest exact settings here: float32 (this CPU has no native bfloat16), block 8, "
                           "the first 8192 ids as the draft vocabulary, trie verification, 10 branch nodes per trie "
                           "(measured fastest for dblast-k4 on a CPU)")
    assert "--dtype, --block-size, --draft-vocab N|all, --verify, --max-tree-nodes override" in line


def test_flags_given_by_the_user_win(cpu_bf16):
    cpu_bf16(True)
    args = _args(dtype="float16", block_size=16, draft_vocab="all", verify="tree", max_tree_nodes=6)
    assert common.pick_fastest_settings(args) == ""  # nothing left to pick
    assert (args.dtype, args.block_size, common.draft_vocab_of(args)) == ("float16", 16, None)
    assert (args.verify, args.max_tree_nodes) == ("tree", 6)
    args = _args(block_size=4)
    line = common.pick_fastest_settings(args)
    assert (args.dtype, args.block_size, args.draft_vocab) == ("bfloat16", 4, 8192)
    assert "block " not in line.split("(measured")[0] and "bfloat16 (native on this CPU)" in line


def test_the_verification_rule_is_picked_only_when_not_given(cpu_bf16):
    """--verify left out: the measured rule (on a CPU a trie for the embedded drafters, of 10
    branch nodes for dblast-k4 and of every node for dflash-k1; one branch on a GPU). Given: it
    wins, and a trie the user asked for still gets the measured node budget unless
    --max-tree-nodes says otherwise."""
    cpu_bf16(True)
    args = _args(drafter="dflash-k1")
    assert "trie verification" in common.pick_fastest_settings(args)
    assert (args.verify, args.max_tree_nodes) == ("tree", None)
    args = _args(device="cuda")
    common.apply_fastest_settings(args, "cuda", "dblast-k4")
    assert (args.verify, args.max_tree_nodes) == ("branch", None)
    args = _args(verify="branch")
    assert "trie" not in common.pick_fastest_settings(args) and args.max_tree_nodes is None
    args = _args(verify="tree")
    line = common.pick_fastest_settings(args)
    assert args.max_tree_nodes == 10 and "trie verification" not in line and "10 branch nodes per trie" in line
    args = _args(max_tree_nodes=20, extra_leaves=2)
    common.pick_fastest_settings(args)
    assert (args.verify, args.max_tree_nodes, args.extra_leaves) == ("tree", 20, 2)


def test_trie_flags_with_a_picked_branch_rule_get_a_clear_error():
    common.check_tree_args(_args(extra_leaves=2), None)  # not chosen yet: no error
    with pytest.raises(ValueError, match="--extra-leaves must be >= 0 and needs --verify tree"):
        common.apply_fastest_settings(_args(extra_leaves=2), "cuda", "dblast-k4")
    with pytest.raises(ValueError, match="--max-tree-nodes must be >= 1 and needs --verify tree"):
        common.apply_fastest_settings(_args(max_tree_nodes=4), "cuda", "dblast-k4")


def test_only_the_embedded_pair_gets_the_measured_block(cpu_bf16, tmp_path, monkeypatch):
    cpu_bf16(False)
    args = _args(target=str(tmp_path))  # another target: the embedded drafter's figures do not apply
    common.pick_fastest_settings(args)
    assert (args.dtype, args.block_size, args.draft_vocab, args.verify) == ("float32", None, None, "branch")
    (tmp_path / "dblast-k4").mkdir()  # a local directory of the embedded name is another drafter
    monkeypatch.chdir(tmp_path)
    args = _args()
    common.pick_fastest_settings(args)
    assert (args.block_size, args.draft_vocab, args.verify) == (None, None, "branch")


@pytest.mark.parametrize("text,value", [("all", "all"), ("64", 64)])
def test_draft_vocab_flag_takes_a_count_or_all(text, value):
    assert common.draft_vocab_value(text) == value
    assert common.draft_vocab_of(argparse.Namespace(draft_vocab=value)) == (None if value == "all" else value)


def test_draft_vocab_flag_refuses_other_words():
    with pytest.raises(argparse.ArgumentTypeError, match="a number of token ids or 'all', got 'most'"):
        common.draft_vocab_value("most")


def test_eval_runs_at_the_fastest_settings_only_when_asked(cpu_bf16):
    """`dblast eval` keeps its own defaults (float32 on a CPU, the branch rule, the trained
    block, every id) unless --fastest-settings asks for `dblast demo`'s; flags given still win,
    and trie flags without a trie get the same clear error as elsewhere."""
    from dblast_ext.cli import build_parser
    from dblast_ext.cli.evaluate import choose_settings

    cpu_bf16(True)
    base = ["eval", "--drafter", "dblast-k4", "--device", "cpu", "--out", "unused"]
    args = build_parser().parse_args(base)
    assert choose_settings(args) == ""
    assert (args.dtype, args.block_size, args.draft_vocab, args.verify, args.max_tree_nodes) == \
        ("auto", None, None, "branch", None)
    args = build_parser().parse_args(base + ["--fastest-settings"])
    line = choose_settings(args)
    fastest = CPU_FASTEST["dblast-k4"]
    assert (args.dtype, args.block_size, args.draft_vocab, args.verify, args.max_tree_nodes) == \
        ("bfloat16", fastest.block_size, fastest.draft_vocab, fastest.verify, fastest.max_tree_nodes)
    assert line.startswith("fastest exact settings here:") and "trie verification" in line
    args = build_parser().parse_args(base + ["--fastest-settings", "--verify", "branch", "--dtype", "float32"])
    choose_settings(args)
    assert (args.dtype, args.verify, args.max_tree_nodes, args.draft_vocab) == \
        ("float32", "branch", None, fastest.draft_vocab)
    with pytest.raises(ValueError, match="--max-tree-nodes must be >= 1 and needs --verify tree"):
        choose_settings(build_parser().parse_args(base + ["--max-tree-nodes", "4"]))
