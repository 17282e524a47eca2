#!/usr/bin/env bash
# Regenerates the checked-in stubs attnd/v1/attnd_pb2.py and attnd_pb2_grpc.py from
# proto/attnd/v1/attnd.proto with Debian 12's protoc (3.21) and grpc_python_plugin
# (protobuf-compiler-grpc). Run it after changing the proto; tests/python/test_stubs_current.py
# fails while the checked-in stubs differ from what this writes.
#   client/python/generate_stubs.sh [OUTPUT_ROOT]   (default: client/python)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$here}"
plugin="${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin || echo /usr/bin/grpc_python_plugin)}"
mkdir -p "$out/attnd/v1"
protoc -I "$repo/proto" --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$plugin" attnd/v1/attnd.proto
