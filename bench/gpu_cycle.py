"""The decode cycle's GPU figures (issue 25) at the Qwen3-8B shape, random bf16 weights:
  - one target forward over [anchor, block] after a 512-token prompt (the loop's own cache),
    the floor a cycle is compared with;
  - the cycle time at batch 1 for K = 1 and K = 4 (interleaved repeats, medians), so the
    overhead of K branches and the cycle / target-forward ratio; K = 4 also with the
    fixed-shape target cache (target_cache="static", dblast_ext.target.slot_cache);
  - the K-dependent steps alone (propose, branch choice, verify) on fixed inputs, K = 1 and
    K = 4: their difference over the K = 1 cycle is the overhead of K branches without the
    target forward's run-to-run spread (which hid a 1.5% difference in whole cycles);
  - the host synchronisations per cycle (both caches) and per target-alone token
    (torch.cuda.set_sync_debug_mode), with the source lines that cause them;
  - tokens per second at batch 1, 8, 32: speculative (generate_batch) against the target alone
    batched the same way with the same target cache (generate_autoregressive_batch), for
    either cache;
  - with CUDA, the cycle replayed from CUDA graphs (cuda_graphs=True, dblast_ext.decoding.cuda_graphs):
    batch-1 cycle times of K = 1 and K = 4 with graphs beside the eager ones (the first round,
    untimed, captures), whether their tokens equal the eager static cache's, the mean time of
    each captured part inside the cycle (drafter pass, target forward, verifier; CUDA events
    between the graphs), host syncs per cycle, and tokens per second at each batch size with
    graphs against the target alone through the same loop, cache and graphs (a decoder whose
    every cycle is a plain target step, FixedDepth(0)); each graph run follows an untimed run
    of the same shapes, which captures. Without CUDA these rows are n/a.
Random weights accept almost nothing, so the batch figures compare cycle costs (about one
token per cycle), not speed-ups of a trained pair.

    python bench/gpu_cycle.py --out DIR            (a GPU with about 25 GB free)
    python bench/gpu_cycle.py --out DIR --tiny     (a tiny random pair, any device: a dry run)
Writes gpu_cycle.json and gpu_cycle.md under --out, each naming the machine's GPU and the commit
(DBLAST_COMMIT when set, as bench/device_check.sh sets it on a machine without .git; else git's).
"""
import argparse
import collections
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python_tests"))

from dblast_ext.decoding.adaptive import FixedDepth  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from dblast_ext.decoding.generation import draw_uniforms  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="a tiny random pair instead of the Qwen3-8B shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=48, help="per batch-1 run")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--batch-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="interleaved batch-1 runs per K")
    p.add_argument("--part-repeats", type=int, default=30, help="interleaved timings of each K-dependent step")
    return p.parse_args()


def source_commit() -> str:
    if os.environ.get("DBLAST_COMMIT"):
        return os.environ["DBLAST_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_pair(args):
    if args.tiny:
        from dblast_ext import load_drafter
        from tiny_models import tiny_target, write_dflash_checkpoint
        target = tiny_target("qwen3").to(args.device)
        drafter = load_drafter(write_dflash_checkpoint(os.path.join(tempfile.mkdtemp(), "d"), block_size=16),
                               target=target).to(args.device)
        return target, drafter
    import qwen3_8b_shape
    return qwen3_8b_shape.qwen3_8b_pair(args.device)


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall(fn, device):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def random_prompts(count, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


@torch.inference_mode()
def target_block_forward_ms(adapter, prompt, block, device, repeats=20):
    """One forward of the target alone over block + 1 tokens after the prompt, through the
    loop's own cache (TargetAdapter), logits only, cropped back each time."""
    cache = adapter.new_cache()
    adapter.forward(torch.tensor([prompt], device=device), cache, hidden_states=False, last_logits_only=True)
    step = torch.randint(0, adapter.vocab_size, (1, block + 1), device=device)
    times = []
    for i in range(repeats + 3):
        _, seconds = wall(lambda: adapter.forward(step, cache, hidden_states=False), device)
        adapter.crop(cache, len(prompt))
        if i >= 3:
            times.append(seconds)
    return 1e3 * statistics.median(times)


def cycle_times(decoders, prompt, sampling, new_tokens, repeats, device):
    """Per-cycle milliseconds of each decoder at batch 1, repeats interleaved (drift hits all),
    and the cycle's split as the loop records it (draft: propose + branch choice; verify: target
    forward, verification, the host read; host clocks, so on a GPU the read absorbs the wait)."""
    runs = {name: [] for name in decoders}
    tokens = {}
    for rep in range(repeats + 1):
        for name, dec in decoders.items():
            out, seconds = wall(lambda: dec.generate_batch([prompt], sampling, new_tokens, seeds=[0])[0], device)
            tokens[name] = out.token_ids
            if rep:  # the first round warms up (and captures, with graphs)
                runs[name].append((1e3 * seconds / len(out.cycles), out.cycles))
    result = {}
    for name, measured in runs.items():
        per_cycle = [ms for ms, _ in measured]
        draft = [1e3 * statistics.mean(c.draft_time for c in cycles) for _, cycles in measured]
        verify = [1e3 * statistics.mean(c.verify_time for c in cycles) for _, cycles in measured]
        result[name] = dict(cycle_ms=statistics.median(per_cycle), cycles=len(measured[-1][1]),
                            runs_ms=[round(m, 3) for m in per_cycle], draft_ms=statistics.median(draft),
                            verify_ms=statistics.median(verify), tokens=tokens[name])
    return result


@torch.inference_mode()
def cycle_parts_ms(decoders, prompt, sampling, device, repeats):
    """Per decoder, the medians (over `repeats`, interleaved across decoders) of the cycle's
    steps whose work depends on K, on the same fixed inputs every time: propose (the drafter
    pass over one block of new context, the K-branch expansion + LM-head argmax, the prior),
    branch choice with the draft's gather, and branch_verify. The drafter's cache is cropped
    back to the prompt before each propose, so every repeat does the same work."""
    adapter = next(iter(decoders.values())).target
    ids = torch.tensor([prompt], device=device)
    target_cache = adapter.new_cache()
    _, features = adapter.forward(ids, target_cache, last_logits_only=True)
    anchors = ids[:, -1]
    setups = {}
    for name, dec in decoders.items():
        block = dec.proposer.block_size
        cache = dec.proposer.new_cache(1, len(prompt) + 2 * block, device)
        dec.proposer.propose(anchors, features, cache)        # the prompt's context, once
        context, lens = features[:, -block:], torch.tensor([block], device=device)
        uniforms = draw_uniforms([torch.Generator(device=device).manual_seed(0)], block + 1, device)
        proposal, branch, draft = dec.chain_cycle.draft(anchors, context, lens, cache, uniforms)
        logits, _ = adapter.forward(torch.cat([anchors[:, None], draft], dim=1), target_cache, hidden_states=False)
        adapter.crop(target_cache, len(prompt))
        setups[name] = (dec, cache, context, lens, uniforms, proposal, branch, logits)

    def propose(dec, cache, context, lens, *_):
        cache.crop(len(prompt))
        return dec.proposer.propose(anchors, context, cache, lens)

    def choose(dec, cache, context, lens, uniforms, proposal, *_):
        return dec.chain_cycle.choose(proposal, uniforms)

    def verify(dec, cache, context, lens, uniforms, proposal, branch, logits):
        return dec.chain_cycle.verify(logits, proposal, branch, uniforms[:, 1:], sampling, validate=False)

    steps = {"propose": propose, "choose": choose, "verify": verify}
    times = {name: {step: [] for step in steps} for name in decoders}
    for rep in range(repeats + 2):
        for name, setup in setups.items():
            for step, fn in steps.items():
                _, seconds = wall(lambda: fn(*setup), device)
                if rep >= 2:  # two rounds of warm-up
                    times[name][step].append(1e3 * seconds)
    result = {}
    for name, per_step in times.items():
        result[name] = {f"{step}_ms": statistics.median(values) for step, values in per_step.items()}
        result[name]["total_ms"] = sum(result[name].values())
    return result


def count_syncs(fn):
    """Host synchronisations inside fn (CUDA's sync debug mode), by the source line that caused them."""
    where = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{short_path(w.filename)}:{w.lineno}"] += 1
    return out, where


def short_path(filename: str) -> str:
    """A source file as a reader finds it: in this repository, or in a package (no machine paths)."""
    root = os.path.dirname(HERE)
    if filename.startswith(root + os.sep):
        return os.path.relpath(filename, root)
    marker = "site-packages" + os.sep
    return filename.split(marker, 1)[1] if marker in filename else os.path.basename(filename)


def graph_parts_ms(dec, prompt, sampling, new_tokens, device):
    """The mean time of each captured part inside a replayed cycle (CUDA events between the
    graphs: draft = drafter pass + branch choice, score = target forward, verify = branch_verify),
    over one generation whose shapes are already captured; and why a part ran eagerly, if one did."""
    graphs = dec._cycle_graphs
    graphs.time_parts, graphs._events = True, []
    try:
        wall(lambda: dec.generate_batch([prompt], sampling, new_tokens, seeds=[0]), device)
        parts = graphs.part_times()
    finally:
        graphs.time_parts, graphs._events = False, []
    return dict(parts_ms=parts, eager_parts=dict(graphs.eager_parts), captured=graphs.stats["captured"],
                replayed=graphs.stats["replayed"])


def batch_speeds(dec, prompts, sampling, new_tokens, device, static, graphs=None):
    """Tokens per second of `dec` (compacting cache), `static` (the same pair, fixed-shape cache)
    and the target alone with each cache; each ratio against the target alone with its cache.
    `graphs`: (speculative, target alone) decoders replaying from CUDA graphs, each run once
    untimed first (capturing these shapes)."""
    rows = {}
    runs = [("speculative", dec.generate_batch), ("speculative, static cache", static.generate_batch),
            ("target alone", dec.generate_autoregressive_batch),
            ("target alone, static cache", static.generate_autoregressive_batch)]
    if graphs is not None:
        runs += [("speculative, graphs", graphs[0].generate_batch), ("target alone, graphs", graphs[1].generate_batch)]
    for name, run in runs:
        if name.endswith("graphs"):
            run(prompts, sampling, new_tokens, seeds=list(range(len(prompts))))
        outs, seconds = wall(lambda: run(prompts, sampling, new_tokens, seeds=list(range(len(prompts)))), device)
        tokens = sum(len(o.token_ids) for o in outs)
        rows[name] = dict(tokens=tokens, seconds=round(seconds, 4), tokens_per_s=tokens / seconds)
        if name.startswith("speculative"):
            rows[name]["cycles"] = max(len(o.cycles) for o in outs)
    rows["ratio"] = rows["speculative"]["tokens_per_s"] / rows["target alone"]["tokens_per_s"]
    rows["static_ratio"] = (rows["speculative, static cache"]["tokens_per_s"]
                            / rows["target alone, static cache"]["tokens_per_s"])
    if graphs is not None:
        rows["graphs_ratio"] = (rows["speculative, graphs"]["tokens_per_s"]
                                / rows["target alone, graphs"]["tokens_per_s"])
    return rows


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = args.device
    target, drafter = make_pair(args)
    vocab, block = target.config.vocab_size, drafter.config.block_size
    four = copy.deepcopy(drafter)
    four.add_branch_head(4, generator=torch.Generator().manual_seed(4))
    four.to(device=device)
    # every cycle verifies the whole block: these rows measure the cycle, not the adaptive controller
    decoders = {"K=1": SpeculativeDecoder(target, drafter, controller="off"),
                "K=4": SpeculativeDecoder(target, four, controller="off"),
                "K=4 static": SpeculativeDecoder(target, four, target_cache="static", controller="off")}
    graphed = None
    if device == "cuda":  # the cycle replayed from CUDA graphs, and the target alone through the same loop
        graphed = {name: SpeculativeDecoder(target, d, target_cache="static", controller="off", cuda_graphs=True)
                   for name, d in (("K=1 graphs", drafter), ("K=4 graphs", four))}
        alone = SpeculativeDecoder(target, four, target_cache="static", controller=FixedDepth(0), cuda_graphs=True)
    sampling = SamplingParams(1.0)
    prompt = random_prompts(1, args.prompt_len, min(vocab, 151000), seed=0)[0]
    result = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), torch=torch.__version__, commit=source_commit(),
                  device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  shape="tiny qwen3" if args.tiny else "Qwen3-8B", prompt_len=args.prompt_len, block=block,
                  dtype=str(decoders["K=1"].target.dtype).replace("torch.", ""))
    print(f"== {result['shape']} pair on {result['device']}", flush=True)

    result["target_forward_ms"] = target_block_forward_ms(decoders["K=1"].target, prompt, block, device)
    print(f"target forward over {block + 1} tokens: {result['target_forward_ms']:.2f} ms", flush=True)
    result["cycles"] = cycle_times({**decoders, **(graphed or {})}, prompt, sampling, args.new_tokens, args.repeats,
                                   device)
    for name, row in result["cycles"].items():
        print(f"cycle {name}: {row['cycle_ms']:.2f} ms over {row['cycles']} cycles {row['runs_ms']} (draft "
              f"{row['draft_ms']:.2f} ms, verify {row['verify_ms']:.2f} ms)", flush=True)
    k1, k4 = (result["cycles"][k]["cycle_ms"] for k in ("K=1", "K=4"))
    result["k4_overhead"] = k4 / k1 - 1
    result["cycle_over_target_forward"] = k1 / result["target_forward_ms"]
    if graphed is None:
        result["graphs"] = "n/a (no CUDA)"
    else:
        g1, g4 = (result["cycles"][k]["cycle_ms"] for k in ("K=1 graphs", "K=4 graphs"))
        result["graphs"] = dict(k4_overhead=g4 / g1 - 1, k1_over_target_forward=g1 / result["target_forward_ms"],
                                k4_speedup_over_eager_static=result["cycles"]["K=4 static"]["cycle_ms"] / g4,
                                k1_speedup_over_eager=k1 / g1,
                                tokens_equal_eager_static=(result["cycles"]["K=4 graphs"]["tokens"]
                                                           == result["cycles"]["K=4 static"]["tokens"]),
                                **graph_parts_ms(graphed["K=4 graphs"], prompt, sampling, args.new_tokens, device))
        print(f"graphs: {result['graphs']}", flush=True)
    parts = cycle_parts_ms({k: decoders[k] for k in ("K=1", "K=4")}, prompt, sampling, device, args.part_repeats)
    result["cycle_parts"] = parts
    result["k4_parts_overhead"] = (parts["K=4"]["total_ms"] - parts["K=1"]["total_ms"]) / k1
    for name, row in parts.items():
        print(f"K-dependent steps {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    print(f"K = 4 over K = 1 from those steps: {100 * result['k4_parts_overhead']:+.2f}% of the K = 1 cycle",
          flush=True)

    if device == "cuda":
        static, static_where = count_syncs(lambda: decoders["K=4 static"].generate_batch(
            [prompt], sampling, args.new_tokens, seeds=[0])[0])
        out, where = count_syncs(lambda: decoders["K=4"].generate_batch([prompt], sampling, args.new_tokens,
                                                                        seeds=[0])[0])
        alone, alone_where = count_syncs(lambda: decoders["K=4"].generate_autoregressive_batch(
            [prompt], sampling, args.new_tokens, seeds=[0])[0])
        replayed, graph_where = count_syncs(lambda: graphed["K=4 graphs"].generate_batch(
            [prompt], sampling, args.new_tokens, seeds=[0])[0])
        result["syncs"] = dict(cycles=len(out.cycles), total=sum(where.values()),
                               graphs_per_cycle=sum(graph_where.values()) / len(replayed.cycles),
                               graphs_where=dict(graph_where.most_common(12)),
                               per_cycle=sum(where.values()) / len(out.cycles), where=dict(where.most_common(12)),
                               target_alone_per_token=sum(alone_where.values()) / len(alone.token_ids),
                               target_alone_where=dict(alone_where.most_common(6)),
                               static_per_cycle=sum(static_where.values()) / len(static.cycles),
                               static_where=dict(static_where.most_common(12)))
        print(f"host syncs: {result['syncs']['per_cycle']:.2f} per cycle ({dict(where.most_common(6))}); "
              f"target alone {result['syncs']['target_alone_per_token']:.2f} per token", flush=True)

    result["batches"] = {}
    for size in (int(b) for b in args.batches.split(",")):
        prompts = random_prompts(size, args.prompt_len, min(vocab, 151000), seed=size)
        if not result["batches"]:
            batch_speeds(decoders["K=4"], prompts, sampling, 4, device, decoders["K=4 static"])  # warm-up
        rows = batch_speeds(decoders["K=4"], prompts, sampling, args.batch_new_tokens, device,
                            static=decoders["K=4 static"], graphs=graphed and (graphed["K=4 graphs"], alone))
        result["batches"][size] = rows
        print(f"batch {size}: speculative {rows['speculative']['tokens_per_s']:.1f} tok/s, target alone "
              f"{rows['target alone']['tokens_per_s']:.1f} tok/s ({rows['ratio']:.2f}x); static cache "
              f"{rows['speculative, static cache']['tokens_per_s']:.1f} against "
              f"{rows['target alone, static cache']['tokens_per_s']:.1f} ({rows['static_ratio']:.2f}x)"
              + (f"; graphs {rows['speculative, graphs']['tokens_per_s']:.1f} against "
                 f"{rows['target alone, graphs']['tokens_per_s']:.1f} ({rows['graphs_ratio']:.2f}x)"
                 if "graphs_ratio" in rows else ""), flush=True)

    with open(os.path.join(args.out, "gpu_cycle.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "gpu_cycle.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))


def markdown(r) -> str:
    lines = [f"Machine: {r['device']}; commit {r['commit'][:12]}; torch {r['torch']}; date {r['date']}; {r['shape']} shape, "
             f"random {r['dtype']} "
             f"weights, {r['prompt_len']}-token prompt, block {r['block']}, T 1.0", "",
             "| figure | value |", "| --- | ---: |",
             f"| target forward over {r['block'] + 1} tokens (ms) | {r['target_forward_ms']:.2f} |"]
    for name, row in r["cycles"].items():
        lines.append(f"| cycle at batch 1, {name} (ms, median of {len(row['runs_ms'])} runs) | {row['cycle_ms']:.2f} |")
        if name.endswith("graphs"):
            continue  # the loop's host clocks see a replayed cycle's launch and wait, not its parts
        lines.append(f"| of which draft / verify, {name} (ms) | {row['draft_ms']:.2f} / {row['verify_ms']:.2f} |")
    for name, row in r["cycle_parts"].items():
        lines.append(f"| K-dependent steps, {name}: propose / choose / verify (ms) | {row['propose_ms']:.3f} / "
                     f"{row['choose_ms']:.3f} / {row['verify_ms']:.3f} |")
    lines += [f"| K = 4 overhead over K = 1 | {100 * r['k4_overhead']:+.1f}% |",
              f"| K = 4 overhead over K = 1, from the K-dependent steps | {100 * r['k4_parts_overhead']:+.2f}% |",
              f"| K = 1 cycle / target forward | {r['cycle_over_target_forward']:.2f}x |"]
    if "syncs" in r:
        s = r["syncs"]
        lines += [f"| host syncs per cycle (K = 4) | {s['per_cycle']:.2f} |",
                  f"| host syncs per cycle (K = 4, static cache) | {s['static_per_cycle']:.2f} |",
                  f"| host syncs per token, target alone | {s['target_alone_per_token']:.2f} |"]
    g = r["graphs"]
    if isinstance(g, str):
        lines.append(f"| CUDA graphs | {g} |")
    else:
        parts = g["parts_ms"]
        lines += [f"| K = 4 cycle, eager static cache / graphs | {g['k4_speedup_over_eager_static']:.2f}x |",
                  f"| K = 1 cycle, eager / graphs | {g['k1_speedup_over_eager']:.2f}x |",
                  f"| K = 4 overhead over K = 1, graphs | {100 * g['k4_overhead']:+.1f}% |",
                  f"| K = 1 cycle with graphs / target forward | {g['k1_over_target_forward']:.2f}x |",
                  "| K = 4 graphs: draft / target forward / verify inside the cycle (ms) | "
                  + " / ".join(f"{parts[k]:.3f}" if k in parts else "n/a" for k in ("draft", "score", "verify")) + " |",
                  f"| K = 4 graphs' tokens equal the eager static cache's | {g['tokens_equal_eager_static']} |",
                  f"| parts left eager | {g['eager_parts'] or 'none'} |"]
    if "syncs" in r:
        lines.append(f"| host syncs per cycle (K = 4, graphs) | {r['syncs']['graphs_per_cycle']:.2f} |")
    graphs = any("graphs_ratio" in row for row in r["batches"].values())
    lines += ["", "tok/s, dynamic cache / static cache" + (" / CUDA graphs" if graphs else "") + ":", "",
              "| batch | speculative | target alone | ratio | cycles |", "| ---: | ---: | ---: | ---: | ---: |"]
    for size, row in r["batches"].items():
        with_graphs = graphs and "graphs_ratio" in row
        lines.append(f"| {size} | {row['speculative']['tokens_per_s']:.1f} / "
                     f"{row['speculative, static cache']['tokens_per_s']:.1f}"
                     + (f" / {row['speculative, graphs']['tokens_per_s']:.1f}" if with_graphs else "")
                     + f" | {row['target alone']['tokens_per_s']:.1f}"
                     f" / {row['target alone, static cache']['tokens_per_s']:.1f}"
                     + (f" / {row['target alone, graphs']['tokens_per_s']:.1f}" if with_graphs else "")
                     + f" | {row['ratio']:.2f}x / {row['static_ratio']:.2f}x"
                     + (f" / {row['graphs_ratio']:.2f}x" if with_graphs else "")
                     + f" | {row['speculative']['cycles']} / {row['speculative, static cache']['cycles']}"
                     + (f" / {row['speculative, graphs']['cycles']}" if with_graphs else "") + " |")
    if "syncs" in r:
        lines += ["", "Host syncs by source line (K = 4 speculative run):", ""]
        lines += [f"- `{where}`: {count}" for where, count in r["syncs"]["where"].items()]
        lines += ["", "Host syncs by source line (K = 4, static cache):", ""]
        lines += [f"- `{where}`: {count}" for where, count in r["syncs"]["static_where"].items()]
        lines += ["", "Host syncs by source line (K = 4, CUDA graphs):", ""]
        lines += [f"- `{where}`: {count}" for where, count in r["syncs"]["graphs_where"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
