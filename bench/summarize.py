"""Turns a pytest-benchmark JSON file into the op-vs-reference table of bench/RESULTS.md.

    python bench/summarize.py results.json [more.json ...] [--machine "..."] > table.md
Each row is one benchmark group: the op's and the reference's mean time and their ratio; on a GPU
run with staged CUDA kernels (the `cuda-staged` device, docs/ops.md) also the staged op's mean
time, its speed-up over the verified op and its fraction of the HBM roofline.
Decode-cycle benchmarks (extra_info cycle_ms) also get a table of per-cycle times with the
overhead of K branches over K = 1.
"""
import argparse
import collections
import datetime
import json
import re


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_files", nargs="+", help="pytest-benchmark JSON files of one machine (merged)")
    parser.add_argument("--machine", default=None, help="machine description for the header")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="measured device copy bandwidth in bytes/s: adds the fraction of the HBM roofline")
    args = parser.parse_args()
    data = None
    for path in args.json_files:
        with open(path) as f:
            part = json.load(f)
        if data is None:
            data = part
        else:
            data["benchmarks"] += part["benchmarks"]
    groups = collections.defaultdict(dict)
    bytes_read = {}
    peak = collections.defaultdict(dict)  # group -> impl -> peak extra host bytes
    for bench in data["benchmarks"]:
        impl = bench["params"].get("impl", "op")
        if bench["params"].get("device") == "cuda-staged":  # the same group, timed with the staged kernels
            impl = "staged" if impl == "op" else f"{impl}-staged"
        info = bench.get("extra_info", {})
        groups[bench["group"]][impl] = bench["stats"]
        if "bytes" in info:
            bytes_read[bench["group"]] = info["bytes"]
        if "peak_extra_bytes" in info:
            peak[bench["group"]][impl] = info["peak_extra_bytes"]
    machine = args.machine or data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "unknown machine")
    date = data.get("datetime", datetime.datetime.now().isoformat())[:10]
    torch_version = data.get("machine_info", {}).get("torch", "unknown")
    print(f"Machine: {machine}; torch {torch_version}; date {date}\n")
    roofline = args.bandwidth is not None
    memory = bool(peak)
    staged = any("staged" in impls for impls in groups.values())
    header = "| group | op mean (ms) | reference mean (ms) | speed-up (reference / op) | op rounds |"
    header += " HBM roofline |" if roofline else ""
    header += " staged op mean (ms) | staged speed-up (op / staged) |" if staged else ""
    header += " staged HBM roofline |" if staged and roofline else ""
    header += " op peak extra (MB) | reference peak extra (MB) | memory ratio (op / reference) |" if memory else ""
    print(header)
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if roofline else "") + (" ---: | ---: |" if staged else "")
          + (" ---: |" if staged and roofline else "") + (" ---: | ---: | ---: |" if memory else ""))
    for group, impls in sorted(groups.items()):
        op, ref = impls.get("op"), impls.get("reference")
        op_ms = f"{op['mean'] * 1e3:.3f}" if op else "-"
        ref_ms = f"{ref['mean'] * 1e3:.3f}" if ref else "-"
        ratio = f"{ref['mean'] / op['mean']:.1f}x" if op and ref else "-"
        row = f"| {group} | {op_ms} | {ref_ms} | {ratio} | {op['rounds'] if op else '-'} |"
        if roofline:
            # bytes that must be read once / bandwidth, over the measured time
            fraction = bytes_read[group] / args.bandwidth / op["mean"] if op and group in bytes_read else None
            row += f" {fraction:.1%} |" if fraction is not None else " - |"
        if staged:
            fast = impls.get("staged")
            row += f" {fast['mean'] * 1e3:.3f} |" if fast else " - |"
            row += f" {op['mean'] / fast['mean']:.1f}x |" if fast and op else " - |"
            if roofline:
                fraction = bytes_read[group] / args.bandwidth / fast["mean"] if fast and group in bytes_read else None
                row += f" {fraction:.1%} |" if fraction is not None else " - |"
        if memory:
            op_peak, ref_peak = peak[group].get("op"), peak[group].get("reference")
            row += f" {op_peak / 1e6:.1f} |" if op_peak is not None else " - |"
            row += f" {ref_peak / 1e6:.1f} |" if ref_peak is not None else " - |"
            row += f" {op_peak / ref_peak:.3f} |" if op_peak is not None and ref_peak else " - |"
        print(row)
    cycle_table(data)


def cycle_table(data) -> None:
    """Per-cycle draft / verify / total time of the op path per K, and the overhead over K = 1
    of the same setting (the group name with K=1)."""
    rows = {}
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        if "cycle_ms" in info and bench["params"].get("impl", "op") == "op":
            rows[bench["group"]] = info
    if not rows:
        return
    print("\n| decode setting | cycles | draft (ms/cycle) | verify (ms/cycle) | cycle (ms) | overhead vs K=1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for group, info in sorted(rows.items(), key=lambda kv: (re.sub(r"K=\d+", "", kv[0]), kv[0])):
        base = rows.get(re.sub(r"K=\d+", "K=1", group))
        overhead = f"{info['cycle_ms'] / base['cycle_ms'] - 1:+.1%}" if base else "-"
        print(f"| {group} | {info['cycles']} | {info['draft_ms']:.2f} | {info['verify_ms']:.2f} | "
              f"{info['cycle_ms']:.2f} | {overhead} |")


if __name__ == "__main__":
    main()
