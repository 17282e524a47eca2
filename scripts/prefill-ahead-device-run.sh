#!/usr/bin/env bash
# The Hopper prefill's producer reading works ahead (BatchPrefillArgs::prefetch_works, off by
# default until measured) in one device call: prefill_tests first (every case, among them
# BatchPrefillHopperTest.ProducerReadingWorksAheadKeepsTheBits), prefill_bench --kernel=mma on
# the short prompts, then prefill_bench without and with --prefetch_works, alternated twice, on
# short prompts (one- and two-tile works, where a work's fixed cost dominates) and the long
# cases of issue 14's table. Two halves:
#   scripts/prefill-ahead-device-run.sh pack   (here: builds prefill_tests and prefill_bench and
#                                               bundles them into .gpu-pack/prefill_ahead.tar.xz;
#                                               cuBLAS left out)
#   scripts/prefill-ahead-device-run.sh run    (on the device, carrying .gpu-pack; logs under
#                                               $OUT, the summary in $OUT/summary.txt)
# Every step runs under `timeout -k`; there is no daemon.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${ATTND_BUILD_DIR:-build}
cases=${PREFILL_AHEAD_CASES:-c128x64,c64x128,c32x256,c16x512,c8x1024,n32x256,c1x512,c8x2048,c1x8192,n1x8192}

case ${1:-} in
  pack)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" --target prefill_tests prefill_bench >/dev/null ||
      exit 1
    source scripts/device_pack.sh
    device_pack prefill_ahead "$build_dir/tests/kernels/prefill_tests" "$build_dir/bench/prefill_bench" || exit 1
    ;;
  run)
    OUT=${OUT:-/tmp/prefill-ahead-out}
    mkdir -p "$OUT"
    S=$OUT/summary.txt
    source scripts/device_pack.sh
    device_unpack prefill_ahead "$S" || exit 1
    B=/tmp/prefill_ahead
    echo "== prefill_tests" | tee -a "$S"
    timeout -k 10 240 "$B/run" prefill_tests > "$OUT/prefill_tests.log" 2>&1
    echo "prefill_tests rc=$?" | tee -a "$S"
    grep -E '^\[  (PASSED|FAILED)|FAILED  \]|SKIPPED \] [0-9]' "$OUT/prefill_tests.log" | head -20 | tee -a "$S"
    # The mma.sync kernel on the short prompts (several CTAs an SM, where the Hopper kernel has
    # one): whether the planner should pick it there.
    echo "== prefill_bench --kernel=mma, short prompts" | tee -a "$S"
    timeout -k 10 120 "$B/run" prefill_bench --kernel=mma --cases=c128x64,c64x128,c32x256,c16x512,n32x256 \
      > "$OUT/bench_mma.log" 2>&1
    echo "prefill_bench mma rc=$?" | tee -a "$S"
    grep -E 'causal|FAIL|mismatch|error' "$OUT/bench_mma.log" | tee -a "$S"
    for run in 1 2; do
      for mode in plain ahead; do
        flag=()
        [[ $mode == ahead ]] && flag=(--prefetch_works)
        echo "== prefill_bench $mode (run $run)" | tee -a "$S"
        timeout -k 10 120 "$B/run" prefill_bench --cases="$cases" "${flag[@]}" \
          > "$OUT/bench_${mode}_$run.log" 2>&1
        echo "prefill_bench $mode rc=$?" | tee -a "$S"
        grep -E 'causal|FAIL|mismatch|error' "$OUT/bench_${mode}_$run.log" | tee -a "$S"
      done
    done
    ;;
  *)
    echo "usage: $0 pack | run" >&2
    exit 2
    ;;
esac
