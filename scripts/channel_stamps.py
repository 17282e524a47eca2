#!/usr/bin/env python3
"""Puts a CUDA_IPC channel's layers on one GPU time line (docs/benchmarks.md, issue 12).

Input: attnd's stderr with ATTND_CHANNEL_STAMPS=1 (`attnd-stamp seq= layer= ready_passed_ns=
kernels_done_ns=` lines) and `attnctl bench --transport=cuda_ipc --fill_stamps` output
(`client-stamp seq= layer= fill_start_ns= fill_end_ns=` lines of the chained phase). Every time
is the GPU's %globaltimer, one clock for both processes. Per layer:

  fill      the client's q/k/v kernel, its first block's start to its last block's end
  ready     fill end -> attnd's stream past its ready wait (the ready write, the wait, a stamp)
    seen      of which: fill end -> a polling kernel saw the word (where attnd's line has it)
    launch    and: the word seen -> the next kernel on attnd's stream ran (a stamp)
  attnd     -> attnd's kernels done (append + attention launches and runs, a stamp)
  done      -> the client's next fill starts (the done write, the client's wait, its launch)

Usage: channel_stamps.py ATTND_LOG BENCH_OUT
"""
import re
import statistics
import sys


def read(path, prefix, keys):
    """{(seq, layer): (value of each key, 0 where the line lacks it)} of `prefix` lines."""
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            at = line.find(prefix + " ")
            if at < 0:
                continue
            fields = dict(re.findall(r"(\w+)=(\d+)", line[at:]))
            if "seq" in fields and "layer" in fields:
                rows[(int(fields["seq"]), int(fields["layer"]))] = tuple(
                    int(fields.get(k, 0)) for k in keys)
    return rows


def percentiles(values):
    if not values:
        return "n/a"
    values = sorted(values)
    pick = lambda p: values[min(len(values) - 1, int(p / 100 * len(values)))]
    return "p10 %7.2f  p50 %7.2f  p90 %7.2f  mean %7.2f  (n=%d)" % (
        pick(10) / 1e3, pick(50) / 1e3, pick(90) / 1e3, statistics.mean(values) / 1e3,
        len(values))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    attnd = read(sys.argv[1], "attnd-stamp",
                 ["ready_passed_ns", "kernels_done_ns", "ready_seen_ns"])
    client = read(sys.argv[2], "client-stamp", ["fill_start_ns", "fill_end_ns"])
    keys = sorted(k for k in client if k in attnd)
    if not keys:
        sys.exit("no (seq, layer) in both inputs")
    layers = max(layer for _, layer in keys) + 1
    parts = {name: [] for name in ("fill", "ready", "seen", "launch", "attnd", "done", "layer")}
    boundary = {name: [] for name in ("ready", "seen", "launch", "attnd", "done")}
    for seq, layer in keys:
        start, end = client[(seq, layer)]
        passed, finished, seen = attnd[(seq, layer)]
        nxt = (seq, layer + 1) if layer + 1 < layers else (seq + 1, 0)
        if start == 0 or end == 0 or passed == 0 or finished == 0:
            continue
        target = parts if layer + 1 < layers else boundary
        parts["fill"].append(end - start)
        target["ready"].append(passed - end)
        if seen != 0:
            target["seen"].append(seen - end)
            target["launch"].append(passed - seen)
        target["attnd"].append(finished - passed)
        if nxt in client and client[nxt][0] != 0:
            target["done"].append(client[nxt][0] - finished)
            if target is parts:
                parts["layer"].append(client[nxt][0] - start)
    print("per layer (us), layers 0..%d of %d chained steps:" % (layers - 2, len(keys) // layers))
    for name in ("fill", "ready", "seen", "launch", "attnd", "done", "layer"):
        print("  %-6s %s" % (name, percentiles(parts[name])))
    print("last layer of a step -> the next step's layer 0 (us):")
    for name in ("ready", "seen", "launch", "attnd", "done"):
        print("  %-6s %s" % (name, percentiles(boundary[name])))


if __name__ == "__main__":
    main()
