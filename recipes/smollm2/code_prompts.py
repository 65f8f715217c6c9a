"""Coding prompts for the drafter's training mix, from no evaluation set: the documented
public functions of Python's own standard library, asked for either as a stub to complete
(signature + docstring, the way HumanEval asks) or as a function to write from its
description. A seeded sample; the pool is the running Python's standard library (the recipe
used Python 3.11).

    python recipes/smollm2/code_prompts.py --count 500 --seed 0 --out data/code-prompts.jsonl
    python recipes/smollm2/code_prompts.py --count 8 --seed 1 --exclude data/code-prompts.jsonl --out data/code-heldout.jsonl
"""
import argparse
import importlib
import inspect
import json
import os
import random
import sys
import warnings

COMPLETE = "Complete the following Python function:\n\n```python\n{stub}```"
WRITE = "Write a Python function `{name}{signature}` that does the following.\n\n{doc}"


def documented_functions():
    """(module.name, signature, first docstring paragraphs) of every public, documented,
    pure-Python function defined in a public standard-library module, in a fixed order."""
    found = []
    for module_name in sorted(sys.stdlib_module_names):
        if module_name.startswith("_") or module_name in {"antigravity", "this", "idlelib", "turtledemo"}:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # platform-specific or GUI modules
            continue
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module_name:
                continue
            doc = inspect.getdoc(function) or ""
            doc = "\n\n".join(doc.split("\n\n")[:2]).strip()
            if len(doc) < 60:
                continue
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                continue
            if " at 0x" in signature:  # a default whose repr is an address: the prompt would differ per run
                continue
            found.append((f"{module_name}.{name}", name, signature, doc[:700]))
    return found


def stub(name, signature, doc):
    body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
    return f'def {name}{signature}:\n    """\n{body}\n    """\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", help="a prompts JSONL whose functions must not be chosen (held-out vs train)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    excluded = set()
    if args.exclude:
        with open(args.exclude) as f:
            excluded = {json.loads(line)["id"] for line in f if line.strip()}
    pool = [entry for entry in documented_functions() if f"stdlib-{entry[0]}" not in excluded]
    if len(pool) < args.count:
        raise SystemExit(f"only {len(pool)} documented standard-library functions, asked for {args.count}")
    rng = random.Random(args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for qualified, name, signature, doc in rng.sample(pool, args.count):
            if rng.random() < 0.5:
                prompt = COMPLETE.format(stub=stub(name, signature, doc))
            else:
                prompt = WRITE.format(name=name, signature=signature, doc=doc)
            f.write(json.dumps({"id": f"stdlib-{qualified}", "prompt": prompt}) + "\n")
    print(f"{args.count} coding prompts from {len(pool)} documented standard-library functions -> {args.out}")


if __name__ == "__main__":
    main()
