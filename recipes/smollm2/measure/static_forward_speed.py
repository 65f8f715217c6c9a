"""One verify forward of the embedded SmolLM2 target on a CPU, three ways, side by side in one
process: the compacting cache (the decode loop's default, eager), the fixed-shape static cache
(dblast_ext.target.slot_cache, eager), and the static cache's forward compiled by torch.compile
(inductor, fullgraph, fixed shapes; only the static cache gives a forward the same shapes every
cycle). One prompt of --context random tokens, a block of --block tokens, hidden states kept (as
the loop keeps them for the drafter). Run it on idle cores.

    OMP_NUM_THREADS=2 python recipes/smollm2/measure/static_forward_speed.py
"""
import argparse
import statistics
import time

import torch

from dblast_ext.target.ragged_cache import RaggedRows
from dblast_ext.target.slot_cache import SlotRows
from dblast_ext.target.adapter import TargetAdapter
from dblast_ext.target.loading import load_target


def milliseconds(fn, repeats: int) -> float:
    """Median of `repeats` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--capacity", type=int, default=512, help="the static cache's slots")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three, interleaved")
    args = p.parse_args()
    model, _ = load_target("default", device="cpu", dtype=args.dtype, progress=False)
    adapter = TargetAdapter(model, [1, model.config.num_hidden_layers // 2, model.config.num_hidden_layers - 2])
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, model.config.vocab_size, (1, args.block), generator=torch.Generator().manual_seed(1))

    dynamic = adapter.new_cache()
    adapter.forward(prompt, dynamic, last_logits_only=True)

    def dynamic_forward():
        adapter.forward(block, dynamic)
        adapter.crop(dynamic, args.context)

    layout = RaggedRows.left_padded([args.context])
    prefill = adapter.new_cache()
    adapter.forward(prompt, prefill, last_logits_only=True)
    rows, static = SlotRows.from_prefill(prefill, layout, args.capacity)
    mask, positions = rows.block_inputs(args.block, "cpu")  # the same slots every call: no commit

    def static_forward(ids, mask, positions):
        return adapter.forward(ids, static, attention_mask=mask, position_ids=positions)

    compiled = torch.compile(static_forward, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    compiled(block, mask, positions)
    print(f"compile: {time.perf_counter() - start:.1f} s", flush=True)
    runs = {"compacting cache, eager": dynamic_forward,
            "static cache, eager": lambda: static_forward(block, mask, positions),
            "static cache, torch.compile": lambda: compiled(block, mask, positions)}
    print(f"SmolLM2-135M-Instruct ({args.dtype}), {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.context}-token context, {args.block}-token block, {args.capacity} static slots; "
          f"median ms of {args.repeats} forwards", flush=True)
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {milliseconds(fn, args.repeats):.1f}"
                                                  for name, fn in runs.items()), flush=True)


if __name__ == "__main__":
    main()
