#!/usr/bin/env bash
# The whole GPU regression in one device call, for machines that lack gRPC/Abseil (see the
# brief's device tool). Two halves:
#   scripts/gpu-regression.sh pack   (here: builds with CUDA, bundles every GPU-facing binary with
#                                     its shared libraries into .gpu-pack/bundle.tar.xz, git-ignored)
#   scripts/gpu-regression.sh run    (on the GPU machine: unpacks and runs, most important first,
#                                     each step under its own timeout: every GPU test binary, the
#                                     integration suite against the CUDA backend, the daemon with
#                                     attnctl demo, then the benchmarks (pod_bench, the e2e case of
#                                     attnctl bench), then compute-sanitizer memcheck and racecheck
#                                     on the sanitizer sweeps)
# A device call returns at most 8 files: the summary is printed (and kept as summary.txt), every
# log travels in logs.tgz, repacked after each step so a call cut short still returns it.
# ATTND_GPU_STEPS=tests (no benchmarks, no sanitizers) for a quicker run.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${ATTND_BUILD_DIR:-build}
tests=(cuda_backend_test cuda_backend_pod_test pod_tests prefill_tests kernel_tests mla_tests)
benches=(pod_bench)

case ${1:-} in
  pack)
    scripts/build.sh -DATTND_CUDA=ON >/dev/null || exit 1
    rm -rf .gpu-pack && mkdir -p .gpu-pack
    bins=()
    for t in "${tests[@]}"; do bins+=("$build_dir/tests/kernels/$t"); done
    for b in "${benches[@]}"; do bins+=("$build_dir/bench/$b"); done
    bins+=("$build_dir/tests/integration/integration_tests" "$build_dir/tests/integration/load_tests"
           "$build_dir/server/attnd"
           "$build_dir/client/attnctl")
    /work/shared/tools/gpu-bundle .gpu-pack/bundle "${bins[@]}" || exit 1
    # xz: the kernels' fatbins, linked into several binaries, barely shrink under gzip (73 MB)
    # and a device call carries at most 64 MiB.
    tar -C .gpu-pack -cf - bundle | xz -T"$(nproc)" -6 > .gpu-pack/bundle.tar.xz && rm -rf .gpu-pack/bundle
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-pack' || echo '+dirty')" \
      > .gpu-pack/commit
    ls -la .gpu-pack
    ;;
  run)
    OUT=${OUT:-/tmp/gpu-regression}
    logs=/tmp/gpu-regression-logs
    mkdir -p "$OUT" "$logs"
    tar -C /tmp -xJf .gpu-pack/bundle.tar.xz ||
      python3 -c 'import tarfile; tarfile.open(".gpu-pack/bundle.tar.xz").extractall("/tmp")' ||
      exit 1
    B=/tmp/bundle
    say() { echo "$*" | tee -a "$OUT/summary.txt"; }
    pack_logs() { tar -C "$logs" -czf "$OUT/logs.tgz.tmp" . && mv "$OUT/logs.tgz.tmp" "$OUT/logs.tgz"; }
    failed=0
    # gtest NAME TIMEOUT [ENV=VALUE...] BINARY [ARGS...]: one test binary, its verdict line.
    gtest() {
      local name=$1 limit=$2; shift 2
      local started=$SECONDS
      timeout "$limit" env "$@" > "$logs/$name.log" 2>&1
      local rc=$?
      say "$name: rc=$rc in $((SECONDS - started)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$name.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED  \]' "$logs/$name.log" | head -10 | tee -a "$OUT/summary.txt"
      [[ $rc == 0 ]] || failed=1
      pack_logs
    }
    say "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader)"
    say "commit: $(cat .gpu-pack/commit 2>/dev/null)"

    # 1. Correctness.
    for t in "${tests[@]}"; do gtest "$t" 150 "$B/run" "$t"; done
    gtest integration_cuda 150 ATTND_TEST_BACKEND=cuda "$B/run" integration_tests
    gtest load_cuda 90 ATTND_TEST_BACKEND=cuda "$B/run" load_tests
    "$B/run" attnd --backend=cuda --listen_address=127.0.0.1:50051 --metrics_address=127.0.0.1:9400 \
      > "$logs/attnd.log" 2>&1 &
    daemon=$!
    for _ in $(seq 1 100); do "$B/run" attnctl health > /dev/null 2>&1 && break; sleep 0.2; done
    timeout 60 "$B/run" attnctl demo > "$logs/demo.log" 2>&1; rc=$?
    say "attnctl demo (cuda): rc=$rc $(grep -E '^result' "$logs/demo.log")"
    [[ $rc == 0 ]] || failed=1
    timeout 20 "$B/run" attnctl stats > "$logs/stats.log" 2>&1
    kill -TERM $daemon; wait $daemon; say "attnd exit code after SIGTERM: $?"
    pack_logs
    if [[ ${ATTND_GPU_STEPS:-all} == tests ]]; then exit $failed; fi

    # 2. Benchmarks (each checks its outputs before timing).
    started=$SECONDS
    timeout 150 "$B/run" pod_bench > "$logs/pod_bench.log" 2>&1
    say "pod_bench: rc=$? in $((SECONDS - started)) s"
    tee -a "$OUT/summary.txt" < "$logs/pod_bench.log" | tail -40
    pack_logs
    # The e2e case of PERFORMANCE.md: 128 decode sequences x 32 layers over loopback.
    shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128 --page_size=16
           --prompt_tokens=64 --steps=30 --warmup_steps=3)
    port=50561
    e2e() {  # e2e NAME [ENV=VALUE...] -- BENCH ARGS...: a fresh daemon, one attnctl bench run
      local name=$1; shift
      local envs=()
      while [[ $1 != -- ]]; do envs+=("$1"); shift; done
      shift
      env "${envs[@]}" "$B/run" attnd --backend=cuda --listen_address=127.0.0.1:$port \
        --metrics_address= > "$logs/attnd_$name.log" 2>&1 &
      local pid=$!
      for _ in $(seq 1 100); do
        "$B/run" attnctl --server=127.0.0.1:$port health > /dev/null 2>&1 && break; sleep 0.2
      done
      timeout 60 "$B/run" attnctl --server=127.0.0.1:$port bench "${shape[@]}" "$@" \
        > "$logs/e2e_$name.log" 2>&1
      say "e2e $name $(grep -h '^RESULT' "$logs/e2e_$name.log" || tail -2 "$logs/e2e_$name.log")"
      kill -TERM $pid; wait $pid 2>/dev/null; port=$((port + 1))
      pack_logs
    }
    e2e stream_w1 -- --stream --window=1
    e2e stream_mb2_w4 -- --stream --micro_batches=2 --window=4
    e2e unary_w1 --
    e2e stream_mb2_w2 -- --stream --micro_batches=2 --window=2
    e2e stream_w1_spin ATTND_CUDA_COMPLETION=spin -- --stream --window=1
    e2e stream_w1_mixed512 -- --stream --window=1 --prefill_tokens=512
    e2e stream_w1_mixed512_pod ATTND_POD=on -- --stream --window=1 --prefill_tokens=512

    # 3. compute-sanitizer on the sanitizer sweeps (small shapes).
    for t in pod_tests prefill_tests kernel_tests mla_tests; do
      gtest "memcheck_$t" 150 compute-sanitizer --tool memcheck --error-exitcode 1 "$B/run" "$t" \
        --gtest_filter='*Sanitizer*'
    done
    for t in kernel_tests pod_tests prefill_tests mla_tests; do
      gtest "racecheck_$t" 150 compute-sanitizer --tool racecheck --error-exitcode 1 "$B/run" "$t" \
        --gtest_filter='*Sanitizer*'
    done
    exit $failed
    ;;
  *)
    echo "usage: scripts/gpu-regression.sh pack|run" >&2
    exit 2
    ;;
esac
