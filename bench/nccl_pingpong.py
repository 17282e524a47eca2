"""What NCCL itself takes for one decode layer's exchange of the e2e shape, without attnd.

Two processes, rank 0 on GPU 0 (attnd's place), rank 1 on GPU 1 (the client's): per round,
rank 1 sends q [128, 32, 128], k and v [128, 8, 128] (bf16) as one group, rank 0 receives them
and sends back o [128, 32, 128] (bf16) and lse [128, 32] (fp32), which rank 1 receives. The
rounds are enqueued back to back on each side's stream; rank 1's CUDA events give the time per
round trip: the floor under attnctl bench --transport=nccl's per-layer overhead (issue 19).
The bytes are checked on the last round before timing is reported.

  python3 bench/nccl_pingpong.py [--rounds 2000] [--rows 128]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    rows = args.rows
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    o = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lse = torch.randn(rows, 32, device="cuda", dtype=torch.float32, generator=gen)
    if rank == 0:
        q, k, v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        o, lse = torch.empty_like(o), torch.empty_like(lse)
    peer = 1 - rank

    def round_trip():
        if rank == 1:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer) for t in (q, k, v)]):
                work.wait()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in (o, lse)]):
                work.wait()
        else:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in (q, k, v)]):
                work.wait()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer) for t in (o, lse)]):
                work.wait()

    for _ in range(50):
        round_trip()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.rounds):
        round_trip()
    end.record()
    torch.cuda.synchronize()
    # The bytes: what rank 0 holds equals what rank 1 sent (both made from seed 7).
    check = torch.Generator(device="cuda").manual_seed(7)
    expected = [torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16, generator=check)]
    expected += [torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16, generator=check)
                 for _ in range(2)]
    expected_o = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16, generator=check)
    ok = (all(torch.equal(a, b) for a, b in zip((q, k, v), expected)) if rank == 0
          else torch.equal(o, expected_o))
    if rank == 1:
        per_round = start.elapsed_time(end) * 1000.0 / args.rounds
        sent = (q.numel() + k.numel() + v.numel()) * 2
        back = o.numel() * 2 + lse.numel() * 4
        print(f"RESULT nccl_pingpong rows={rows} rounds={args.rounds} in_bytes={sent} "
              f"out_bytes={back} round_trip_us={per_round:.1f} "
              f"checked={'PASS' if ok else 'FAIL'} nccl={torch.cuda.nccl.version()}", flush=True)
    elif not ok:
        print("FAIL rank 0 received other bytes", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=128)
    mp.spawn(run, args=(parser.parse_args(),), nprocs=2)
