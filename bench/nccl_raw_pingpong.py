"""NCCL's own floor for one decode layer's exchange, called the way attnd calls it (raw
ncclSend/ncclRecv through ctypes on a CUDA stream, no torch.distributed), in several shapes.

Two processes, rank 0 on GPU 0 (attnd's place), rank 1 on GPU 1 (the client's). Per round rank 1
sends the layer's inputs and receives its outputs; rank 0 mirrors it. Shapes (--modes):
  three   q, k, v as three ncclSend in one group; o, lse as two ncclRecv in one group (attnd's
          wire order today)
  one     the inputs as one contiguous buffer, the outputs as one (one op per direction)
  splitK  the contiguous buffers cut in K parts over K communicators, each on a stream of its
          own (forked from and joined back to the main stream with events)
Each mode runs eagerly (the host enqueues every round; host_us is what the host spent per
round, so gpu_us == host_us means the host set the pace) and, with --graph, as rounds captured
in a CUDA graph and replayed (no host in the way). Bytes are checked on the last round.

  python3 bench/nccl_raw_pingpong.py [--rows 128] [--rounds 1000] [--modes three,one,split2,split4]
      [--graph] [--fill_us 8.5 --kernels_us 51]   # round_trip_us - fill - kernels: the overhead
"""
import argparse
import ctypes
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client",
                                "python"))
from attnd.nccl import NcclLibrary, UNIQUE_ID_BYTES, _UniqueId  # noqa: E402

NCCL_UINT8 = 1


def parts_of(mode):
    if mode in ("three", "one"):
        return 1
    return int(mode[len("split"):])


def worker(rank, args, ids_queue, results):
    torch.cuda.set_device(rank)
    nccl = NcclLibrary()
    lib = nccl.lib
    modes = args.modes.split(",")
    comms_needed = max(parts_of(m) for m in modes)
    if rank == 0:
        ids = []
        for _ in range(comms_needed):
            uid = _UniqueId()
            nccl._check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            ids.append(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))
        ids_queue.put(ids)
    else:
        ids = ids_queue.get(timeout=60)
    comms = []
    for raw in ids:
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), raw, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        nccl._check(lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank), "ncclCommInitRank")
        comms.append(comm)

    rows = args.rows
    shapes_in = [(rows, 32, 128), (rows, 8, 128), (rows, 8, 128)]   # q, k, v bf16
    in_bytes = sum(a * b * c for a, b, c in shapes_in) * 2
    out_bytes = rows * 32 * 128 * 2 + rows * 32 * 4               # o bf16, lse fp32
    gen = torch.Generator(device="cuda").manual_seed(11)
    sent_in = torch.randint(0, 256, (in_bytes,), dtype=torch.uint8, device="cuda", generator=gen)
    sent_out = torch.randint(0, 256, (out_bytes,), dtype=torch.uint8, device="cuda", generator=gen)
    inputs = sent_in.clone() if rank == 1 else torch.zeros_like(sent_in)
    outputs = sent_out.clone() if rank == 0 else torch.zeros_like(sent_out)
    peer = 1 - rank
    main = torch.cuda.Stream()
    side = [torch.cuda.Stream() for _ in range(comms_needed)]

    def op(send, tensor, offset, count, comm, stream):
        call = lib.ncclSend if send else lib.ncclRecv
        nccl._check(call(ctypes.c_void_p(tensor.data_ptr() + offset), ctypes.c_size_t(count),
                         ctypes.c_int(NCCL_UINT8), ctypes.c_int(peer), comm,
                         ctypes.c_void_p(stream.cuda_stream)), "ncclSend/Recv")

    def group(ops):
        nccl._check(lib.ncclGroupStart(), "ncclGroupStart")
        for args_ in ops:
            op(*args_)
        nccl._check(lib.ncclGroupEnd(), "ncclGroupEnd")

    def cuts(total, k):
        step = (total + k - 1) // k
        step = (step + 255) // 256 * 256
        return [(i * step, min(step, total - i * step)) for i in range(k) if i * step < total]

    def direction(send, tensor, mode):
        """One direction of a round on `main` (forking to the side streams for splitK)."""
        if mode == "three":
            if tensor is inputs:
                offsets, o = [], 0
                for a, b, c in shapes_in:
                    offsets.append((o, a * b * c * 2))
                    o += a * b * c * 2
            else:
                offsets = [(0, rows * 32 * 128 * 2), (rows * 32 * 128 * 2, rows * 32 * 4)]
            group([(send, tensor, off, n, comms[0], main) for off, n in offsets])
        elif mode == "one":
            group([(send, tensor, 0, tensor.numel(), comms[0], main)])
        else:
            pieces = cuts(tensor.numel(), parts_of(mode))
            fork = torch.cuda.Event()
            fork.record(main)
            for i, (off, n) in enumerate(pieces):
                side[i].wait_event(fork)
                group([(send, tensor, off, n, comms[i], side[i])])
            for i in range(len(pieces)):
                join = torch.cuda.Event()
                join.record(side[i])
                main.wait_event(join)

    # Stand-ins for the work between the exchanges (--work): the client's fill before it sends,
    # attnd's kernels between its receive and its send (torch.cuda._sleep spins one thread).
    cycles_per_us = 0.0
    if args.fill_us > 0 or args.kernels_us > 0:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        b.synchronize()
        cycles_per_us = 2_000_000 / (a.elapsed_time(b) * 1000.0)
    work_us = args.fill_us if rank == 1 else args.kernels_us

    def work():
        if work_us > 0:
            torch.cuda._sleep(int(work_us * cycles_per_us))

    def round_trip(mode):
        if rank == 1:
            work()
            direction(True, inputs, mode)
            direction(False, outputs, mode)
        else:
            direction(False, inputs, mode)
            work()
            direction(True, outputs, mode)

    for mode in modes:
        with torch.cuda.stream(main):
            for _ in range(20):
                round_trip(mode)
        main.synchronize()
        for runner in ("eager", "graph") if args.graph else ("eager",):
            if rank == 1:
                outputs.zero_()
            else:
                inputs.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if runner == "eager":
                t0 = time.perf_counter()
                start.record(main)
                with torch.cuda.stream(main):
                    for _ in range(args.rounds):
                        round_trip(mode)
                end.record(main)
                host_us = (time.perf_counter() - t0) * 1e6 / args.rounds
                rounds = args.rounds
            else:
                graph = torch.cuda.CUDAGraph()
                per_graph = 50
                with torch.cuda.graph(graph, stream=main, capture_error_mode="thread_local"):
                    for _ in range(per_graph):
                        round_trip(mode)
                torch.cuda.synchronize()
                replays = max(1, args.rounds // per_graph)
                t0 = time.perf_counter()
                start.record(main)
                with torch.cuda.stream(main):
                    for _ in range(replays):
                        graph.replay()
                end.record(main)
                host_us = (time.perf_counter() - t0) * 1e6 / (replays * per_graph)
                rounds = replays * per_graph
            end.synchronize()
            gpu_us = start.elapsed_time(end) * 1000.0 / rounds
            ok = torch.equal(outputs, sent_out) if rank == 1 else torch.equal(inputs, sent_in)
            results.put((rank, mode, runner, gpu_us, host_us, ok))
            if runner == "graph":
                del graph
    torch.cuda.synchronize()
    for comm in comms:
        lib.ncclCommDestroy(comm)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--modes", default="three,one,split2,split4")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--fill_us", type=float, default=0.0,
                        help="GPU work on the client's side before each send")
    parser.add_argument("--kernels_us", type=float, default=0.0,
                        help="GPU work on attnd's side between its receive and its send")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ids_queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, ids_queue, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    expected = 2 * len(args.modes.split(",")) * (2 if args.graph else 1)
    seen = {}
    for _ in range(expected):
        try:
            rank, mode, runner, gpu_us, host_us, ok = results.get(timeout=300)
        except Exception:  # a worker died: report what came
            break
        seen.setdefault((mode, runner), {})[rank] = (gpu_us, host_us, ok)
    for p in procs:
        p.join(timeout=60)
    in_bytes = args.rows * 48 * 128 * 2
    out_bytes = args.rows * 32 * (128 * 2 + 4)
    for (mode, runner), ranks in seen.items():
        gpu, host, ok1 = ranks.get(1, (0, 0, False))
        ok0 = ranks.get(0, (0, 0, False))[2]
        print(f"RESULT nccl_raw_pingpong rows={args.rows} mode={mode} runner={runner} "
              f"in_bytes={in_bytes} out_bytes={out_bytes} fill_us={args.fill_us:g} "
              f"kernels_us={args.kernels_us:g} round_trip_us={gpu:.1f} "
              f"host_us={host:.1f} checked={'PASS' if ok0 and ok1 else 'FAIL'}", flush=True)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
