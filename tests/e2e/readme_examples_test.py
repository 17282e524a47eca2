#!/usr/bin/env python3
"""Runs the README's shell examples marked `<!-- e2e: run -->`, as written, against a fresh
attnd (CPU backend, loopback ports): localhost:50051 / localhost:9400 become the test's ports,
build/client/attnctl the built attnctl (pointed at that port), scripts/ this checkout's scripts
(scripts/grpcurl sends its requests with the npm-installed buf), and the build tree's buf is
the one on PATH. Each block must exit 0; the outputs the README describes are checked. The
Quickstart's block (`<!-- e2e: quickstart -->`) is quickstart_test.py's."""
import base64
import os
import re
import struct
import subprocess

import e2e_lib
from e2e_lib import REPO, Attnd, Buf, check, passed

MARKER = "<!-- e2e: run -->"


def readme_blocks():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    blocks = re.findall(re.escape(MARKER) + r"\n```sh\n(.*?)```", text, re.S)
    check(len(blocks) == text.count(MARKER), "a README e2e marker is not followed by a ```sh "
                                             "block")
    return blocks


def test(work_dir):
    args = e2e_lib.parse_args()
    buf = Buf(args.tools)
    blocks = readme_blocks()
    check(len(blocks) >= 3, f"README has {len(blocks)} runnable example blocks, expected >= 3")
    attnd = Attnd(args.attnd, args.attnctl, work_dir, ["--backend=cpu"]).start()

    env = dict(os.environ, ATTND_BUF=buf.binary)
    outputs = []
    for number, block in enumerate(blocks, 1):
        script = (block.replace("localhost:50051", attnd.address)
                  .replace("localhost:9400", f"127.0.0.1:{attnd.metrics_port}")
                  # attnctl's default --server is localhost:50051.
                  .replace("build/client/attnctl", f"{args.attnctl} --server={attnd.address}")
                  .replace("scripts/grpcurl", os.path.join(REPO, "scripts", "grpcurl"))
                  .replace("$PWD/build/e2e-tools", os.path.abspath(args.tools)))
        try:
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env,
                                    capture_output=True, text=True, timeout=240,
                                    stdin=subprocess.DEVNULL, cwd=work_dir)
        except subprocess.TimeoutExpired:
            raise e2e_lib.Failure(f"README example block {number} did not finish in 240 s")
        check(result.returncode == 0,
              f"README example block {number} exited {result.returncode}:\n{block}\n"
              f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
        outputs.append(result.stdout)
        first_line = block.strip().splitlines()[0]
        passed(f"README block {number} ({len(block.strip().splitlines())} lines, "
               f"from `{first_line[:60]}`) ran as written")

    everything = "\n".join(outputs)
    for expected in ("attnd.v1.AttentionService", "grpc.health.v1.Health", '"status": "SERVING"',
                     '"backend": "cpu"'):
        check(expected in everything, f"the README examples' output lacks {expected!r}")

    # The README says: one token attends only to itself, so o is v, as float16, and the step
    # of a one-layer cache commits.
    forward = next((o for o in outputs if '"stepCommitted": true' in o), None)
    check(forward is not None, "no README example output shows a committed step")
    data = re.search(r'"o": \{[^}]*"data": "([^"]+)"', forward, re.S)
    check(data, f"no o data in the Forward output:\n{forward}")
    o = struct.unpack("<64e", base64.b64decode(data.group(1)))
    v = [struct.unpack("<e", struct.pack("<e", round(0.01 * i, 2)))[0] for i in range(64)]
    check(list(o) == v, f"o is not v: {o[:8]}... vs {v[:8]}...")
    passed("the README's Forward returns o == v (float16) and commits, as the README says")
    check(attnd.stop() == 0, "attnd did not exit 0 on SIGTERM")


if __name__ == "__main__":
    e2e_lib.main(test)
