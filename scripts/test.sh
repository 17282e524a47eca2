#!/usr/bin/env bash
# Installs missing packages, builds, and runs every test (unit, integration, e2e; GPU kernel
# tests skip themselves when no GPU is present); then the unit and integration suites under
# ASan/UBSan and a bounded fuzzing run (see the end).
set -euo pipefail
cd "$(dirname "$0")/.."
# The e2e tests need a real Prometheus, npm (for buf), docker-compose and python3-yaml too.
ATTND_E2E_DEPS=1 scripts/install-deps.sh
start=$(date +%s)
scripts/build.sh
echo "test.sh: build took $(( $(date +%s) - start )) s" >&2
build_dir=${ATTND_BUILD_DIR:-build}
# ctest runs every suite, the Python client's too (label python: tests/python, pytest against
# the built attnd; `ctest -L python` runs them alone).
# Each test is bounded by ctest's --timeout; the whole stage also by `timeout -k` (SIGTERM, then
# SIGKILL 60 s later), so a wedged ctest cannot hold CI's machine past its budget.
timeout -k 60 2400 ctest --test-dir "$build_dir" --output-on-failure \
  -j "${ATTND_TEST_JOBS:-$(nproc)}" --timeout 600
echo "test.sh: build and tests took $(( $(date +%s) - start )) s" >&2

# ---- Sanitizers and fuzzing (tests/fuzz, tests/sanitizers) ------------------------------------
# The unit and integration suites again under AddressSanitizer + UndefinedBehaviorSanitizer
# (the asan preset: CPU only, Debug, in build-asan), then the request-path fuzzer for a bounded
# time (tests/fuzz/run_fuzz.sh: clang, in build-fuzz). Any finding fails. For quicker local
# runs: ATTND_SANITIZERS=0 skips the asan build and tests, ATTND_FUZZ_SECONDS=0 the fuzzing.
if [[ "${ATTND_SANITIZERS:-1}" != 0 ]]; then
  step_start=$(date +%s)
  cmake --preset asan >/dev/null
  cmake --build --preset asan -j "${ATTND_JOBS:-$(nproc)}" --target attnd_cpu_tests
  timeout -k 60 2400 ctest --preset asan -L 'unit|integration' \
    -j "${ATTND_TEST_JOBS:-$(nproc)}" --timeout 900
  echo "test.sh: ASan/UBSan build and unit+integration tests took $(( $(date +%s) - step_start )) s" >&2
fi
if [[ "${ATTND_FUZZ_SECONDS:-90}" != 0 ]]; then
  step_start=$(date +%s)
  ATTND_FUZZ_SECONDS=${ATTND_FUZZ_SECONDS:-90} tests/fuzz/run_fuzz.sh
  echo "test.sh: fuzzing (build and run) took $(( $(date +%s) - step_start )) s" >&2
fi
echo "test.sh: everything took $(( $(date +%s) - start )) s" >&2
