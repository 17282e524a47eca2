#!/usr/bin/env bash
# The e2e benchmark of PERFORMANCE.md on a GPU machine, in one call: attnd and attnctl on
# loopback, before (the binaries of the commit before issue 9, *_base) and after, plus the
# in-process breakdown (hot_path_bench) and the CUDA backend checked against the reference
# (integration tests with ATTND_TEST_BACKEND=cuda). Everything lands in $OUT.
#
#   tests/bench/e2e_device_run.sh BUNDLE_DIR      (BUNDLE_DIR/run PROGRAM: tools/gpu-bundle)
#
# Shapes: 128 decode sequences x 32 layers, Hq 32, Hkv 8, D 128, bf16, page 16, 64 prompt tokens
# (the shape the first measurement used), 30 timed steps after 3 warm-up steps. Files come back
# as results.txt, summary.txt, breakdown.txt, plan_bench.txt, device.txt and all.tgz (every log;
# stacks_NAME.txt for a step or daemon that hung). The most important runs come first, so a call
# cut short still returns them.
set -u
bundle=$1
out=${OUT:-/tmp/e2e-out}
logs=/tmp/e2e-logs
source "$(dirname "$0")/../../scripts/device_lib.sh"
# Every step bounded (scripts/device_lib.sh); none starts after E2E_DEADLINE_S seconds.
dl_init "$logs" "$out" all.tgz "${E2E_DEADLINE_S:-570}"
run() { "$bundle/run" "$@"; }
log() { echo "== $*" | tee -a "$out/summary.txt"; }
# At most 8 files come back from a device call: the logs travel in all.tgz, packed before each
# step starts (a call cut short still returns them) and on any exit.
finish() { dl_kill_daemons; cp -f "$out"/*.txt "$logs/" 2>/dev/null; dl_pack; }
trap finish EXIT
trap 'exit 143' TERM

timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm \
  --format=csv > "$out/device.txt" 2>&1
cat "$out/device.txt"
nproc >> "$out/device.txt"

shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128 --page_size=16
       --prompt_tokens=64)
port=50551

start_daemon() {  # start_daemon BINARY [ENV=VALUE...] : attnd on loopback, waits until ready
  local binary=$1; shift
  # The current daemon's shutdown bounds (the base binary keeps its defaults: 30 s + 5 s); the
  # wait ends before attnd's own watchdog (25 s) would, so that a hang's stacks are taken.
  local flags=(--drain_grace=10s --exit_grace=5s)
  stop_grace=20
  [[ $binary == attnd ]] || { flags=(); stop_grace=45; }
  daemon_name=daemon_${binary}_$port
  dl_step "$daemon_name"
  dl_daemon_start "$daemon_name" env "$@" "$bundle/run" "$binary" \
    --listen_address=127.0.0.1:$port --metrics_address= "${flags[@]}"
  daemon=$DL_PID
  dl_daemon_ready "$daemon" 60 "$bundle/run" attnctl --server=127.0.0.1:$port --timeout=3s health &&
    return 0
  echo "daemon $binary did not become ready"; tail -5 "$logs/$daemon_name.log"
}
stop_daemon() {
  dl_daemon_stop "$daemon_name" "$daemon" "$stop_grace" > /dev/null
  echo "$daemon_name: $DL_STOP" | tee -a "$out/summary.txt"
  port=$((port + 1))
}

bench() {  # bench NAME CLIENT ARGS... : one attnctl bench run, its RESULT line tagged NAME
  local name=$1 client=$2; shift 2
  dl_run "bench_$name" 60 "$bundle/run" "$client" --server=127.0.0.1:$port bench "${shape[@]}" "$@"
  echo "$name $(grep -h '^RESULT\|^HUNG' "$logs/bench_$name.log" || tail -2 "$logs/bench_$name.log")" \
    | tee -a "$out/results.txt"
}

# 3. After (completion threads sleep on blocking-sync events, the default).
log "after"
start_daemon attnd
bench unary_w1 attnctl --steps=30 --warmup_steps=3
bench stream_w1 attnctl --steps=30 --warmup_steps=3 --stream --window=1
bench stream_w1_msgclient attnctl --steps=30 --warmup_steps=3 --stream --window=1 --raw=false
bench stream_mb2_w2 attnctl --steps=30 --warmup_steps=3 --stream --micro_batches=2 --window=2
bench stream_mb2_w4 attnctl --steps=30 --warmup_steps=3 --stream --micro_batches=2 --window=4
bench stream_mb4_w4 attnctl --steps=30 --warmup_steps=3 --stream --micro_batches=4 --window=4
bench unary_mb2_w2 attnctl --steps=30 --warmup_steps=3 --micro_batches=2 --window=2
bench stream_w1_mixed512 attnctl --steps=20 --warmup_steps=2 --stream --window=1 --prefill_tokens=512
stop_daemon

# 2. Before: the daemon and CLI of the commit before issue 9.
log "before"
start_daemon attnd_base
dl_run base_stats0 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port stats
dl_run bench_base_unary_old_client 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port bench \
  "${shape[@]}" --steps=30
dl_run base_stats1 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port stats
dl_run bench_base_stream_w1_old_client 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port \
  bench "${shape[@]}" --steps=30 --stream --window=1
dl_run base_stats2 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port stats
grep -h "layer latency\|timed\|^HUNG" "$logs"/bench_base_*old_client.log | tee -a "$out/summary.txt"
# The new CLI (same measurements as after) against the old daemon.
bench base_unary_w1 attnctl --steps=30 --warmup_steps=3 --raw=false
bench base_stream_w1 attnctl --steps=30 --warmup_steps=3 --stream --window=1 --raw=false
bench base_stream_mb2_w2 attnctl --steps=30 --warmup_steps=3 --stream --micro_batches=2 --window=2 --raw=false
stop_daemon

# 6. The in-process breakdown (stages between the wire and the kernel), and planning cost on
# this host's CPU.
log "breakdown"
for args in "stream_w1 --stream --window=1" "unary_w1 --window=1" "stream_w2 --stream --window=2"; do
  set -- $args
  name=$1; shift
  dl_run "hot_path_$name" 60 "$bundle/run" hot_path_bench --backend=cuda --layers=32 --steps=30 \
    --warmup_steps=3 "$@"
  tee -a "$out/breakdown.txt" < "$logs/hot_path_$name.log"
done
# 1. Correctness of the new CUDA backend path (lanes, lent outputs, raw messages).
log "integration tests, CUDA backend"
dl_run integration_cuda 90 env ATTND_TEST_BACKEND=cuda "$bundle/run" integration_tests
grep -E "PASSED|FAILED|^HUNG" "$logs/integration_cuda.log" | tail -5 | tee -a "$out/summary.txt"
# 4. Completion threads spinning instead of sleeping on blocking-sync events (the default).
for wait in spin; do
  log "after, completion $wait"
  start_daemon attnd ATTND_CUDA_COMPLETION=$wait
  bench stream_w1_$wait attnctl --steps=30 --warmup_steps=3 --stream --window=1
  bench stream_mb2_w2_$wait attnctl --steps=30 --warmup_steps=3 --stream --micro_batches=2 --window=2
  stop_daemon
done

# 5. A Unix socket instead of TCP loopback.
log "after, unix socket"
dl_step daemon_unix
dl_daemon_start daemon_unix "$bundle/run" attnd --listen_address=unix:/tmp/attnd-e2e.sock \
  --metrics_address= --drain_grace=10s --exit_grace=5s
daemon=$DL_PID
daemon_name=daemon_unix
stop_grace=20
dl_daemon_ready "$daemon" 60 "$bundle/run" attnctl --server=unix:/tmp/attnd-e2e.sock --timeout=3s \
  health || echo "daemon (unix socket) did not become ready"
for args in "stream_w1_unix --stream --window=1" "stream_mb2_w2_unix --stream --micro_batches=2 --window=2"; do
  set -- $args
  name=$1; shift
  dl_run "bench_$name" 60 "$bundle/run" attnctl --server=unix:/tmp/attnd-e2e.sock bench \
    "${shape[@]}" --steps=30 --warmup_steps=3 "$@"
  echo "$name $(grep -h '^RESULT\|^HUNG' "$logs/bench_$name.log" || tail -2 "$logs/bench_$name.log")" \
    | tee -a "$out/results.txt"
done
stop_daemon

log "cuda_backend_test"
dl_run cuda_backend_test 60 "$bundle/run" cuda_backend_test
grep -E "PASSED|FAILED|^HUNG" "$logs/cuda_backend_test.log" | tail -5 | tee -a "$out/summary.txt"

dl_run plan_bench 60 "$bundle/run" plan_bench --runs=1000
cp "$logs/plan_bench.log" "$out/plan_bench.txt"
log "done"
