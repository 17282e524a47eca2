#!/usr/bin/env bash
# Channels (DESIGN 3b) on the GPU machine in one device call, every step bounded:
#   scripts/channel-device-run.sh pack   (here: builds with CUDA, bundles the binaries into
#                                         .gpu-pack/channels.tar.xz, git-ignored)
#   scripts/channel-device-run.sh run [tests|bench|sanitize|all|python]
#        on the device: channel_tests and the integration suite against the CUDA backend
#        (HOST_SHM through registered memory, CUDA_IPC with the client in a second process,
#        bitwise against Forward), cuda_backend_test, then the e2e shape of PERFORMANCE.md over
#        gRPC (stream), HOST_SHM and CUDA_IPC against one fresh daemon each, then
#        compute-sanitizer memcheck on the channel tests.
# Logs land in $OUT/logs.tgz, repacked before every step (a call cut short still returns them);
# the summary is printed and kept in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${ATTND_BUILD_DIR:-build}

case ${1:-} in
  pack)
    targets=(attnd attnctl channel_tests channel_test_client integration_tests cuda_backend_test
             prefill_tests)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" --target "${targets[@]}" >/dev/null ||
      exit 1
    rm -rf .gpu-pack/channels && mkdir -p .gpu-pack
    /work/shared/tools/gpu-bundle .gpu-pack/channels \
      "$build_dir/server/attnd" "$build_dir/client/attnctl" \
      "$build_dir/tests/integration/channel_tests" \
      "$build_dir/tests/integration/channel_test_client" \
      "$build_dir/tests/integration/integration_tests" \
      "$build_dir/tests/kernels/cuda_backend_test" \
      "$build_dir/tests/kernels/prefill_tests" || exit 1
    tar -C .gpu-pack -cf - channels | xz -T"$(nproc)" -6 > .gpu-pack/channels.tar.xz
    rm -rf .gpu-pack/channels
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-pack' || echo '+dirty')" \
      > .gpu-pack/channels.commit
    ls -la .gpu-pack
    ;;
  run)
    what=${2:-all}
    OUT=${OUT:-/tmp/channel-run}
    logs=/tmp/channel-logs
    mkdir -p "$OUT" "$logs"
    rm -rf /tmp/channels
    timeout -k 5 120 tar -C /tmp -xJf .gpu-pack/channels.tar.xz ||
      timeout -k 5 120 python3 -c \
        'import tarfile; tarfile.open(".gpu-pack/channels.tar.xz").extractall("/tmp")' || exit 1
    B=/tmp/channels
    say() { echo "$*" | tee -a "$OUT/summary.txt"; }
    pack_logs() { tar -C "$logs" -czf "$OUT/logs.tgz.tmp" . 2>/dev/null && mv "$OUT/logs.tgz.tmp" "$OUT/logs.tgz"; }
    say "commit $(cat .gpu-pack/channels.commit) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    # The channel test's client child must find the bundled binary next to the test's own path.
    # Stacks of whatever is still running when a step times out (bounded).
    gdb=$(command -v cuda-gdb || echo /usr/local/cuda/bin/cuda-gdb)
    dump_stacks() {
      local pattern=$1
      for pid in $(pgrep -f "$pattern"); do
        { echo "== $pid: $(tr '\0' ' ' < /proc/$pid/cmdline)"
          grep -E '^(State|Threads)' /proc/$pid/status
          timeout -k 2 60 "$gdb" -batch -p "$pid" -ex 'info cuda kernels' \
            -ex 'thread apply all bt 12' 2>&1 | grep -v '^\[New Thread' | tail -400
        } >> "$logs/stacks.log" 2>&1
      done
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$logs/stacks.log" 2>&1
    }
    # gtest NAME LIMIT [ENV=VALUE...] PROGRAM [ARGS...]
    gtest() {
      local name=$1 limit=$2; shift 2
      pack_logs
      local started=$SECONDS
      timeout -k 10 "$limit" env "$@" > "$logs/$name.log" 2>&1
      local rc=$?
      [[ $rc == 124 || $rc == 137 ]] && dump_stacks "$B/bin"
      say "$name: rc=$rc in $((SECONDS - started)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY' "$logs/$name.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED  \]' "$logs/$name.log" | head -10 | tee -a "$OUT/summary.txt"
      pack_logs
    }
    # The channel tests start their client child from the bundle.
    export ATTND_CHANNEL_TEST_CLIENT="$B/run channel_test_client"
    if [[ $what == all || $what == tests ]]; then
      gtest channel_tests 180 ATTND_TEST_BACKEND=cuda "$B/run" channel_tests
      gtest integration_cuda 300 ATTND_TEST_BACKEND=cuda "$B/run" integration_tests
      gtest cuda_backend_test 300 "$B/run" cuda_backend_test
      gtest prefill_tests 240 "$B/run" prefill_tests
    fi
    if [[ $what == all || $what == bench ]]; then
      shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128
             --page_size=16 --prompt_tokens=64 --steps=${ATTND_BENCH_STEPS:-50} --warmup_steps=3)
      port=50761
      e2e() {  # e2e NAME BENCH ARGS...: a fresh daemon, one attnctl bench run, bounded
        local name=$1; shift
        pack_logs
        setsid "$B/run" attnd --backend=cuda --listen_address=127.0.0.1:$port \
          --metrics_address= --exit_grace=2s --drain_grace=2s > "$logs/attnd_$name.log" 2>&1 &
        local pid=$!
        local up=0
        for _ in $(seq 1 150); do
          if timeout -k 2 5 "$B/run" attnctl --server=127.0.0.1:$port health > /dev/null 2>&1; then
            up=1; break
          fi
          sleep 0.2
        done
        if [[ $up == 1 ]]; then
          timeout -k 5 "${ATTND_E2E_LIMIT:-90}" "$B/run" attnctl --server=127.0.0.1:$port bench \
            "${shape[@]}" "$@" > "$logs/e2e_$name.log" 2>&1 &
          local bench=$!
          # Stacks while it still hangs, before the timeout kills it.
          ( sleep $(( ${ATTND_E2E_LIMIT:-90} - 20 )); kill -0 $bench 2>/dev/null && dump_stacks "$B/bin" ) &
          local watcher=$!
          wait $bench
          local rc=$?
          kill $watcher 2>/dev/null; wait $watcher 2>/dev/null
          say "e2e $name rc=$rc $(grep -h '^RESULT' "$logs/e2e_$name.log" || tail -3 "$logs/e2e_$name.log")"
          grep -E '^  ' "$logs/e2e_$name.log" | tee -a "$OUT/summary.txt" >/dev/null
        else
          say "e2e $name: attnd did not come up"
        fi
        kill -TERM $pid 2>/dev/null
        for _ in $(seq 1 50); do kill -0 $pid 2>/dev/null || break; sleep 0.2; done
        if kill -0 $pid 2>/dev/null; then
          say "e2e $name: attnd still running 10 s after SIGTERM; stacks saved, killed"
          dump_stacks "$B/bin/attnd"
          kill -KILL $pid 2>/dev/null
        fi
        wait $pid 2>/dev/null
        port=$((port + 1))
        pack_logs
      }
      for case in ${ATTND_E2E_CASES:-grpc_stream shm cuda_ipc cuda_ipc_mps}; do
        case $case in
          grpc_stream) e2e grpc_stream --stream --window=1 ;;
          shm) e2e shm --transport=shm ;;
          cuda_ipc) e2e cuda_ipc --transport=cuda_ipc ;;
          cuda_ipc_mps|cuda_ipc_mps_mb2|cuda_ipc_mps_mb4)
            if command -v nvidia-cuda-mps-control >/dev/null; then
              export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
              mkdir -p /tmp/mps-pipe /tmp/mps-log
              timeout -k 2 10 nvidia-cuda-mps-control -d
              mb=1
              [[ $case == *_mb2 ]] && mb=2
              [[ $case == *_mb4 ]] && mb=4
              e2e "$case" --transport=cuda_ipc --micro_batches=$mb
              echo quit | timeout -k 2 10 nvidia-cuda-mps-control
              unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
            else
              say "e2e cuda_ipc_mps: no nvidia-cuda-mps-control"
            fi ;;
        esac
      done
    fi
    if [[ $what == python ]]; then
      # The Python client's transformers examples (issue 13) against the CUDA backend, over
      # gRPC and CUDA_IPC (under MPS, as the README recommends for CUDA_IPC on one GPU).
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p /tmp/mps-pipe /tmp/mps-log
      timeout -k 2 10 nvidia-cuda-mps-control -d
      port=50791
      setsid "$B/run" attnd --backend=cuda --listen_address=127.0.0.1:$port --metrics_address= \
        --exit_grace=2s --drain_grace=2s > "$logs/attnd_python.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 150); do
        timeout -k 2 5 "$B/run" attnctl --server=127.0.0.1:$port health >/dev/null 2>&1 && break
        sleep 0.2
      done
      say "python: $(python3 -c 'import google.protobuf, grpc, torch, transformers; print("protobuf", google.protobuf.__version__, "grpcio", grpc.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"
      export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1
      for example in ${ATTND_PY_EXAMPLES:-llama:grpc llama:cuda_ipc deepseek:grpc deepseek:cuda_ipc llama:stream}; do
        model=${example%%:*}; transport=${example##*:}
        script=client/python/examples/llama_transformers.py
        [[ $model == deepseek ]] && script=client/python/examples/deepseek_mla_transformers.py
        pack_logs
        timeout -k 5 150 python3 "$script" --target 127.0.0.1:$port --transport "$transport" \
          > "$logs/py_${model}_${transport}.log" 2>&1
        say "python $model $transport rc=$? $(grep -E 'PASS|FAIL|tokens/s' "$logs/py_${model}_${transport}.log" | tail -3 | tr '\n' ' ')"
        tail -5 "$logs/py_${model}_${transport}.log" >> "$OUT/summary.txt"
      done
      kill -TERM $pid 2>/dev/null
      for _ in $(seq 1 50); do kill -0 $pid 2>/dev/null || break; sleep 0.2; done
      kill -KILL $pid 2>/dev/null
      # The package's CUDA_IPC tests (tests/python/test_cuda_ipc.py) against a CUDA attnd.
      if [[ ${ATTND_PY_PYTEST:-1} == 1 ]]; then
        pack_logs
        LD_LIBRARY_PATH=$B/lib timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider \
          tests/python/test_cuda_ipc.py --attnd "$B/bin/attnd" --backend cuda \
          > "$logs/pytest_cuda_ipc.log" 2>&1
        say "pytest test_cuda_ipc.py rc=$? $(tail -1 "$logs/pytest_cuda_ipc.log")"
      fi
      echo quit | timeout -k 2 10 nvidia-cuda-mps-control
    fi
    if [[ $what == all || $what == sanitize ]]; then
      if command -v compute-sanitizer >/dev/null || [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
        cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
        gtest memcheck_channels 300 ATTND_TEST_BACKEND=cuda LD_LIBRARY_PATH=$B/lib "$cs" \
          --tool memcheck --target-processes all --error-exitcode 3 "$B/bin/channel_tests" \
          --gtest_filter='*HostShm*:*CudaIpc*:*UseChannel*'
      else
        say "compute-sanitizer not found"
      fi
    fi
    pack_logs
    ;;
  *)
    echo "usage: $0 pack | run [tests|bench|sanitize|all|python]" >&2
    exit 2
    ;;
esac
