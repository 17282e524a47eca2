#!/usr/bin/env bash
# Quickstart: installs missing packages, builds attnd and attnctl (only those: the tests and
# benchmarks are scripts/test.sh's), installs buf for scripts/grpcurl, and runs the attnd
# daemon in the foreground with its defaults (the CUDA backend when a GPU is present, the CPU
# backend otherwise). Arguments are passed to attnd, e.g.
# scripts/run.sh --listen_address=127.0.0.1:50051
set -euo pipefail
cd "$(dirname "$0")/.."
ATTND_CLIENT_DEPS=1 scripts/install-deps.sh
ATTND_BUILD_TARGETS="attnd attnctl" scripts/build.sh
build_dir=${ATTND_BUILD_DIR:-build}
# The reflection client (grpcurl is not packaged by Debian 12): buf from npm, the pinned version
# scripts/test.sh's e2e tests use, in the same place. attnd starts without it.
if ! tests/e2e/setup-tools.sh "$build_dir/e2e-tools" >/dev/null; then
  echo "run.sh: WARNING: could not install buf; scripts/grpcurl will not work" >&2
fi
cat >&2 <<TXT
attnd: starting. From another shell:
  $build_dir/client/attnctl info
  $build_dir/client/attnctl demo
  $build_dir/client/attnctl health --service=attnd.v1.AttentionService
  curl -s localhost:9400/metrics | grep ^attnd_kernel_duration_seconds_count
  scripts/grpcurl -plaintext localhost:50051 list
  scripts/grpcurl -plaintext localhost:50051 describe attnd.v1.AttentionService
  $build_dir/e2e-tools/node_modules/.bin/buf curl --protocol grpc --http2-prior-knowledge --reflect-protocol grpc-v1alpha http://localhost:50051/attnd.v1.AttentionService/GetServerInfo
README.md ("Calling attnd") has CreateCache / Plan / Forward examples with JSON values.
TXT
exec "$build_dir/server/attnd" "$@"
