"""How much of what the target samples a draft vocabulary of its tokenizer's first N ids holds
(`--draft-vocab N`): the share of the tokens of the evaluation's responses (records' `text`,
re-encoded) below N. A draft outside the shortlist cannot be proposed, so this bounds how
much acceptance a shortlist can lose.

    python recipes/smollm2/measure/draft_vocab_coverage.py --runs runs/smollm2-eval [--target default]
"""
import argparse
import glob
import json
import os

SIZES = (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="eval.sh's OUT (or any folder holding records *.jsonl)")
    parser.add_argument("--target", default="default", help="whose tokenizer (default: the embedded SmolLM2)")
    args = parser.parse_args()
    paths = sorted(glob.glob(os.path.join(args.runs, "**", "*.jsonl"), recursive=True))
    if not paths:
        parser.error(f"--runs: no *.jsonl records under {args.runs}")
    from dblast_ext.target.loading import load_target

    _, tokenizer = load_target(args.target, device="cpu")
    by_temperature = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    continue  # a line still being written
                record = json.loads(line)
                if "text" not in record or "settings" not in record:
                    continue
                ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
                by_temperature.setdefault(record["settings"]["temperature"], []).extend(ids)
    print("| temperature | tokens | " + " | ".join(f"first {n}" for n in SIZES) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in SIZES) + " |")
    for t, ids in sorted(by_temperature.items()):
        shares = [sum(i < n for i in ids) / len(ids) for n in SIZES]
        print(f"| {t} | {len(ids)} | " + " | ".join(f"{100 * s:.1f}%" for s in shares) + " |")


if __name__ == "__main__":
    main()
