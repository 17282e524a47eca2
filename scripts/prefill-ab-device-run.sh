#!/usr/bin/env bash
# A/B of two Hopper prefill builds in one device call: prefill_tests of the new build first, then
# prefill_bench of the base build and of the new one, alternated twice (base new new base), on
# short prompts (one- and two-tile works, where a work's fixed cost dominates) and the long cases
# of issue 14's table. Every case is checked against the float64 reference before it is timed.
# Two halves:
#   ATTND_AB_BASE=/path/to/base/prefill_bench scripts/prefill-ab-device-run.sh pack
#       (here: builds prefill_tests and prefill_bench of this tree in ${ATTND_BUILD_DIR:-build}
#       and bundles them with the base binary into .gpu-pack/prefill_ab.tar.xz; cuBLAS left out)
#   scripts/prefill-ab-device-run.sh run
#       (on the device, carrying .gpu-pack; logs under $OUT, the summary in $OUT/summary.txt)
# PREFILL_AB_CASES replaces the case list. Every step runs under `timeout -k`; there is no daemon.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${ATTND_BUILD_DIR:-build}
cases=${PREFILL_AB_CASES:-c128x64,c64x128,c32x256,c16x512,n32x256,c1x512,c8x2048,c1x8192,n1x8192}

case ${1:-} in
  pack)
    if [[ ! -x ${ATTND_AB_BASE:-} ]]; then
      echo "$0 pack: ATTND_AB_BASE must name the base build's prefill_bench" >&2
      exit 2
    fi
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" --target prefill_tests prefill_bench >/dev/null ||
      exit 1
    staging=$(mktemp -d) || exit 1
    cp "$ATTND_AB_BASE" "$staging/base_prefill_bench" &&
      cp "$build_dir/bench/prefill_bench" "$staging/new_prefill_bench" &&
      cp "$build_dir/tests/kernels/prefill_tests" "$staging/prefill_tests" || exit 1
    source scripts/device_pack.sh
    device_pack prefill_ab "$staging/prefill_tests" "$staging/base_prefill_bench" "$staging/new_prefill_bench"
    status=$?
    rm -rf "$staging"
    exit $status
    ;;
  run)
    OUT=${OUT:-/tmp/prefill-ab-out}
    mkdir -p "$OUT"
    S=$OUT/summary.txt
    source scripts/device_pack.sh
    device_unpack prefill_ab "$S" || exit 1
    B=/tmp/prefill_ab
    echo "== prefill_tests (new build)" | tee -a "$S"
    timeout -k 10 240 "$B/run" prefill_tests > "$OUT/prefill_tests.log" 2>&1
    echo "prefill_tests rc=$?" | tee -a "$S"
    grep -E '^\[  (PASSED|FAILED)|FAILED  \]|SKIPPED \] [0-9]' "$OUT/prefill_tests.log" | head -20 | tee -a "$S"
    run=0
    for build in base new new base; do
      run=$((run + 1))
      echo "== prefill_bench $build (run $run)" | tee -a "$S"
      timeout -k 10 120 "$B/run" ${build}_prefill_bench --cases="$cases" > "$OUT/bench_${run}_$build.log" 2>&1
      echo "prefill_bench $build rc=$?" | tee -a "$S"
      grep -E '^(causal|noncausal) |FAIL|mismatch|error' "$OUT/bench_${run}_$build.log" | tee -a "$S"
    done
    ;;
  *)
    echo "usage: ATTND_AB_BASE=BENCH $0 pack | $0 run" >&2
    exit 2
    ;;
esac
