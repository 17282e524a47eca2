#!/usr/bin/env python3
"""PyTorch peer of attnd_bench's decode cases (PERFORMANCE.md).

torch.nn.functional.scaled_dot_product_attention on dense, padded KV: q [B, Hq, 1, D] against
k, v [B, Hkv, L, D] bf16 with enable_gqa (flash backend, which reads the shared KV heads once),
L = the case's longest length (mixed-length cases pay for their padding, as a dense engine
would). Timed the way attnd_bench times its kernels: a CUDA graph of N calls rotating over
enough input sets to exceed the L2, median of replays over N. Prints torch's time and fraction
of the copy bandwidth, and, given attnd_bench's CSV, ours/torch per case.

    python3 tests/bench/torch_baseline.py [--ours attnd_bench.csv] [--quick] [--csv out.csv]
        [--qo_heads N --kv_heads N --head_dim N]   (the shape attnd_bench ran with)
"""
import argparse
import csv
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
ROTATION_BYTES = 200_000_000
MAX_SETS = 64
TARGET_GRAPH_SECONDS = 3e-3
REPLAYS = 15


def time_graph(launches, fn):
    """Median seconds per call of fn(i), i in [0, launches), captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(launches, 3)):  # warm-up outside the graph (kernel selection)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(i)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / launches)
    del graph
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 28  # 1 GiB of float32
    source = torch.rand(n, device="cuda")
    target = torch.empty_like(source)
    seconds = time_graph(4, lambda i: target.copy_(source))
    del source, target
    return 2 * (n * 4) / seconds


def decode_cases(quick):
    batches = [1, 16, 64, 256] if quick else [1, 16, 64, 128, 256]
    lengths = [1024, 8192] if quick else [1024, 4096, 8192, 32768]
    cases = [(f"b{b}_kv{l}", b, l, l) for b in batches for l in lengths]
    return cases


def run_decode(batch, max_len, mean_len):
    """Seconds per call, and bytes a dense decode must read (every padded K/V byte, q, o)."""
    kv_bytes = batch * HKV * max_len * D * 2 * 2
    q_bytes = batch * HQ * D * 2
    bytes_per_set = kv_bytes + 2 * q_bytes
    sets = max(1, min(MAX_SETS, math.ceil(ROTATION_BYTES / bytes_per_set)))
    free, _ = torch.cuda.mem_get_info()
    if sets * bytes_per_set + (2 << 30) > free:
        return None, bytes_per_set
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + max_len)
    qs = [torch.rand(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 6 - 3
          for _ in range(sets)]
    ks = [torch.rand(batch, HKV, max_len, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 - 1
          for _ in range(sets)]
    vs = [torch.rand(batch, HKV, max_len, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 - 1
          for _ in range(sets)]
    outs = [None] * sets

    def call(i):
        s = i % sets
        outs[s] = F.scaled_dot_product_attention(qs[s], ks[s], vs[s], enable_gqa=True)

    estimate = bytes_per_set / 2.5e12 + 5e-6
    launches = max(3, min(400, math.ceil(TARGET_GRAPH_SECONDS / estimate)))
    launches = (launches + sets - 1) // sets * sets
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        call(0)
    # Correctness against float64 on the first request, before timing.
    q = qs[0][:1].double()
    k = ks[0][:1].double().repeat_interleave(HQ // HKV, 1)
    v = vs[0][:1].double().repeat_interleave(HQ // HKV, 1)
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1) @ v
    err = ((outs[0][:1].double() - ref).norm() / ref.norm()).item()
    del q, k, v, ref
    if not err < 1e-2:
        print(f"torch check failed: relative error {err}", file=sys.stderr)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        seconds = time_graph(launches, call)
    del qs, ks, vs, outs
    torch.cuda.empty_cache()
    return seconds, bytes_per_set


def main():
    global HQ, HKV, D
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", help="attnd_bench --csv output, for ours/torch ratios")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv", help="write torch's results here")
    parser.add_argument("--only_ours", action="store_true",
                        help="time only the cases in the --ours CSV")
    parser.add_argument("--qo_heads", type=int, default=HQ, help="as attnd_bench --qo_heads")
    parser.add_argument("--kv_heads", type=int, default=HKV, help="as attnd_bench --kv_heads")
    parser.add_argument("--head_dim", type=int, default=D, help="as attnd_bench --head_dim")
    args = parser.parse_args()
    HQ, HKV, D = args.qo_heads, args.kv_heads, args.head_dim

    ours = {}
    cases = decode_cases(args.quick)
    if args.ours:
        with open(args.ours) as f:
            for row in csv.DictReader(f):
                if row["kind"] != "decode":
                    continue
                ours[row["name"]] = row
        # Mixed-length cases come from the CSV (their lengths are attnd_bench's).
        for name, row in ours.items():
            if name.startswith("mixed") and "_fix" not in name:
                cases.append((name, int(row["batch"]), int(row["max_kv_len"]), int(row["kv_len"])))
        if args.only_ours:  # exactly the CSV's cases (attnd_bench --decode_cases among them)
            cases = [(name, int(row["batch"]), int(row["max_kv_len"]), int(row["kv_len"]))
                     for name, row in ours.items() if "_fix" not in name]

    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__} on {props.name}, {props.multi_processor_count} SMs; Hq {HQ}, Hkv {HKV}, D {D}")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (torch copy_, read + write): {bandwidth / 1e12:.3f} TB/s")
    print(f"{'case':<22} {'torch us':>10} {'torch %copy':>11} {'ours us':>10} {'ours %copy':>10} {'ours/torch':>10}")
    rows = []
    for name, batch, max_len, mean_len in cases:
        try:
            seconds, nbytes = run_decode(batch, max_len, mean_len)
        except RuntimeError as error:  # e.g. no flash kernel for the shape, or out of memory
            print(f"{name:<22} torch failed: {str(error).splitlines()[0]}")
            torch.cuda.empty_cache()
            continue
        if seconds is None:
            print(f"{name:<22} skipped: does not fit")
            continue
        line = f"{name:<22} {seconds * 1e6:10.2f} {100 * nbytes / seconds / bandwidth:10.1f}%"
        ratio = ""
        if name in ours:
            our_us = float(ours[name]["time_us"])
            ratio = f"{our_us / (seconds * 1e6):.3f}"
            line += f" {our_us:10.2f} {100 * float(ours[name]['frac_copy']):9.1f}% {ratio:>10}"
        print(line, flush=True)
        rows.append((name, batch, max_len, mean_len, seconds * 1e6, nbytes / seconds / bandwidth, ratio))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["name", "batch", "max_kv_len", "mean_kv_len", "torch_us", "torch_frac_copy", "ours_over_torch"])
            writer.writerows(rows)


if __name__ == "__main__":
    main()
