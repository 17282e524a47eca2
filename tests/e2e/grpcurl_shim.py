#!/usr/bin/env python3
"""A stand-in for grpcurl (not packaged by Debian 12) so the README's grpcurl examples run in
the e2e tests: it sends the same request with `buf curl` ($ATTND_E2E_BUF). It understands the
subset the README uses: -plaintext, -d DATA|@, -max-msg-sz, `list [SERVICE]`,
`describe SERVICE` (printed as the service's methods, not grpcurl's proto text) and
`SERVICE/METHOD` calls. Anything else fails loudly rather than pretending."""
import os
import subprocess
import sys

buf = os.environ["ATTND_E2E_BUF"]
common = ["curl", "--protocol", "grpc", "--http2-prior-knowledge",
          "--reflect-protocol", "grpc-v1alpha"]
args, data, positional = sys.argv[1:], None, []
while args:
    arg = args.pop(0)
    if arg == "-plaintext":
        continue
    if arg == "-d":
        data = args.pop(0)
    elif arg == "-max-msg-sz":
        args.pop(0)
    elif arg.startswith("-"):
        sys.exit(f"grpcurl shim: unsupported flag {arg}")
    else:
        positional.append(arg)
if not positional:
    sys.exit("grpcurl shim: no address")
address, rest = positional[0], positional[1:]
base = f"http://{address}"


def buf_curl(*extra, stdin=None):
    result = subprocess.run([buf, *common, *extra], input=stdin, text=True, capture_output=True)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        sys.exit(result.returncode)
    return result.stdout


if rest[:1] == ["list"] or rest[:1] == ["describe"]:
    if len(rest) == 1 and rest[0] == "list":
        buf_curl("--list-services", base)
    elif len(rest) == 2:
        result = subprocess.run([buf, *common, "--list-methods", base], text=True,
                                capture_output=True, check=True)
        methods = [m for m in result.stdout.split() if m.startswith(rest[1] + "/")]
        if not methods:
            sys.exit(f"grpcurl shim: {rest[1]} is not a service the server lists")
        print(f"{rest[1]} is a service:")
        print("\n".join(f"  rpc {m.split('/', 1)[1]}" for m in methods))
    else:
        sys.exit(f"grpcurl shim: unsupported {' '.join(rest)}")
elif len(rest) == 1:
    method = rest[0] if "/" in rest[0] else "/".join(rest[0].rsplit(".", 1))
    extra, stdin = [], None
    if data == "@":
        extra, stdin = ["-d", "@-"], sys.stdin.read()
    elif data is not None:
        extra = ["-d", data]
    buf_curl(*extra, f"{base}/{method}", stdin=stdin)
else:
    sys.exit(f"grpcurl shim: unsupported arguments {positional}")
