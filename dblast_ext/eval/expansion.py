"""Naive block expansion (DBloom Eq 4-5): the same drafter run at its trained block size and at
a wider one on the same prompts, and the change of E[n] split into the gain G of the uncapped
tail and the erosion L of the front positions."""
import json
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence

from ..prompts import Prompt
from .metrics import expansion_decomposition
from .report import summarize_run
from .runner import RunSpec, evaluate


def expansion_study(decoder, tokenizer, prompts: Sequence[Prompt], out_dir: str, spec: RunSpec, *,
                    category_temperature: float, trained: int, wider: int, eos_only: bool = True,
                    log: Optional[Callable[[str], None]] = None) -> Dict:
    """Records at block `trained` and at block `wider` (records_block<B>.jsonl under out_dir,
    resumable), the decomposition per dataset, written to expansion.json and returned as
    {"trained_block_size", "block_size", "datasets": rows}. A dataset either run cannot
    summarise (e.g. no response ended with EOS) is logged and left out, not fatal."""
    log = log or (lambda line: print(line, file=sys.stderr))
    if wider <= trained:
        raise ValueError(f"the wider block size {wider} must exceed the trained one {trained}")
    runs = {}
    for label, block in (("trained", trained), ("wider", wider)):
        decoder.drafter.config.block_size = block  # the drafter pass itself takes any block length
        log(f"expansion: block {block} ({label})")
        runs[label], _ = evaluate(decoder, tokenizer, list(prompts), os.path.join(out_dir, f"records_block{block}.jsonl"),
                                  spec, category_temperature=category_temperature)
    results = [summarize_run(runs[k], eos_only=eos_only, n_boot=1) for k in ("trained", "wider")]
    rows: List[Dict] = []
    for name in sorted({p.dataset for p in prompts}):
        why = next((r["skipped"][name] for r in results if name in r["skipped"]), None)
        if why is not None:
            log(f"expansion: {name} not summarised: {why}")
            continue
        hists = [r["datasets"][name]["histogram"] for r in results]
        rows.append(dict(dataset=name, **expansion_decomposition(hists[0], hists[1], trained)))
    result = {"trained_block_size": trained, "block_size": wider, "datasets": rows}
    with open(os.path.join(out_dir, "expansion.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def expansion_table(result: Dict) -> str:
    """The decomposition as a Markdown table."""
    trained, wider = result["trained_block_size"], result["block_size"]
    lines = [f"Naive expansion from block {trained} to {wider} (DBloom Eq 4-5): E[n] change = G - L.", "",
             "| dataset | E[n] trained | E[n] wider | G (uncapped gain) | L (front erosion) | G - L | "
             f"P(n >= {trained}) | ceiling trained | ceiling wider |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["datasets"]:
        lines.append(f"| {r['dataset']} | {r['mean_trained']:.2f} | {r['mean_wider']:.2f} | {r['G']:.3f} | "
                     f"{r['L']:.3f} | {r['G'] - r['L']:+.3f} | {100 * r['survival']:.1f}% | "
                     f"{100 * r['ceiling_trained']:.1f}% | {100 * r['ceiling_wider']:.1f}% |")
    return "\n".join(lines)
