#!/usr/bin/env bash
# Quickstart: installs missing packages, builds, and runs the attnd daemon in the foreground
# with its defaults (the CUDA backend when a GPU is present, the CPU backend otherwise).
# Arguments are passed to attnd, e.g. scripts/run.sh --listen_address=127.0.0.1:50051
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
build_dir=${ATTND_BUILD_DIR:-build}
cat >&2 <<TXT
attnd: starting. From another shell:
  $build_dir/client/attnctl info
  $build_dir/client/attnctl demo
  curl -s localhost:9400/metrics | grep ^attnd_
TXT
exec "$build_dir/server/attnd" "$@"
