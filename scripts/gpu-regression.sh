#!/usr/bin/env bash
# The whole GPU regression in one device call, for machines that lack gRPC/Abseil (see the
# brief's device tool). Two halves:
#   scripts/gpu-regression.sh pack   (here: builds with CUDA, bundles every GPU-facing binary with
#                                     its shared libraries into .gpu-pack/bundle.tar.xz, git-ignored)
#   scripts/gpu-regression.sh run    (on the GPU machine: unpacks and runs, most important first,
#                                     each step bounded (scripts/device_lib.sh): every GPU test
#                                     binary, the integration suite against the CUDA backend, the
#                                     daemon with attnctl demo, then the benchmarks (pod_bench, the
#                                     e2e cases of attnctl bench), then compute-sanitizer memcheck
#                                     and racecheck on the sanitizer sweeps)
# A device call returns at most 8 files: the summary is printed (and kept as summary.txt), every
# log travels in logs.tgz, packed before each step starts and after it ends, so a call cut short
# still returns it and current_step names the step it was in. Every command runs under
# `timeout -k`; daemons get a bounded wait to come up and to exit after SIGTERM (then SIGKILL);
# a step or daemon that overstays has its stacks (cuda-gdb, else gdb, else /proc) dumped into
# stacks_NAME.txt first. No step starts after ATTND_GPU_DEADLINE_S seconds (default 570).
# ATTND_GPU_STEPS: all (default), tests (no benchmarks, no sanitizers), e2e (only the e2e
# cases), stress (tests/bench/stream_stress.sh: ATTND_STRESS_ROUNDS rounds of shutdown and
# cancellation under load).
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
    # gpu-bundle strips every symbol: the daemon and the CLI get theirs back (not the debug
    # info), so that a hang's stack dump names our functions.
    for b in server/attnd client/attnctl; do
      objcopy --strip-debug "$build_dir/$b" ".gpu-pack/bundle/bin/$(basename "$b")" || exit 1
    done
    # xz with a dictionary that spans binaries (device_xz): the kernels' fatbins, linked into
    # several binaries, are stored once; a device call carries at most 64 MiB.
    source scripts/device_pack.sh
    device_xz bundle .gpu-pack/bundle.tar.xz && rm -rf .gpu-pack/bundle
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-pack' || echo '+dirty')" \
      > .gpu-pack/commit
    ls -la .gpu-pack
    ;;
  run)
    OUT=${OUT:-/tmp/gpu-regression}
    logs=/tmp/gpu-regression-logs
    source scripts/device_lib.sh
    # Steps stop starting (and a running one is cut short) ATTND_GPU_DEADLINE_S after the start,
    # so the call ends and returns its logs before the device call's own limit.
    dl_init "$logs" "$OUT" logs.tgz "${ATTND_GPU_DEADLINE_S:-570}"
    trap dl_kill_daemons EXIT
    say() { echo "$*" | tee -a "$OUT/summary.txt"; }
    dl_step unpack
    timeout -k 10 120 tar -C /tmp -xJf .gpu-pack/bundle.tar.xz ||
      timeout -k 10 180 python3 -c 'import tarfile; tarfile.open(".gpu-pack/bundle.tar.xz").extractall("/tmp")' ||
      exit 1
    B=/tmp/bundle
    failed=0
    # gtest NAME TIMEOUT [ENV=VALUE...] BINARY [ARGS...]: one test binary, its verdict line.
    gtest() {
      local name=$1 limit=$2; shift 2
      local started=$SECONDS
      dl_run "$name" "$limit" env "$@"
      local rc=$?
      say "$name: rc=$rc in $((SECONDS - started)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY|RACECHECK SUMMARY|^HUNG|^SKIPPED' "$logs/$name.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED  \]' "$logs/$name.log" | head -10 | tee -a "$OUT/summary.txt"
      [[ $rc == 0 ]] || failed=1
    }
    # The daemon's shutdown bounds: draining waits for open steps up to drain_grace, then
    # in-flight calls get exit_grace; a daemon still there after both (plus a margin) hangs.
    # The script's wait ends before attnd's own watchdog (drain + exit + 10 s = 25 s) would end
    # the process, so that the stacks are taken while it still hangs.
    daemon_flags=(--drain_grace=10s --exit_grace=5s)
    stop_grace=20
    # daemon NAME PORT [ENV=VALUE...]: a fresh attnd on loopback (DL_PID), ready or failed.
    daemon() {
      local name=$1 port=$2; shift 2
      dl_step "$name"
      dl_daemon_start "$name" env "$@" "$B/run" attnd --backend="${ATTND_GPU_BACKEND:-cuda}" \
        --listen_address=127.0.0.1:$port --metrics_address= "${daemon_flags[@]}"
      if dl_daemon_ready "$DL_PID" 60 "$B/run" attnctl --server=127.0.0.1:$port --timeout=3s health; then
        return 0
      fi
      say "$name: attnd did not become ready within 60 s: $(tail -3 "$logs/$name.log" | tr '\n' ' ')"
      dl_daemon_stop "$name" "$DL_PID" 5 > /dev/null
      failed=1
      return 1
    }
    # stop NAME PID: SIGTERM, bounded; a hang is dumped and killed.
    stop() {
      dl_daemon_stop "$1" "$2" "$stop_grace"
      local rc=$?
      say "$1: attnd $DL_STOP"
      [[ $rc == 0 ]] || failed=1
    }
    say "$(timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader)"
    say "commit: $(cat .gpu-pack/commit 2>/dev/null)"
    steps=${ATTND_GPU_STEPS:-all}

    # 1. Correctness.
    if [[ $steps == all || $steps == tests ]]; then
      for t in "${tests[@]}"; do gtest "$t" 150 "$B/run" "$t"; done
      gtest integration_cuda 150 ATTND_TEST_BACKEND=cuda "$B/run" integration_tests
      gtest load_cuda 90 ATTND_TEST_BACKEND=cuda "$B/run" load_tests
      if daemon attnd_demo 50051; then
        pid=$DL_PID
        dl_run demo 60 "$B/run" attnctl demo; rc=$?
        say "attnctl demo (cuda): rc=$rc $(grep -E '^result|^HUNG' "$logs/demo.log")"
        [[ $rc == 0 ]] || failed=1
        dl_run stats 20 "$B/run" attnctl stats
        stop attnd_demo "$pid"
      fi
    fi
    if [[ $steps == tests ]]; then exit $failed; fi

    # 2. Benchmarks (each checks its outputs before timing).
    if [[ $steps == all ]]; then
      started=$SECONDS
      dl_run pod_bench 150 "$B/run" pod_bench
      say "pod_bench: rc=$? in $((SECONDS - started)) s"
      tee -a "$OUT/summary.txt" < "$logs/pod_bench.log" | tail -40
    fi
    # The e2e case of PERFORMANCE.md: 128 decode sequences x 32 layers over loopback.
    shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128 --page_size=16
           --prompt_tokens=64 --steps=30 --warmup_steps=3)
    # A dry run of the script without a GPU: ATTND_GPU_BACKEND=cpu and a CPU-sized shape here.
    [[ -n ${ATTND_E2E_SHAPE:-} ]] && read -r -a shape <<< "$ATTND_E2E_SHAPE"
    port=50561
    e2e() {  # e2e NAME [ENV=VALUE...] -- BENCH ARGS...: a fresh daemon, one attnctl bench run
      local name=$1; shift
      local envs=()
      while [[ $1 != -- ]]; do envs+=("$1"); shift; done
      shift
      [[ $(dl_limit 60) == 0 ]] && { say "e2e $name: SKIPPED (deadline)"; return; }
      if daemon "attnd_$name" "$port" "${envs[@]}"; then
        local pid=$DL_PID
        dl_run "e2e_$name" 60 "$B/run" attnctl --server=127.0.0.1:$port bench "${shape[@]}" "$@"
        local rc=$?
        say "e2e $name rc=$rc $(grep -h '^RESULT\|^HUNG' "$logs/e2e_$name.log" || tail -2 "$logs/e2e_$name.log")"
        [[ $rc == 0 ]] || failed=1
        stop "attnd_$name" "$pid"
      fi
      port=$((port + 1))
    }
    if [[ $steps == all || $steps == e2e ]]; then
      e2e stream_w1 -- --stream --window=1
      e2e stream_mb2_w4 -- --stream --micro_batches=2 --window=4
      e2e unary_w1 --
      e2e stream_mb2_w2 -- --stream --micro_batches=2 --window=2
      e2e stream_w1_spin ATTND_CUDA_COMPLETION=spin -- --stream --window=1
      e2e stream_w1_mixed512 -- --stream --window=1 --prefill_tokens=512
      e2e stream_w1_mixed512_pod ATTND_POD=on -- --stream --window=1 --prefill_tokens=512
    fi
    # Shutdown and cancellation under load, many rounds (issue 18): ATTND_GPU_STEPS=stress,
    # ATTND_STRESS_ROUNDS rounds (default 28: each e2e case under each way of ending).
    if [[ $steps == stress ]]; then
      dl_step stress
      left=$(dl_limit 600)
      ATTND="$B/run attnd" ATTNCTL="$B/run attnctl" \
        ATTND_STRESS_BACKEND="${ATTND_GPU_BACKEND:-cuda}" ATTND_STRESS_SHAPE="${ATTND_STRESS_SHAPE:-gpu}" ATTND_STRESS_LOGS=/tmp/stress-logs ATTND_STRESS_DEADLINE_S=$left \
        OUT="$logs" timeout -k 10 $((left + 30)) tests/bench/stream_stress.sh \
        "${ATTND_STRESS_ROUNDS:-28}" 2>&1 | tee -a "$OUT/summary.txt" | tail -60
      [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
      dl_pack
      exit $failed
    fi
    if [[ $steps != all ]]; then exit $failed; fi

    # 3. compute-sanitizer on the sanitizer sweeps (small shapes).
    for t in pod_tests prefill_tests kernel_tests mla_tests; do
      gtest "memcheck_$t" 150 compute-sanitizer --tool memcheck --error-exitcode 1 "$B/run" "$t" \
        --gtest_filter='*Sanitizer*'
    done
    for t in kernel_tests pod_tests prefill_tests mla_tests; do
      gtest "racecheck_$t" 150 compute-sanitizer --tool racecheck --error-exitcode 1 "$B/run" "$t" \
        --gtest_filter='*Sanitizer*'
    done
    dl_step done
    exit $failed
    ;;
  *)
    echo "usage: scripts/gpu-regression.sh pack|run" >&2
    exit 2
    ;;
esac
