"""Flags and loading shared by the subcommands that run a target with a drafter."""
from ..decoding import SamplingParams, SpeculativeDecoder
from ..drafter_io import checkpoint_files, load_drafter
from ..target_loading import check_target_path, default_device, load_target, resolve_dtype


def add_target_args(p) -> None:
    """--target and how it runs (--device, --dtype), and --seed."""
    p.add_argument("--target", default="default",
                   help="local directory of a transformers causal LM (+ tokenizer); 'default' (the default) is the "
                        "embedded SmolLM2-135M-Instruct")
    add_runtime_args(p)


def add_runtime_args(p) -> None:
    """How the models run (--device, --dtype) and --seed."""
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--seed", type=int, default=0)


def add_model_args(p) -> None:
    add_target_args(p)
    p.add_argument("--drafter", required=True,
                   help="local directory of a DFlash or DBLast drafter checkpoint, or an embedded drafter for the "
                        "default target: dblast-k4 or dflash-k1")
    p.add_argument("--branches", type=int, default=None,
                   help="K: add a K-branch head to a DFlash (K = 1) checkpoint (untrained: for trying the "
                        "machinery; a DBLast checkpoint brings its own)")
    p.add_argument("--block-size", type=int, default=None,
                   help="run the drafter at another block size than it was trained for (naive expansion)")
    p.add_argument("--no-kernels", action="store_true", help="run the reference ops instead of the compiled kernels")


def add_sampling_args(p, temperature: float = 1.0) -> None:
    p.add_argument("--temperature", type=float, default=temperature, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="top-k; 0 = off")
    p.add_argument("--max-new-tokens", type=int, default=256)


def check_sampling_args(args) -> None:
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")


def check_target_args(args) -> None:
    resolve_dtype(args.dtype, args.device or default_device())
    check_target_path(args.target)


def check_args(args) -> None:
    """Cheap checks before any model loads, each naming its flag."""
    check_sampling_args(args)
    if args.branches is not None and args.branches < 1:
        raise ValueError(f"--branches must be >= 1, got {args.branches}")
    if args.block_size is not None and args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2, got {args.block_size}")
    z = getattr(args, "category_temperature", None)
    if isinstance(z, float) and z < 0:  # `dblast eval` also takes "calibrate" and checks it itself
        raise ValueError(f"--category-temperature must be >= 0, got {z}")
    check_target_args(args)
    checkpoint_files(args.drafter)


def sampling_of(args) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p)


def load_decoder(args, category_temperature: float = 1.0):
    """(decoder, tokenizer) from the model flags."""
    device = args.device or default_device()
    target, tokenizer = load_target(args.target, device=device, dtype=args.dtype)
    drafter = load_drafter(args.drafter, target=target, num_branches=args.branches)
    drafter = drafter.to(device=device, dtype=resolve_dtype(args.dtype, device)).eval()
    if args.block_size is not None:
        drafter.config.block_size = args.block_size  # the drafter pass itself takes any block length
    decoder = SpeculativeDecoder(target, drafter, category_temperature=category_temperature,
                                 use_kernels=not args.no_kernels)
    return decoder, tokenizer
