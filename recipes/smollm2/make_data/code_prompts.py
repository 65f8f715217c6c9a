"""Coding prompts for the drafter's training mix, from no evaluation set: the documented
public functions of Python's own standard library, asked for either as a stub to complete
(signature + docstring, the way HumanEval asks) or as a function to write from its
description.

Which functions are chosen does not depend on the machine: each function's place in the
order is a hash of (seed, its name), so a function's membership does not move when a build
lacks some module, training sets of different sizes are prefixes of one another, and
`--heldout` takes the far end of the same order, which training prefixes never reach (the
last 16 are kept for it). Only functions whose defaults are plain literals are used: a default
such as `os.environ` or `sys.executable` would put the machine into the prompt.

    python recipes/smollm2/make_data/code_prompts.py --count 500 --seed 0 --out data/code-prompts.jsonl
    python recipes/smollm2/make_data/code_prompts.py --count 8 --seed 0 --heldout --out data/code-heldout.jsonl
"""
import argparse
import hashlib
import importlib
import inspect
import json
import os
import sys
import warnings

COMPLETE = "Complete the following Python function:\n\n```python\n{stub}```"
WRITE = "Write a Python function `{name}{signature}` that does the following.\n\n{doc}"
# GUI modules (and turtle's generated wrappers) exist only where Tk is installed; sysconfig's
# and site's literal defaults are computed from the installation (a venv or not)
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "sysconfig", "site"}
MAX_DOC = 700
HELDOUT_RESERVE = 16  # the far end of the order that training prompts never reach


def literal(value) -> bool:
    """A default that prints the same on every machine: no object, no path (platform's
    defaults name the interpreter)."""
    if isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        return "/" not in text and "\\" not in text
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, tuple) and all(literal(v) for v in value)


def stdlib_modules():
    """(name, module) of every public standard-library module that imports here, in name order."""
    for module_name in sorted(sys.stdlib_module_names):
        if module_name.startswith("_") or module_name.split(".")[0] in SKIPPED_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # platform-specific modules
            continue
        yield module_name, module


def documented_functions():
    """[(id, name, signature, doc)] of every public, documented, pure-Python function defined
    in a public standard-library module whose defaults are literals, one per distinct
    (name, signature, doc): ntpath.splitext and posixpath.splitext read the same."""
    found, seen = [], set()
    for module_name, module in stdlib_modules():
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module_name:
                continue
            doc = "\n\n".join((inspect.getdoc(function) or "").split("\n\n")[:2]).strip()
            if not 60 <= len(doc) <= MAX_DOC or '"""' in doc or "```" in doc:
                continue
            try:
                signature = inspect.signature(function)
            except (TypeError, ValueError):
                continue
            defaults = [p.default for p in signature.parameters.values() if p.default is not p.empty]
            if not all(literal(d) for d in defaults):
                continue
            key = (name, str(signature), doc)
            if key not in seen:
                seen.add(key)
                found.append((f"stdlib-{module_name}.{name}", name, str(signature), doc))
    return found


def rank(seed: int, prompt_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:8], "big")


def stub(name, signature, doc):
    body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
    return f'def {name}{signature}:\n    """\n{body}\n    """\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", action="store_true", help="take the far end of the order, not the start")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.count <= 0:
        raise SystemExit(f"--count must be > 0, got {args.count}")
    pool = sorted(documented_functions(), key=lambda entry: rank(args.seed, entry[0]))
    limit = HELDOUT_RESERVE if args.heldout else len(pool) - HELDOUT_RESERVE
    if args.count > limit:
        raise SystemExit(f"--count {args.count} > {limit}: the last {HELDOUT_RESERVE} of the {len(pool)} functions "
                         "are kept for --heldout")
    chosen = pool[-args.count:][::-1] if args.heldout else pool[: args.count]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".part", "w") as f:
        for prompt_id, name, signature, doc in chosen:
            # the phrasing comes from the same hash, so it too is fixed per function
            if rank(args.seed + 1, prompt_id) % 2 == 0:
                prompt = COMPLETE.format(stub=stub(name, signature, doc))
            else:
                prompt = WRITE.format(name=name, signature=signature, doc=doc)
            f.write(json.dumps({"id": prompt_id, "prompt": prompt}) + "\n")
    os.replace(args.out + ".part", args.out)
    print(f"{len(chosen)} coding prompts from {len(pool)} documented standard-library functions -> {args.out}")


if __name__ == "__main__":
    main()
