#!/usr/bin/env python3
"""Export/import throughput over gRPC: a Llama-3-8B-shaped sequence (32 layers, 8 KV heads,
head_dim 128, bf16, 16-token pages) moved by attnctl between two caches of one attnd.

  tests/bench/sequence_transfer_bench.py BUILD_DIR [--tokens=2048] [--backend=cpu]

The sequence is created by importing synthetic pages (random bytes with correct CRC-32s), so no
prefill runs; then attnctl exports it to a file (export), imports the file (import), and copies
it straight from cache to cache (export and import pipelined). Prints MB/s of KV bytes."""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "client", "python"))
import attnd  # noqa: E402
from attnd.v1 import attnd_pb2 as pb  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_messages(config, tokens, chunk_bytes=4 << 20):
    pages = (tokens + config.page_size - 1) // config.page_size
    page_bytes = config.page_size * config.num_kv_heads * config.head_dim * 2
    per_chunk = max(1, chunk_bytes // page_bytes)
    header = pb.SequenceHeader(config=config, sequence_id=1, num_tokens=tokens, num_pages=pages)
    yield pb.ExportSequenceResponse(header=header)
    block = os.urandom(per_chunk * page_bytes)
    for layer in range(config.num_layers):
        for pool in (pb.KV_POOL_K, pb.KV_POOL_V):
            for first in range(0, pages, per_chunk):
                count = min(per_chunk, pages - first)
                data = block[:count * page_bytes]
                yield pb.ExportSequenceResponse(chunk=pb.SequenceChunk(
                    layer=layer, pool=pool, first_page=first, num_pages=count, data=data,
                    crc32=zlib.crc32(data)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("build_dir")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    attnd_bin = os.path.join(args.build_dir, "server", "attnd")
    attnctl = os.path.join(args.build_dir, "client", "attnctl")
    port = free_port()
    pages = (args.tokens + 15) // 16 + 8
    daemon = subprocess.Popen([attnd_bin, f"--listen_address=127.0.0.1:{port}", "--metrics_address=",
                               f"--backend={args.backend}", f"--kv_memory_bytes={3 * pages * 16 * 131072}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = attnd.Client(f"127.0.0.1:{port}")
        client.wait_for_ready(30)
        for name in ("a", "b", "c"):
            client.create_cache(name, num_layers=32, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                page_size=16, q_dtype="bfloat16", num_pages=pages)
        config = client.get_cache("a").config
        kv_bytes = args.tokens // 16 * 16 * 131072 + (args.tokens % 16 and 16 * 131072)
        start = time.perf_counter()
        client.import_sequence("a", synthetic_messages(config, args.tokens))
        python_import = time.perf_counter() - start
        print(f"sequence: {args.tokens} tokens, {kv_bytes / 1e6:.1f} MB of KV "
              f"(python client import: {kv_bytes / python_import / 1e6:.0f} MB/s)")
        server = f"--server=127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "seq.bin")
            runs = {
                "export to file (attnctl seq export --out)":
                    [attnctl, server, "seq", "export", "a", "1", f"--out={path}"],
                "import from file (attnctl seq import --in)":
                    [attnctl, server, "seq", "import", "b", f"--in={path}"],
                "cache to cache (attnctl seq export --to)":
                    [attnctl, server, "seq", "export", "a", "1", f"--to=127.0.0.1:{port}", "--to_cache=c"],
            }
            for what, command in runs.items():
                start = time.perf_counter()
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                seconds = time.perf_counter() - start
                print(f"{what}: {seconds:.3f} s, {kv_bytes / seconds / 1e6:.0f} MB/s")
        exported = [m.SerializeToString() for m in client.export_sequence("a", 1)]
        for name in ("b", "c"):
            assert [m.SerializeToString() for m in client.export_sequence(name, 1)] == exported
        print("b and c export byte-identical to a")
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
