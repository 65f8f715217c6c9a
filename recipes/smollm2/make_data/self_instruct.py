"""Chat prompts written by the target itself, for the drafter's training mix: the chat
template up to the start of a user turn is given to SmolLM2 and it is sampled until it
closes the turn (the "pre-query template" way of drawing instructions from an aligned model,
Magpie, Xu et al. 2024). Offline, and from no evaluation set. Seeded per batch: the same
arguments, torch build and thread count write the same file (floating-point sums may differ
elsewhere). An instruction's id is a hash of its text, so a regenerated file can never pair
an old response with a new prompt.

About a minute a batch of 32 on one CPU thread, so 2,000 instructions take over an hour. With
--batches DIR each sampled batch is kept there (one file a batch, written whole), so a run
resumes where it stopped, and several processes given the same DIR share the work: each takes
the lowest batch no one has, under its lock. The instructions are then read from the kept
batches in batch order with the same filter, so the file is the one a single process makes.

    python recipes/smollm2/make_data/self_instruct.py --count 500 --seed 0 --out data/chat-prompts.jsonl
    python recipes/smollm2/make_data/self_instruct.py --count 8 --seed 1 --exclude data/chat-prompts.jsonl --out data/chat-heldout.jsonl
    python recipes/smollm2/make_data/self_instruct.py --count 2000 --seed 0 --batches runs/chat-batches --out chat.jsonl  # x2
"""
import argparse
import fcntl
import hashlib
import json
import os
import time

import torch


def pre_query_ids(tokenizer):
    """The chat template's tokens up to where a user's text starts (system turn included)."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def normalised(text):
    return " ".join(text.lower().split())


def keep(text, seen):
    """A complete, non-trivial, new instruction (normalised duplicates are dropped)."""
    key = normalised(text)
    if not 20 <= len(text) <= 800 or key in seen:
        return False
    seen.add(key)
    return True


def instruction_id(text):
    return "self-instruct-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def choose(texts, chosen, seen, count) -> None:
    """Appends the texts that pass `keep` to `chosen`, up to `count`."""
    for text in texts:
        if len(chosen) < count and keep(text, seen):
            chosen.append({"id": instruction_id(text), "prompt": text})


def kept_prefix(folder, count, seen):
    """(instructions, batches read) from the kept batches 0, 1, ... while they exist and fewer than
    `count` are chosen; `seen` is not changed."""
    chosen, seen, index = [], set(seen), 0
    while len(chosen) < count and os.path.isfile(os.path.join(folder, f"batch-{index:05d}.json")):
        with open(os.path.join(folder, f"batch-{index:05d}.json")) as f:
            choose(json.load(f), chosen, seen, count)
        index += 1
    return chosen, index


def from_kept_batches(args, sample, seen, limit):
    """Samples the batches no other process has (lowest first) until the kept ones hold `count`."""
    os.makedirs(args.batches, exist_ok=True)
    while True:
        chosen, read = kept_prefix(args.batches, args.count, seen)
        print(f"{len(chosen)}/{args.count} instructions from the first {read} batches", flush=True)
        if len(chosen) >= args.count:
            return chosen
        for index in range(read, limit):
            path = os.path.join(args.batches, f"batch-{index:05d}.json")
            if os.path.isfile(path):
                continue
            lock = open(path + ".lock", "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:   # another process is sampling it
                lock.close()
                continue
            try:
                if not os.path.isfile(path):
                    texts = sample(index)
                    with open(f"{path}.{os.getpid()}.part", "w") as f:
                        json.dump(texts, f)
                    os.replace(f"{path}.{os.getpid()}.part", path)
            finally:
                lock.close()
            break
        else:
            if read >= limit:   # batch `read` is missing unless every batch up to the limit is kept
                raise SystemExit(f"only {len(chosen)} distinct instructions after {limit} batches")
            time.sleep(5)   # the rest are being sampled by others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96, help="longer instructions are dropped")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--exclude", help="a prompts JSONL whose instructions must not recur (held-out vs train)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", help="keep each sampled batch in this folder: resumable, and shared by "
                        "processes given the same folder")
    args = parser.parse_args()
    if args.count <= 0 or args.batch_size <= 0:
        raise SystemExit(f"--count and --batch-size must be > 0, got {args.count} and {args.batch_size}")
    seen = set()
    if args.exclude:
        with open(args.exclude) as f:
            seen = {normalised(json.loads(line)["prompt"]) for line in f if line.strip()}
    from dblast_ext.target.loading import load_target

    model, tokenizer = load_target("default", device="cpu")
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prefix = torch.tensor([pre_query_ids(tokenizer)])
    limit = 50 * max(1, args.count // args.batch_size)

    def sample(batch_index):
        """The batch's whole instructions (turns the token limit cut off are left out), in row order."""
        torch.manual_seed(args.seed * 1_000_003 + batch_index)
        ids = prefix.expand(args.batch_size, -1)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                 temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                 eos_token_id=end_of_turn, pad_token_id=end_of_turn)
        return [tokenizer.decode(row[: row.index(end_of_turn)], skip_special_tokens=True).strip()
                for row in out[:, prefix.shape[1]:].tolist() if end_of_turn in row]

    if args.batches:
        chosen = from_kept_batches(args, sample, seen, limit)
    else:
        chosen, batch_index = [], 0
        while len(chosen) < args.count:
            if batch_index >= limit:
                raise SystemExit(f"only {len(chosen)} distinct instructions after {batch_index} batches")
            choose(sample(batch_index), chosen, seen, args.count)
            batch_index += 1
            print(f"{len(chosen)}/{args.count} instructions after {batch_index} batches", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    partial = f"{args.out}.{os.getpid()}.part"   # cooperating processes write the same file: each its own part
    with open(partial, "w") as f:
        for row in chosen:
            f.write(json.dumps(row) + "\n")
    os.replace(partial, args.out)  # a cut-off run leaves no file that looks finished
    print(f"{len(chosen)} self-written instructions -> {args.out}")


if __name__ == "__main__":
    main()
