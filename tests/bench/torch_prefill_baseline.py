#!/usr/bin/env python3
"""Torch peer of bench/prefill_bench.cc (PERFORMANCE.md, case "prefill").

Times torch.nn.functional.scaled_dot_product_attention on dense tensors at the same shapes
(Hq 32, Hkv 8 via enable_gqa, D 128, bf16): one request of q = kv = 512, 2048, 8192 and a batch
of 8 x 2048, causal, plus non-causal 2048 and 8192. With --ours, the cases and their shapes
(heads, head_dim) are the first CSV's rows instead. Median of CUDA-event timings after warm-up,
rotating input copies past L2. With --ours=CSV (written by prefill_bench --csv; repeat the flag
for several kernels, e.g. mma.sync and Hopper) it prints our time over torch's for every case.
"""
import argparse
import csv
import statistics

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128
CASES = [
    ("causal 1x512", 1, 512, True),
    ("causal 1x2048", 1, 2048, True),
    ("causal 1x8192", 1, 8192, True),
    ("causal 8x2048", 8, 2048, True),
    ("noncausal 1x2048", 1, 2048, False),
    ("noncausal 1x8192", 1, 8192, False),
]
L2_ROTATION_BYTES = 200 << 20


def time_case(batch, length, causal, hq=HQ, hkv=HKV, d=D):
    set_bytes = 2 * batch * length * d * (2 * hq + 2 * hkv)
    num_sets = max(1, -(-L2_ROTATION_BYTES // set_bytes))
    gen = torch.Generator(device="cuda").manual_seed(length * 131 + batch)
    sets = []
    for _ in range(num_sets):
        q = torch.randn(batch, hq, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        sets.append((q, k, v))

    def run(i):
        q, k, v = sets[i % num_sets]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    for i in range(3):
        run(i)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(0)
    stop.record()
    stop.synchronize()
    inner = max(1, int(2.0 / max(start.elapsed_time(stop), 1e-3)))
    times = []
    for r in range(15):
        start.record()
        for i in range(inner):
            run(r * inner + i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    ms = statistics.median(times)
    flops = 4.0 * batch * length * length * d * hq * (0.5 if causal else 1.0)
    return ms, flops / (ms * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", action="append", default=[], help="CSV from prefill_bench --csv (repeatable)")
    args = parser.parse_args()
    ours = []
    for path in args.ours:
        with open(path) as f:
            ours.append((path, {row["case"]: row for row in csv.DictReader(f)}))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    header = f"{'case':18} {'torch ms':>10} {'TFLOP/s':>9}"
    for path, _ in ours:
        header += f" | {path:>10} {'TFLOP/s':>9} {'%peak':>7} {'ours/torch':>10}"
    print(header)
    # The cases: the first CSV's rows, shapes included (prefill_bench --head_dim etc.), else CASES.
    cases = [(name, batch, length, causal, HQ, HKV, D) for name, batch, length, causal in CASES]
    if ours:
        cases = [(name, int(row["batch"]), int(row["length"]), row["causal"] == "1",
                  int(row.get("qo_heads") or HQ), int(row.get("kv_heads") or HKV), int(row.get("head_dim") or D))
                 for name, row in ours[0][1].items()]
    for name, batch, length, causal, hq, hkv, d in cases:
        ms, tflops = time_case(batch, length, causal, hq, hkv, d)
        line = f"{name:18} {ms:10.4f} {tflops:9.1f}"
        for _, rows in ours:
            if name in rows:
                row = rows[name]
                our_ms = float(row["ms"])
                line += (f" | {our_ms:10.4f} {float(row['tflops']):9.1f}"
                         f" {100 * float(row['tflops']) / float(row['peak_tflops']):6.1f}% {our_ms / ms:10.2f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
