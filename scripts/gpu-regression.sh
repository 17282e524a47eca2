#!/usr/bin/env bash
# The whole GPU regression in one device call, for machines that lack gRPC/Abseil (see the
# brief's device tool). Two halves:
#   scripts/gpu-regression.sh pack   (here: builds with CUDA, bundles every GPU-facing binary with
#                                     its shared libraries into .gpu-pack/bundle.tar.gz, git-ignored)
#   scripts/gpu-regression.sh run    (on the GPU machine: unpacks, runs every kernel test binary,
#                                     the CUDA-vs-CPU backend test, the integration suite against
#                                     the CUDA backend, compute-sanitizer on the sanitizer sweeps,
#                                     and the daemon with attnctl demo; logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${ATTND_BUILD_DIR:-build}
tests=(kernel_tests prefill_tests mla_tests cuda_backend_test)
hosts=(integration_tests attnd attnctl)

case ${1:-} in
  pack)
    scripts/build.sh -DATTND_CUDA=ON >/dev/null || exit 1
    rm -rf .gpu-pack && mkdir -p .gpu-pack
    bins=()
    for t in "${tests[@]}"; do bins+=("$build_dir/tests/kernels/$t"); done
    bins+=("$build_dir/tests/integration/integration_tests" "$build_dir/server/attnd"
           "$build_dir/client/attnctl")
    /work/shared/tools/gpu-bundle .gpu-pack/bundle "${bins[@]}" || exit 1
    tar -C .gpu-pack -czf .gpu-pack/bundle.tar.gz bundle && rm -rf .gpu-pack/bundle
    ls -la .gpu-pack
    ;;
  run)
    OUT=${OUT:-/tmp/gpu-regression}
    mkdir -p "$OUT"
    tar -C /tmp -xzf .gpu-pack/bundle.tar.gz
    B=/tmp/bundle
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
    failed=0
    for t in "${tests[@]}"; do
      timeout 300 "$B/run" "$t" > "$OUT/$t.log" 2>&1
      rc=$?
      echo "$t: rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED  \]' "$OUT/$t.log" | head -10
      [[ $rc == 0 ]] || failed=1
    done
    for t in kernel_tests prefill_tests mla_tests; do
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$B/run" "$t" \
        --gtest_filter='*Sanitizer*' > "$OUT/memcheck_$t.log" 2>&1
      rc=$?
      echo "memcheck $t: rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_$t.log" | tail -1)"
      [[ $rc == 0 ]] || failed=1
    done
    ATTND_TEST_BACKEND=cuda timeout 300 "$B/run" integration_tests > "$OUT/integration_cuda.log" 2>&1
    rc=$?
    echo "integration_tests (cuda): rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/integration_cuda.log" | tr '\n' ' ')"
    [[ $rc == 0 ]] || failed=1
    "$B/run" attnd --backend=cuda --listen_address=127.0.0.1:50051 --metrics_address=127.0.0.1:9400 \
      > "$OUT/attnd.log" 2>&1 &
    daemon=$!
    sleep 3
    "$B/run" attnctl demo > "$OUT/demo.log" 2>&1; rc=$?
    echo "attnctl demo (cuda): rc=$rc $(grep -E '^result' "$OUT/demo.log")"
    [[ $rc == 0 ]] || failed=1
    "$B/run" attnctl stats | tee "$OUT/stats.log"
    kill -TERM $daemon; wait $daemon; echo "attnd exit code after SIGTERM: $?"
    exit $failed
    ;;
  *)
    echo "usage: scripts/gpu-regression.sh pack|run" >&2
    exit 2
    ;;
esac
