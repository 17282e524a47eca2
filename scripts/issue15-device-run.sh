#!/usr/bin/env bash
# Issue 15's measurements in one device call: the MLA decode kernel (the uniform cases FlashInfer
# was measured on, then the mixed sweep with the planner's schemes; the fp8 latent; the uniform
# cases again with --warm_ms), compute-sanitizer on the small MLA sweep (ATTND_SANITIZE=0 skips
# it) and the fused RoPE + append kernel, each after its tests on the same device. Two halves:
#   scripts/issue15-device-run.sh pack   (here: builds mla_tests, kernel_tests, mla_bench and
#                                         attnd_bench and bundles them into .gpu-pack/issue15.tar.xz)
#   scripts/issue15-device-run.sh run    (on the device, carrying .gpu-pack/issue15.tar.xz and
#                                         .gpu-pack/issue15.commit; logs under $OUT)
# The card's power and SM clock are sampled through the run (scripts/device_clocks.sh,
# $OUT/dmon.log, summarised at the end). Every step runs under `timeout -k`; there is no daemon.
# Every benchmark case is checked against the float64 CPU reference before it is timed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${ATTND_BUILD_DIR:-build}

case ${1:-} in
  pack)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" \
      --target mla_tests kernel_tests mla_bench attnd_bench >/dev/null || exit 1
    source scripts/device_pack.sh
    device_pack issue15 "$build_dir/tests/kernels/mla_tests" "$build_dir/tests/kernels/kernel_tests" \
      "$build_dir/bench/mla_bench" "$build_dir/bench/attnd_bench" || exit 1
    ;;
  run)
    OUT=${OUT:-/tmp/issue15-out}
    mkdir -p "$OUT"
    say() { echo "$*" | tee -a "$OUT/summary.txt"; }
    source scripts/device_pack.sh
    device_unpack issue15 "$OUT/summary.txt" || exit 1
    B=/tmp/issue15
    source scripts/device_clocks.sh
    clocks_start "$OUT/dmon.log"
    failed=0
    # step NAME LIMIT_S PROGRAM ARGS...: one bundled program, its log in $OUT/NAME.log.
    step() {
      local name=$1 limit=$2; shift 2
      timeout -k 10 "$limit" "$B/run" "$@" > "$OUT/$name.log" 2>&1
      local rc=$?
      say "$name rc=$rc"
      [[ $rc == 0 ]] || failed=1
    }
    step mla_tests 300 mla_tests
    grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]' "$OUT/mla_tests.log" | tee -a "$OUT/summary.txt"
    step append_tests 200 kernel_tests --gtest_filter='*Append*'
    grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]' "$OUT/append_tests.log" | tee -a "$OUT/summary.txt"
    say "== MLA decode, uniform (FlashInfer's Hopper kernel: 64 x 8192 in 0.279 ms on an H100)"
    step mla_uniform 200 mla_bench --cases=uniform --uniform=16,64,128
    grep -E 'copy|uniform' "$OUT/mla_uniform.log" | tail -20 | tee -a "$OUT/summary.txt"
    say "== MLA decode, mixed sweep with the planner's schemes"
    step mla_mixed 300 mla_bench --variants --cases=mixed --csv="$OUT/mla_mixed.csv"
    tail -25 "$OUT/mla_mixed.log" | tee -a "$OUT/summary.txt"
    say "== MLA decode, fp8 e4m3 latent (auto: the wide-tile kernel; *_mma: the mma.sync kernel)"
    step mla_fp8 300 mla_bench --kv_dtype=fp8 --variants --cases=uniform,mixed --uniform=64,128 --batches=64 \
      --csv="$OUT/mla_fp8.csv"
    grep -E '^  (nosplit|onewave|oversub|auto|onewave_mma|oversub_mma) ' "$OUT/mla_fp8.log" | tee -a "$OUT/summary.txt"
    say "== MLA decode, uniform again with --warm_ms=${ATTND_WARM_MS:-300} (every case after the same warm-up)"
    step mla_uniform_warm 200 mla_bench --cases=uniform --uniform=64,128 --warm_ms="${ATTND_WARM_MS:-300}"
    grep -E '^  (nosplit|onewave|oversub|auto) ' "$OUT/mla_uniform_warm.log" | tee -a "$OUT/summary.txt"
    if [[ ${ATTND_SANITIZE:-1} == 1 ]] && command -v compute-sanitizer >/dev/null; then
      say "== compute-sanitizer on the small MLA sweep (memcheck; racecheck on the fp8 wide-tile case)"
      sanitize() {
        local name=$1; shift
        timeout -k 10 300 env LD_LIBRARY_PATH="$B/lib" compute-sanitizer "$@" > "$OUT/$name.log" 2>&1
        say "$name rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$name.log" | tail -1)"
      }
      sanitize memcheck --tool memcheck --error-exitcode 1 "$B/bin/mla_tests" --gtest_filter='Sanitizer*'
      sanitize racecheck_fp8 --tool racecheck "$B/bin/mla_tests" --gtest_filter='Sanitizer*kvfp8*wide'
    fi
    say "== append (bar: >= 80% of copy at 4096 tokens, f16 -> fp8 and bf16), twice"
    for i in 1 2; do
      step "append_$i" 120 attnd_bench --append --variants
      grep -E '^append|copy bandwidth' "$OUT/append_$i.log" | tee -a "$OUT/summary.txt"
    done
    clocks_stop
    say "$(clocks_summary "$OUT/dmon.log")"
    exit "$failed"
    ;;
  *)
    echo "usage: $0 pack | run" >&2
    exit 2
    ;;
esac
