#!/usr/bin/env bash
# Channels (DESIGN 3b) on the GPU machine in one device call, every step bounded:
#   scripts/channel-device-run.sh pack   (here: builds with CUDA, bundles the binaries into
#                                         .gpu-pack/channels.tar.xz, git-ignored; more
#                                         binaries by path in ATTND_PACK_EXTRA)
#   scripts/channel-device-run.sh run [tests|bench|sanitize|all|python]
#        on the device: channel_tests and the integration suite against the CUDA backend
#        (HOST_SHM through registered memory, CUDA_IPC with the client in a second process,
#        bitwise against Forward), cuda_backend_test, prefill_tests, cuda_lifecycle_test (fork,
#        copy-on-write, export/import on the GPU), then the e2e shape of PERFORMANCE.md over
#        gRPC (stream), HOST_SHM and CUDA_IPC against one fresh daemon each, then
#        compute-sanitizer memcheck on the channel tests.
# Logs land in $OUT/logs.tgz, repacked before every step (a call cut short still returns them);
# the summary is printed and kept in $OUT/summary.txt. Steps are bounded by scripts/device_lib.sh
# (no step starts after ATTND_GPU_DEADLINE_S, default 570 s). ATTND_DEVICE_BACKEND=cpu dry-runs
# the script without a GPU (the HOST_SHM and gRPC cases). The e2e cases run ATTND_ATTNCTL
# (default attnctl; another bundled binary, to compare builds) with ATTND_E2E_ARGS appended.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${ATTND_BUILD_DIR:-build}

case ${1:-} in
  pack)
    targets=(attnd attnctl channel_tests channel_test_client integration_tests cuda_backend_test
             prefill_tests cuda_lifecycle_test handoff_probe)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" --target "${targets[@]}" >/dev/null ||
      exit 1
    rm -rf .gpu-pack/channels && mkdir -p .gpu-pack
    /work/shared/tools/gpu-bundle .gpu-pack/channels \
      "$build_dir/server/attnd" "$build_dir/client/attnctl" \
      "$build_dir/tests/integration/channel_tests" \
      "$build_dir/tests/integration/channel_test_client" \
      "$build_dir/tests/integration/integration_tests" \
      "$build_dir/tests/kernels/cuda_backend_test" \
      "$build_dir/tests/kernels/prefill_tests" \
      "$build_dir/tests/kernels/cuda_lifecycle_test" "$build_dir/bench/handoff_probe" \
      ${ATTND_PACK_EXTRA:-} || exit 1
    source scripts/device_pack.sh
    device_xz channels .gpu-pack/channels.tar.xz
    rm -rf .gpu-pack/channels
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-pack' || echo '+dirty')" \
      > .gpu-pack/channels.commit
    ls -la .gpu-pack
    ;;
  run)
    what=${2:-all}
    OUT=${OUT:-/tmp/channel-run}
    logs=/tmp/channel-logs
    # Every step bounded, logs packed before each, stacks of a hung step (scripts/device_lib.sh).
    source scripts/device_lib.sh
    dl_init "$logs" "$OUT" logs.tgz "${ATTND_GPU_DEADLINE_S:-570}"
    trap dl_kill_daemons EXIT
    rm -rf /tmp/channels
    # ATTND_CHANNEL_PACK: another bundle of the same layout (a channels/ directory).
    pack=${ATTND_CHANNEL_PACK:-.gpu-pack/channels.tar.xz}
    timeout -k 5 120 tar -C /tmp -xJf "$pack" ||
      timeout -k 5 120 python3 -c \
        "import tarfile; tarfile.open('$pack').extractall('/tmp')" || exit 1
    B=/tmp/channels
    backend=${ATTND_DEVICE_BACKEND:-cuda}  # cpu: a dry run of the script on a machine without GPU
    say() { echo "$*" | tee -a "$OUT/summary.txt"; }
    say "commit $(cat .gpu-pack/channels.commit) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no GPU')"
    # gtest NAME LIMIT PROGRAM [ARGS...]: one bounded step and its verdict line.
    gtest() {
      local name=$1 limit=$2; shift 2
      local started=$SECONDS rc
      dl_run "$name" "$limit" "$@"; rc=$?
      say "$name: rc=$rc in $((SECONDS - started)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY' "$logs/$name.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED  \]' "$logs/$name.log" | head -10 | tee -a "$OUT/summary.txt"
    }
    # A fresh attnd on PORT for one case (DL_PID); 1 when it did not come up.
    start_attnd() {
      local name=$1 port=$2
      dl_daemon_start "attnd_$name" "$B/run" attnd --backend="$backend" \
        --listen_address=127.0.0.1:"$port" --metrics_address= --exit_grace=2s --drain_grace=2s \
        ${DAEMON_ARGS:-}
      dl_daemon_ready "$DL_PID" 30 "$B/run" attnctl --server=127.0.0.1:"$port" health ||
        { say "$name: attnd did not come up"; return 1; }
    }
    stop_attnd() {
      dl_daemon_stop "attnd_$1" "$2" 10 > /dev/null
      [[ $DL_STOP == "exit code 0 after SIGTERM" ]] || say "attnd_$1: $DL_STOP"
    }
    # MPS for CUDA_IPC on one GPU (README, Channels); no-op without it.
    mps() {
      command -v nvidia-cuda-mps-control > /dev/null || return 0
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p /tmp/mps-pipe /tmp/mps-log
      if [[ $1 == on ]]; then
        timeout -k 2 10 nvidia-cuda-mps-control -d
      else
        echo quit | timeout -k 2 10 nvidia-cuda-mps-control
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      fi
    }
    # The channel tests start their client child from the bundle.
    export ATTND_CHANNEL_TEST_CLIENT="$B/run channel_test_client"
    if [[ $what == all || $what == tests ]]; then
      gtest channel_tests 180 env ATTND_TEST_BACKEND="$backend" "$B/run" channel_tests
      # One GPU for these: their budget checks count one device's (on a 2-GPU host they saw
      # twice the KV budget and failed; peer mode covers the several-GPU cases).
      gtest integration_"$backend" 300 env CUDA_VISIBLE_DEVICES=0 ATTND_TEST_BACKEND="$backend" \
        "$B/run" integration_tests
      gtest cuda_backend_test 300 env CUDA_VISIBLE_DEVICES=0 "$B/run" cuda_backend_test
      gtest prefill_tests 240 "$B/run" prefill_tests
      gtest cuda_lifecycle_test 120 "$B/run" cuda_lifecycle_test
    fi
    if [[ $what == all || $what == bench ]]; then
      shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128
             --page_size=16 --prompt_tokens=64 --steps=${ATTND_BENCH_STEPS:-50} --warmup_steps=3)
      # A smaller shape for a dry run (ATTND_E2E_SHAPE="--sequences=4 --layers=2 ...").
      [[ -n ${ATTND_E2E_SHAPE:-} ]] && read -r -a shape <<< "$ATTND_E2E_SHAPE"
      port=50761
      e2e() {  # e2e NAME BENCH ARGS...: a fresh daemon, one bounded attnctl bench run
        local name=$1; shift
        if start_attnd "$name" $port; then
          local daemon=$DL_PID rc
          dl_run "e2e_$name" "${ATTND_E2E_LIMIT:-90}" "$B/run" "${ATTND_ATTNCTL:-attnctl}" \
            --server=127.0.0.1:$port bench "${shape[@]}" "$@" ${ATTND_E2E_ARGS:-}; rc=$?
          say "e2e $name rc=$rc $(grep -h '^RESULT' "$logs/e2e_$name.log" || tail -3 "$logs/e2e_$name.log")"
          grep -E '^  |^bench: (prompt step on|prompt step kernels|decode kernels|chained decode)' \
            "$logs/e2e_$name.log" >> "$OUT/summary.txt"
          stop_attnd "$name" "$daemon"
        fi
        port=$((port + 1))
      }
      for case in ${ATTND_E2E_CASES:-grpc_stream shm cuda_ipc cuda_ipc_mps}; do
        case $case in
          grpc_stream) e2e grpc_stream --stream --window=1 ;;
          shm) e2e shm --transport=shm ;;
          shm_parts[0-9]*)  # a HOST_SHM decode layer in N parts of its rows (--host_shm_parts)
            DAEMON_ARGS=--host_shm_parts=${case#shm_parts} e2e "$case" --transport=shm ;;
          shm_spin)  # completion threads spin, the client spins up to 2 ms on done words
            DAEMON_ARGS=--cuda_completion=spin e2e "$case" --transport=shm --host_spin_us=2000 ;;
          cuda_ipc) e2e cuda_ipc --transport=cuda_ipc ;;
          probe)  # what one cross-process handoff costs, by way of waiting (bench/handoff_probe.cu)
            mps on
            dl_run handoff_probe 60 "$B/run" handoff_probe
            say "handoff_probe (MPS) rc=$?"
            grep -v '^$' "$logs/handoff_probe.log" | tail -9 >> "$OUT/summary.txt"
            mps off ;;
          stamps|stamps_kernels)  # one GPU time line of both processes (scripts/channel_stamps.py)
            mps on
            flags=memops
            [[ $case == stamps_kernels ]] && flags=kernels
            ATTND_CHANNEL_STAMPS=1 DAEMON_ARGS=--channel_kernel_timing=0 \
              e2e "$case" --transport=cuda_ipc --fill_stamps --stream_flags=$flags
            timeout -k 5 60 python3 scripts/channel_stamps.py "$logs/attnd_$case.log" \
              "$logs/e2e_$case.log" 2>&1 | tee -a "$OUT/summary.txt"
            mps off ;;
          cuda_ipc_mps_kernels)  # the client signals and waits with kernels (flag_gate.h)
            mps on
            e2e "$case" --transport=cuda_ipc --stream_flags=kernels
            mps off ;;
          cuda_ipc_mps_kernels_done)  # as above, attnd's done words set by its kernels
            mps on
            DAEMON_ARGS=--channel_done_by_kernel=true e2e "$case" --transport=cuda_ipc \
              --stream_flags=kernels
            mps off ;;
          cuda_ipc_mps_timed)  # every channel layer's kernels timed (--channel_kernel_timing=1)
            mps on
            DAEMON_ARGS=--channel_kernel_timing=1 e2e "$case" --transport=cuda_ipc
            mps off ;;
          cuda_ipc_mps|cuda_ipc_mps_mb2|cuda_ipc_mps_mb4)
            mb=1
            [[ $case == *_mb2 ]] && mb=2
            [[ $case == *_mb4 ]] && mb=4
            mps on
            e2e "$case" --transport=cuda_ipc --micro_batches=$mb
            mps off ;;
        esac
      done
    fi
    if [[ $what == python ]]; then
      # The Python client's transformers examples (issue 13) against the CUDA backend, over
      # gRPC and CUDA_IPC (under MPS, as the README recommends for CUDA_IPC on one GPU).
      mps on
      port=50791
      if start_attnd python $port; then
        daemon=$DL_PID
        say "python: $(python3 -c 'import google.protobuf, grpc, torch, transformers; print("protobuf", google.protobuf.__version__, "grpcio", grpc.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"
        export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1
        for example in ${ATTND_PY_EXAMPLES:-llama:grpc llama:cuda_ipc deepseek:grpc deepseek:cuda_ipc llama:stream}; do
          model=${example%%:*}; transport=${example##*:}
          script=client/python/examples/llama_transformers.py
          [[ $model == deepseek ]] && script=client/python/examples/deepseek_mla_transformers.py
          dl_run "py_${model}_${transport}" 150 python3 "$script" --target 127.0.0.1:$port \
            --transport "$transport"
          say "python $model $transport rc=$? $(grep -E 'PASS|FAIL|tokens/s' "$logs/py_${model}_${transport}.log" | tail -3 | tr '\n' ' ')"
        done
        stop_attnd python "$daemon"
      fi
      # The package's CUDA_IPC tests (tests/python/test_cuda_ipc.py) against a CUDA attnd.
      if [[ ${ATTND_PY_PYTEST:-1} == 1 ]]; then
        dl_run pytest_cuda_ipc 150 env LD_LIBRARY_PATH="$B/lib" python3 -m pytest -q \
          -p no:cacheprovider tests/python/test_cuda_ipc.py --attnd "$B/bin/attnd" --backend cuda
        say "pytest test_cuda_ipc.py rc=$? $(tail -1 "$logs/pytest_cuda_ipc.log")"
      fi
      mps off
    fi
    if [[ $what == peer ]]; then
      # Issue 19 on a 2-GPU host (docs/issue19-device-plan.md): attnd on GPU 0, its clients on
      # GPU 1 over peer CUDA_IPC and NCCL. NVLink multicast stays off everywhere.
      # PEER_STEPS picks the parts (default: tests pytest bench refusals seq socket; also
      # rawpingpong, NCCL itself between the two GPUs, nccl_tune, the NCCL bench
      # under NCCL settings, ncclbench, the NCCL rows of bench alone, socket_tests, the NCCL
      # channel tests over sockets, and byhand, the channel tests' comparisons against a
      # separate attnd).
      steps=" ${PEER_STEPS:-tests pytest bench refusals seq socket} "
      want() { [[ $steps == *" $1 "* ]]; }
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      timeout -k 2 20 nvidia-smi topo -m > "$logs/topo.log" 2>&1
      say "topology: $(grep -E '^GPU[01]' "$logs/topo.log" | tr -s ' \t' ' ' | tr '\n' ';')"
      # NCCL is not in the bundle: the device's PyTorch wheels ship libnccl.so.2.
      nccl_dir=$(timeout -k 2 30 python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
      [[ -e $nccl_dir/libnccl.so.2 ]] ||
        nccl_dir=$(dirname "$(timeout -k 2 60 find / -xdev -name 'libnccl.so.2*' 2>/dev/null | head -1)")
      export LD_LIBRARY_PATH=$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      say "libnccl.so.2 from $nccl_dir: $(ls "$nccl_dir" 2>&1 | tr '\n' ' ')"
      if want tests; then
        # The test server serves every visible GPU; the peer tests put their caches on device 0
        # and their client processes on 1.
        gtest channel_tests 240 env ATTND_TEST_BACKEND="$backend" "$B/run" channel_tests
        # Issue 17's several devices on real GPUs: placement, GetServerInfo, a sequence moved
        # between the two GPUs by export and import.
        gtest two_devices 120 env ATTND_TEST_BACKEND="$backend" ATTND_TEST_TWO_GPUS=1 \
          "$B/run" integration_tests --gtest_filter='TwoDevices*'
      fi
      if want socket_tests; then
        # The NCCL channel tests over NCCL's socket transport on loopback (the stand-in for a
        # host-to-host path): bitwise the gRPC path, killed and silent clients.
        gtest channel_tests_socket 240 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 \
          NCCL_SOCKET_IFNAME=lo ATTND_TEST_BACKEND="$backend" "$B/run" channel_tests \
          --gtest_filter='*Nccl*:*Killed*'
      fi
      if want rawpingpong; then
        # NCCL called as attnd calls it (ctypes, one stream), in several shapes, eager and
        # captured in a CUDA graph: the floor under the NCCL channel's overhead.
        # PEER_RAW_ARGS: more arguments (--fill_us/--kernels_us: work between the exchanges).
        # shellcheck disable=SC2086
        dl_run nccl_raw_pingpong 200 python3 bench/nccl_raw_pingpong.py --rounds 1000 --graph \
          --modes "${PEER_RAW_MODES:-three,one,split2,split4}" ${PEER_RAW_ARGS:-}
        say "nccl_raw_pingpong rc=$? $(grep -h '^RESULT\|FAIL\|Error' "$logs/nccl_raw_pingpong.log" | tr '\n' ' ')"
        dl_run nccl_raw_pingpong_small 120 python3 bench/nccl_raw_pingpong.py --rounds 1000 \
          --graph --rows 4 --modes three,one
        say "nccl_raw_pingpong rows=4 rc=$? $(grep -h '^RESULT\|FAIL\|Error' "$logs/nccl_raw_pingpong_small.log" | tr '\n' ' ')"
      fi
      port=50861
      DAEMON_ARGS="--devices=0 ${PEER_DAEMON_ARGS:-}"
      peer_shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128
                  --page_size=16 --prompt_tokens=64 --warmup_steps=3 --client_device=1)
      # peer NAME LIMIT ARGS...: one attnctl bench against the daemon on $port.
      peer() {
        local name=$1 limit=$2 rc; shift 2
        dl_run "peer_$name" "$limit" "$B/run" attnctl --server=127.0.0.1:$port bench "$@"; rc=$?
        say "peer $name rc=$rc $(grep -h '^RESULT' "$logs/peer_$name.log" || tail -3 "$logs/peer_$name.log" | tr '\n' ' ')"
        grep -E '^  |^bench: ' "$logs/peer_$name.log" >> "$OUT/summary.txt"
      }
      if (want bench || want ncclbench || want refusals || want seq || want byhand) &&
          start_attnd peer $port; then
        daemon=$DL_PID
        say "info: $("$B/run" attnctl --server=127.0.0.1:$port info 2>&1 | grep -E 'channel_|extensions|device' | tr '\n' ' ')"
        grep -i nccl "$logs/attnd_peer.log" | head -3 | tee -a "$OUT/summary.txt"
        if want byhand; then
          # The channel tests' bitwise comparisons against this attnd (a process of its own):
          # plain and chained steps, clients on GPU 1.
          for kind in nccl cuda-ipc; do
            dl_run "byhand_$kind" 90 "$B/run" channel_test_client "compare-$kind" \
              127.0.0.1:$port "byhand-$kind" --client_device=1
            say "by hand compare-$kind rc=$? $(tail -2 "$logs/byhand_$kind.log" | tr '\n' ' ')"
          done
        fi
        if want bench; then
          peer cuda_ipc_check 90 "${peer_shape[@]}" --transport=cuda_ipc --check_sequences=8 --steps=20
          peer cuda_ipc 120 "${peer_shape[@]}" --transport=cuda_ipc --steps=${ATTND_BENCH_STEPS:-200}
          peer nccl_check 90 "${peer_shape[@]}" --transport=nccl --check_sequences=8 --steps=20
          peer nccl 120 "${peer_shape[@]}" --transport=nccl --steps=${ATTND_BENCH_STEPS:-200}
          peer grpc_stream 90 "${peer_shape[@]}" --stream --window=1 --steps=30
        fi
        if want ncclbench; then  # the NCCL rows of bench alone
          peer nccl_check 90 "${peer_shape[@]}" --transport=nccl --check_sequences=8 --steps=20
          peer nccl 120 "${peer_shape[@]}" --transport=nccl --steps=${ATTND_BENCH_STEPS:-200}
        fi
        if want refusals; then
          # NCCL from attnd's own GPU; CUDA_IPC from a process that cannot see attnd's GPU.
          peer nccl_same_gpu 60 --sequences=4 --layers=2 --steps=2 --transport=nccl --client_device=0
          dl_run peer_hidden_gpu 60 env CUDA_VISIBLE_DEVICES=1 "$B/run" attnctl \
            --server=127.0.0.1:$port bench --sequences=4 --layers=2 --steps=2 --transport=cuda_ipc
          say "peer hidden_gpu rc=$? $(tail -2 "$logs/peer_hidden_gpu.log" | tr '\n' ' ')"
        fi
        if want seq; then
          # Issue 17: one sequence's KV (8192 tokens x 32 layers, 1 GiB) exported, imported and
          # copied as gRPC bytes and through HOST_SHM and CUDA_IPC channels (client on GPU 0).
          dl_run peer_seq_bench 200 "$B/run" attnctl --server=127.0.0.1:$port seq bench \
            --channel=all --seq_bench_repeat=3
          say "seq bench rc=$?"
          grep -vE '^\s*$' "$logs/peer_seq_bench.log" | tail -12 >> "$OUT/summary.txt"
        fi
        grep -E 'FAIL|ERROR|rror' "$logs/attnd_peer.log" | head -5 >> "$OUT/summary.txt"
        stop_attnd peer "$daemon"
      fi
      # nccl_tune: the NCCL bench with NCCL settings given to both processes, one daemon each
      # (PEER_NCCL_TUNES: ';'-separated sets of VAR=VALUE words).
      if want nccl_tune; then
        IFS=';' read -r -a tunes <<< "${PEER_NCCL_TUNES:-NCCL_MIN_P2P_NCHANNELS=8;NCCL_P2P_NVL_CHUNKSIZE=2097152;NCCL_P2P_USE_CUDA_MEMCPY=1;NCCL_PROTO=LL128}"
        for tune in "${tunes[@]}"; do
          port=$((port + 1))
          tag=$(echo "$tune" | tr -c 'A-Za-z0-9_\n' '_' | cut -c1-40)
          read -r -a tune_env <<< "$tune"
          for word in "${tune_env[@]}"; do export "${word?}"; done
          if start_attnd "tune_$tag" $port; then
            daemon=$DL_PID
            peer "nccl_$tag" 90 "${peer_shape[@]}" --transport=nccl --check_sequences=2 --steps=100
            stop_attnd "tune_$tag" "$daemon"
          fi
          for word in "${tune_env[@]}"; do unset "${word%%=*}"; done
        done
      fi
      # The Python client's GPU tests (CUDA_IPC, and NCCL from GPU 1) against a CUDA attnd.
      if want pytest; then
        dl_run peer_pytest 180 env LD_LIBRARY_PATH="$B/lib:$LD_LIBRARY_PATH" \
          PYTHONPATH="$PWD/client/python" python3 -m pytest -q -p no:cacheprovider \
          tests/python/test_cuda_ipc.py --attnd "$B/bin/attnd" --backend cuda
        say "pytest test_cuda_ipc.py (two GPUs) rc=$? $(tail -1 "$logs/peer_pytest.log")"
        # The transformers Llama example over NCCL, the model on GPU 1, attnd on GPU 0.
        port=50871
        DAEMON_ARGS="--devices=0" start_attnd py_nccl $port && {
          daemon=$DL_PID
          dl_run py_llama_nccl 150 env PYTHONPATH="$PWD/client/python" PYTHONUNBUFFERED=1 \
            python3 client/python/examples/llama_transformers.py --target 127.0.0.1:$port \
            --transport nccl --device cuda:1
          say "python llama nccl rc=$? $(grep -E 'PASS|FAIL|tokens/s' "$logs/py_llama_nccl.log" | tail -2 | tr '\n' ' ')"
          stop_attnd py_nccl "$daemon"
        }
      fi
      # NCCL over sockets on loopback: the stand-in for a host-to-host path (both sides).
      if want socket; then
        port=50882
        export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo
        if start_attnd peer_socket $port; then
          daemon=$DL_PID
          peer nccl_socket_check 90 "${peer_shape[@]}" --transport=nccl --check_sequences=8 --steps=10
          peer nccl_socket 120 "${peer_shape[@]}" --transport=nccl --steps=50
          stop_attnd peer_socket "$daemon"
        fi
        unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE NCCL_IB_DISABLE NCCL_SOCKET_IFNAME
      fi
    fi
    if [[ $what == all || $what == sanitize ]]; then
      cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      if [[ -x $cs ]]; then
        gtest memcheck_channels 300 env ATTND_TEST_BACKEND="$backend" LD_LIBRARY_PATH="$B/lib" \
          "$cs" --tool memcheck --target-processes all --error-exitcode 3 "$B/bin/channel_tests" \
          --gtest_filter='*HostShm*:*CudaIpc*:*UseChannel*'
      else
        say "compute-sanitizer not found"
      fi
    fi
    dl_pack
    ;;
  *)
    echo "usage: $0 pack | run [tests|bench|sanitize|all|python|peer]" >&2
    exit 2
    ;;
esac
