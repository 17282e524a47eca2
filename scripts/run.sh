#!/usr/bin/env bash
# Quickstart: installs missing packages, builds, and runs the attnd daemon in the foreground
# with its defaults (the CUDA backend when a GPU is present, the CPU backend otherwise).
# Arguments are passed to attnd, e.g. scripts/run.sh --listen_address=127.0.0.1:50051
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
build_dir=${ATTND_BUILD_DIR:-build}
buf=$build_dir/e2e-tools/node_modules/.bin/buf  # installed by scripts/test.sh
cat >&2 <<TXT
attnd: starting. From another shell:
  $build_dir/client/attnctl info
  $build_dir/client/attnctl demo
  $build_dir/client/attnctl health --service=attnd.v1.AttentionService
  curl -s localhost:9400/metrics | grep ^attnd_
  grpcurl -plaintext localhost:50051 list
  grpcurl -plaintext localhost:50051 describe attnd.v1.AttentionService
  $buf curl --protocol grpc --http2-prior-knowledge --reflect-protocol grpc-v1alpha http://localhost:50051/attnd.v1.AttentionService/GetServerInfo
README.md ("Calling attnd") has CreateCache / Plan / Forward examples with JSON values.
TXT
exec "$build_dir/server/attnd" "$@"
