#!/usr/bin/env python3
"""Runs the README's Quickstart in order on the built tree, so it cannot drift: its first block
(`scripts/run.sh`, then `scripts/test.sh`, which is what runs this test and so is only checked
to be there), then every line of the block marked `<!-- e2e: quickstart -->` from "another
shell", as written. run.sh gets this build tree (ATTND_BUILD_DIR) and, as the README allows,
extra attnd arguments: loopback ports picked at run time and --backend=cpu. In the lines,
localhost:50051 / localhost:9400 become those ports and build/client/attnctl this build's
attnctl pointed at them. Cheap: run.sh finds everything installed and built, so it only checks
and starts attnd; `attnctl demo` is the longest line (seconds)."""
import os
import re
import shlex

import e2e_lib
from e2e_lib import REPO, Buf, check, free_port, passed, run, spawn, stop, tail, wait_until

MARKER = "<!-- e2e: quickstart -->"


def quickstart_section():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    match = re.search(r"^## Quickstart\n(.*?)^## ", text, re.S | re.M)
    check(match, "README.md has no '## Quickstart' section")
    return match.group(1)


def command_lines(block):
    """The block's commands: comments dropped, backslash continuations joined."""
    lines, pending = [], ""
    for line in block.splitlines():
        line = pending + line
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        pending = ""
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command and not command.startswith("#"):
            lines.append(command)
    return lines


def test(work_dir):
    args = e2e_lib.parse_args()
    Buf(args.tools)  # run.sh installs buf itself; here it must already be there (fixture)
    build_dir = os.path.abspath(args.build_dir)
    section = quickstart_section()
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    check(len(blocks) == 2, f"the Quickstart has {len(blocks)} sh blocks, expected 2 (the two "
                            "commands, then the lines to run from another shell)")
    check(section.count(MARKER) == 1 and section.index(MARKER) < section.index(blocks[1]),
          f"the Quickstart's second block is not marked {MARKER}")
    first, second = command_lines(blocks[0]), command_lines(blocks[1])
    check(first == ["scripts/run.sh", "scripts/test.sh"],
          f"the Quickstart's commands are {first}, expected scripts/run.sh then scripts/test.sh")

    # 1. scripts/run.sh, in the foreground as the README says, on ports of our own.
    grpc_port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{grpc_port}"
    env = dict(os.environ, ATTND_BUILD_DIR=build_dir)
    log = os.path.join(work_dir, "run.sh.log")
    process = spawn([os.path.join(REPO, "scripts", "run.sh"), "--backend=cpu",
                     f"--listen_address={address}",
                     f"--metrics_address=127.0.0.1:{metrics_port}"], log, env=env)

    def serving():
        if process.poll() is not None:
            raise e2e_lib.Failure(f"scripts/run.sh exited {process.returncode}:\n{tail(log)}")
        e2e_lib.http_get(f"http://127.0.0.1:{metrics_port}/metrics")
        return True

    # run.sh checks packages and the build first (both done here): allow for a loaded machine.
    wait_until(serving, 180, "scripts/run.sh to serve")
    rebuilt = "ninja: no work to do" not in tail(log, 200)
    passed("scripts/run.sh serves" + (" (it first rebuilt attnd/attnctl: a stale tree)"
                                      if rebuilt else " (nothing left to install or build)"))
    check("scripts/grpcurl" in tail(log, 20), f"run.sh's banner does not mention scripts/grpcurl:\n"
                                              f"{tail(log, 20)}")
    # 2. scripts/test.sh is the command running this test: not run again.

    # 3. The lines from another shell, in order.
    outputs = []
    for number, line in enumerate(second, 1):
        command = (line.replace("localhost:50051", address)
                   .replace("localhost:9400", f"127.0.0.1:{metrics_port}")
                   .replace("build/client/attnctl", f"{build_dir}/client/attnctl --server={address}"))
        # From the checkout's root, as the README's relative paths assume.
        result = run(["bash", "-euo", "pipefail", "-c", f"cd {shlex.quote(REPO)}\n{command}"],
                     timeout_seconds=240,
                     check_exit=False, env=env)
        check(result.returncode == 0,
              f"Quickstart line {number} exited {result.returncode}: {line}\n"
              f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
        outputs.append(result.stdout)
        passed(f"Quickstart line {number} ran as written: {line[:70]}")

    # What the README's comments promise of them.
    everything = "\n".join(outputs)
    check("cpu" in outputs[0], f"attnctl info does not name the backend:\n{outputs[0]}")
    counts = re.findall(r"^attnd_kernel_duration_seconds_count\{[^}]*\} (\S+)$", everything, re.M)
    check(counts and sum(float(c) for c in counts) > 0,
          f"the metrics line shows no kernel launches after the demo:\n{everything[-2000:]}")
    check("attnd.v1.AttentionService" in everything and "grpc.health.v1.Health" in everything,
          "scripts/grpcurl list did not list the services")
    passed("the demo moved the kernel counts and scripts/grpcurl lists the services")

    # `attnctl --help` (README, "Calling attnd") answers with exit 0, without source paths.
    help_text = run([f"{build_dir}/client/attnctl", "--help"]).stdout
    check("Flags from" not in help_text and "--server" in help_text and "bench:" in help_text,
          f"attnctl --help reads oddly:\n{help_text[:1500]}")
    passed("attnctl --help exits 0 and lists the flags by command")

    check(stop(process, 30) == 0, f"attnd (exec'd by run.sh) did not exit 0 on SIGTERM:\n{tail(log)}")


if __name__ == "__main__":
    e2e_lib.main(test)
