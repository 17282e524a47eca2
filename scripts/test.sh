#!/usr/bin/env bash
# Installs missing packages, builds, and runs every test (unit, integration, e2e; GPU kernel
# tests skip themselves when no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
# The e2e tests need a real Prometheus, npm (for buf), docker-compose and python3-yaml too.
ATTND_E2E_DEPS=1 scripts/install-deps.sh
start=$(date +%s)
scripts/build.sh
echo "test.sh: build took $(( $(date +%s) - start )) s" >&2
build_dir=${ATTND_BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "${ATTND_TEST_JOBS:-$(nproc)}" --timeout 600
echo "test.sh: build and tests took $(( $(date +%s) - start )) s" >&2
