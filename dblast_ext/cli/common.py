"""Flags, checks and loading shared by the subcommands."""
import argparse
import os
from typing import Optional

import torch

from ..decoding.adaptive import CONTROLLERS
from ..decoding.decoder import TREE_EXTRA_LEAVES, VERIFY_MODES, SamplingParams, SpeculativeDecoder
from ..drafting.drafter import DrafterConfig
from ..checkpoint_files import check_weights_file
from ..drafting.drafter_io import checkpoint_files, load_drafter, read_config_file
from ..decoding.fastest_settings import fastest_exact_settings
from ..sampling import check_temperature, check_top_k, check_top_p
from ..target.loading import check_target_path, default_device, load_target, resolve_dtype


def add_target_args(p) -> None:
    """--target and how it runs (--device, --dtype), and --seed."""
    p.add_argument("--target", default="default",
                   help="local directory of a transformers causal LM (+ tokenizer); 'default' (the default) is the "
                        "embedded SmolLM2-135M-Instruct")
    add_runtime_args(p)


def add_runtime_args(p) -> None:
    """How the models run (--device, --dtype) and --seed."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16 (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")


def add_model_args(p, *, block_size: bool = True, fastest: bool = False) -> None:
    """The target and drafter flags; `block_size=False` leaves --block-size to a subcommand
    that gives it another meaning; `fastest`: the subcommand applies the fastest exact settings
    (pick_fastest_settings), which then choose --verify when it is not given."""
    add_target_args(p)
    p.add_argument("--drafter", required=True,
                   help="local directory of a DFlash or DBLast drafter checkpoint, or an embedded drafter for the "
                        "default target: dblast-k4 or dflash-k1")
    p.add_argument("--branches", type=int, default=None,
                   help="K: add a K-branch head to a DFlash (K = 1) checkpoint (untrained: for trying the "
                        "machinery; a DBLast checkpoint brings its own)")
    if block_size:
        p.add_argument("--block-size", type=int, default=None,
                       help="run the drafter at another block size than it was trained for (naive expansion)")
    add_draft_vocab_arg(p)
    add_verify_args(p, fastest=fastest)
    add_controller_args(p)
    p.add_argument("--no-kernels", action="store_true", help="run the reference ops instead of the compiled kernels")


def add_controller_args(p) -> None:
    """--controller and --cost-table (dblast_ext.decoding.adaptive). A subcommand whose default is the
    adaptive controller says so with p.set_defaults(adaptive_by_default=True); the others (which
    measure acceptance, where every cycle should verify the whole block) default to off."""
    p.add_argument("--controller", choices=CONTROLLERS, default=None,
                   help="adaptive: each cycle verifies the number of drafts (0 = a plain target step) that "
                        "maximises the expected tokens per second, from the measured acceptance and the measured "
                        "cost of a cycle at each depth (docs/design.md); off: every cycle verifies the whole "
                        "block. Neither changes the output distribution (default: adaptive for generate, demo "
                        "and timed eval runs, off where acceptance is measured)")
    p.add_argument("--cost-table", default=None, metavar="PATH",
                   help="the adaptive controller's cost table (`dblast calibrate --cost` writes one; default: "
                        "measured at first use for this machine, models, dtype and settings, and cached)")


def controller_of(args) -> str:
    """--controller, or the subcommand's default: adaptive where speed is the point (generate,
    demo, eval --measure-speedup), off where acceptance is measured."""
    if getattr(args, "controller", None):
        return args.controller
    adaptive = getattr(args, "adaptive_by_default", False) or getattr(args, "measure_speedup", False)
    return "adaptive" if adaptive else "off"


def add_verify_args(p, fastest: bool = False) -> None:
    """--verify, --max-tree-nodes, --extra-leaves; with `fastest` --verify defaults to None, for
    apply_fastest_settings to choose."""
    default = ("the fastest measured here: tree for the embedded drafters on a CPU, else branch" if fastest
               else "branch")
    p.add_argument("--verify", choices=VERIFY_MODES, default=None if fastest else "branch",
                   help="branch: verify one branch drawn from the prior (DBLast Eq 18-21); tree: merge all K "
                        "branches into a trie and verify it in one target pass (a bigger pass, more tokens per "
                        f"pass; docs/design.md). Both keep the target's distribution (default: {default})")
    p.add_argument("--max-tree-nodes", type=int, default=None, metavar="N",
                   help="with --verify tree: score at most N of the branches' nodes per cycle, those the "
                        "drafter expects a walk to reach most often (default: all)")
    p.add_argument("--extra-leaves", type=int, default=None, metavar="N",
                   help="with --verify tree: add N leaves to each trie, the drafter's likeliest tokens that no "
                        f"branch drafted (default {TREE_EXTRA_LEAVES}; 0: the branches' trie alone)")


def add_category_temperature_arg(p) -> None:
    p.add_argument("--category-temperature", type=float, default=1.0,
                   help="Z_T, the prior's temperature; 0 = always the most likely branch (default %(default)s)")


def draft_vocab_value(text: str):
    """--draft-vocab: a count of ids, or "all" (the whole vocabulary)."""
    if text == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of token ids or 'all', got {text!r}") from None


def add_draft_vocab_arg(p) -> None:
    p.add_argument("--draft-vocab", type=draft_vocab_value, default=None, metavar="N|all",
                   help="draft only the first N token ids (and the end-of-sequence ids): the drafter's LM head "
                        "then costs about N/V of a full one, the largest share of drafting on a CPU. A byte-level "
                        "BPE tokenizer numbers its tokens most frequent first. The output distribution is "
                        "unchanged (verification is exact); only which tokens can be drafted. 'all': the whole "
                        "vocabulary (default: all, or the fastest measured choice where demo and generate pick one)")


def draft_vocab_of(args) -> Optional[int]:
    value = getattr(args, "draft_vocab", None)
    return None if value in (None, "all") else value


def apply_fastest_settings(args, device_type: str, drafter: Optional[str]) -> str:
    """For `dblast demo` and `dblast generate`: --dtype, --block-size, --draft-vocab, --verify and
    (with trie verification) --max-tree-nodes left at their defaults take the fastest settings
    that keep the output distribution (dblast_ext.decoding.fastest_settings) for `device_type` and the
    embedded `drafter` (None: another drafter). Returns the line saying what was picked ("" when the flags chose everything)."""
    settings = fastest_exact_settings(device_type, drafter)
    picked, measured = [], False
    if args.dtype == "auto":
        args.dtype = settings.dtype
        picked.append(settings.why)
    if settings.block_size is not None and args.block_size is None:
        args.block_size = settings.block_size
        picked.append(f"block {settings.block_size}")
        measured = True
    if settings.draft_vocab is not None and getattr(args, "draft_vocab", None) is None:
        args.draft_vocab = settings.draft_vocab
        picked.append(f"the first {settings.draft_vocab} ids as the draft vocabulary")
        measured = True
    if getattr(args, "verify", "branch") is None:
        args.verify = settings.verify
        if settings.verify != "branch":
            picked.append("trie verification")
            measured = True
        check_tree_args(args, args.verify)
    if (getattr(args, "verify", "branch") == "tree" and settings.max_tree_nodes is not None
            and getattr(args, "max_tree_nodes", None) is None):
        args.max_tree_nodes = settings.max_tree_nodes
        picked.append(f"{settings.max_tree_nodes} branch nodes per trie")
        measured = True
    if not picked:
        return ""
    source = f" ({settings.source})" if measured else ""
    return (f"fastest exact settings here: {', '.join(picked)}{source}; the output distribution is the same "
            "(--dtype, --block-size, --draft-vocab N|all, --verify, --max-tree-nodes override)")


def pick_fastest_settings(args) -> str:
    """apply_fastest_settings for the run the flags describe: its device, and the drafter when it
    is an embedded one on the embedded target."""
    from ..target.default import DEFAULT_TARGET
    from ..drafting.embedded_drafters import EMBEDDED_DRAFTERS

    device_type = torch.device(args.device or default_device()).type
    embedded = (args.drafter in EMBEDDED_DRAFTERS and not os.path.isdir(args.drafter)
                and getattr(args, "target", DEFAULT_TARGET) == DEFAULT_TARGET)
    return apply_fastest_settings(args, device_type, args.drafter if embedded else None)


def add_sampling_args(p, temperature: float = 1.0) -> None:
    p.add_argument("--temperature", type=float, default=temperature,
                   help="sampling temperature; 0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="top-k; 0 = off (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="most tokens generated per response (default %(default)s)")


def check_sampling_args(args) -> None:
    check_temperature(args.temperature, "--temperature")  # the rules SamplingParams applies, named as flags
    check_top_k(args.top_k, "--top-k")
    check_top_p(args.top_p, "--top-p")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")


def check_device(device: Optional[str], flag: str = "--device") -> None:
    """A device torch parses, and for CUDA one this machine has: otherwise the error would come
    only after the model has loaded (or as a traceback from torch)."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{flag} must be cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type not in ("cpu", "cuda"):  # the kernels and the tested paths are CPU and CUDA only
        raise ValueError(f"{flag} must be cpu, cuda or cuda:N, got {device!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {device}: CUDA is not available on this machine (use --device cpu)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_runtime_args(args) -> None:
    """--device and --dtype."""
    check_device(args.device)
    try:
        resolve_dtype(args.dtype, "cpu")
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None


def check_target_args(args) -> None:
    check_runtime_args(args)
    check_target_path(args.target)


def read_checkpoint_config(path: str, flag: str) -> DrafterConfig:
    """A drafter checkpoint's config from its config.json alone; errors name `flag`."""
    try:
        config_path, weights_path = checkpoint_files(path)
        config = read_config_file(config_path)
        check_weights_file(weights_path)  # its header: a damaged file is named before the target loads
        return config
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{flag}: {e}") from None
    except ValueError as e:  # not JSON, or not a DFlash/DBLast config (the message names the file)
        raise ValueError(f"{flag}: {e}") from None


def read_drafter_config(args) -> DrafterConfig:
    """The drafter's config as the run will use it (--branches applied), from its config.json
    alone: the checks that depend on the drafter run before any weights load."""
    config = read_checkpoint_config(args.drafter, "--drafter")
    if args.branches is not None and args.branches != config.num_branches:
        if config.num_branches != 1:
            raise ValueError(f"--branches {args.branches}: the checkpoint already has {config.num_branches} branches "
                             "(a head can only be added to a K = 1 checkpoint)")
        config.num_branches = args.branches
    return config


def check_args(args) -> DrafterConfig:
    """Cheap checks before any model loads, each naming its flag; returns the drafter's config
    (read_drafter_config) for the subcommands' own checks."""
    check_sampling_args(args)
    if args.branches is not None and args.branches < 1:
        raise ValueError(f"--branches must be >= 1, got {args.branches}")
    if args.block_size is not None and args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2, got {args.block_size}")
    if draft_vocab_of(args) is not None and args.draft_vocab < 1:
        raise ValueError(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
    check_tree_args(args, getattr(args, "verify", "branch"))
    check_cost_table_arg(args)
    z = getattr(args, "category_temperature", None)
    if isinstance(z, float) and z < 0:  # `dblast eval` also takes "calibrate" and checks it itself
        raise ValueError(f"--category-temperature must be >= 0, got {z}")
    check_target_args(args)
    return read_drafter_config(args)


def check_cost_table_arg(args) -> None:
    """--cost-table: a readable cost table, and only for the adaptive controller."""
    path = getattr(args, "cost_table", None)
    if path is None:
        return
    if controller_of(args) != "adaptive":
        raise ValueError(f"--cost-table {path}: the cost table is the adaptive controller's; this run has "
                         f"--controller {controller_of(args)}")
    from ..decoding.adaptive import CostTable

    if not os.path.isfile(path):
        raise ValueError(f"--cost-table {path}: no such file (`dblast calibrate --cost` writes one)")
    CostTable.load(path)  # its errors name the file


def check_tree_args(args, verify: Optional[str]) -> None:
    """--max-tree-nodes and --extra-leaves need trie verification (`verify` None: not chosen
    yet, apply_fastest_settings checks again once it is)."""
    nodes = getattr(args, "max_tree_nodes", None)
    if nodes is not None and (nodes < 1 or verify not in ("tree", None)):
        raise ValueError(f"--max-tree-nodes must be >= 1 and needs --verify tree, got {nodes}")
    leaves = getattr(args, "extra_leaves", None)
    if leaves is not None and (leaves < 0 or (leaves > 0 and verify not in ("tree", None))):
        raise ValueError(f"--extra-leaves must be >= 0 and needs --verify tree, got {leaves}")


def sampling_of(args) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p)


def load_decoder(args, category_temperature: float = 1.0):
    """(decoder, tokenizer) from the model flags."""
    device = args.device or default_device()
    target, tokenizer = load_target(args.target, device=device, dtype=args.dtype,
                                    progress=not getattr(args, "no_progress", False))
    return drafting_decoder(args, target, args.drafter, args.branches, category_temperature), tokenizer


def load_second_decoder(args, decoder: SpeculativeDecoder, path: str, category_temperature: float = 1.0):
    """A decoder for another drafter (`path`, as its checkpoint is: --branches is the first
    drafter's) on `decoder`'s target, with the same device, dtype, block size, kernels and draft
    vocabulary flags: for measuring two drafters on the same prefixes."""
    return drafting_decoder(args, decoder.target.model, path, None, category_temperature)


def drafting_decoder(args, target, path: str, num_branches: Optional[int], category_temperature: float):
    """The drafter at `path` on the loaded `target`, on its device, in the --dtype, with the
    --block-size, --no-kernels and --draft-vocab flags."""
    device = next(target.parameters()).device
    drafter = load_drafter(path, target=target, num_branches=num_branches)
    drafter = drafter.to(device=device, dtype=resolve_dtype(args.dtype, device.type)).eval()
    if args.block_size is not None:
        drafter.config.block_size = args.block_size  # the drafter pass itself takes any block length
    return SpeculativeDecoder(target, drafter, category_temperature=category_temperature,
                              use_kernels=not args.no_kernels, draft_vocab=draft_vocab_of(args),
                              verify=getattr(args, "verify", None) or "branch",
                              max_tree_nodes=getattr(args, "max_tree_nodes", None),
                              extra_leaves=getattr(args, "extra_leaves", None), controller=controller_of(args),
                              cost_table=getattr(args, "cost_table", None))
