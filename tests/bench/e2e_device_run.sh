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
# as results.txt, summary.txt, breakdown.txt, plan_bench.txt, device.txt and all.tgz. The most
# important runs come first, so a call cut short still returns them.
set -u
bundle=$1
out=${OUT:-/tmp/e2e-out}
mkdir -p "$out"
run() { "$bundle/run" "$@"; }
log() { echo "== $*" | tee -a "$out/summary.txt"; }
# At most 8 files come back from a device call: the rest travel in one archive, made on any
# exit (a timeout included).
pack() {
  tar -C "$out" -czf /tmp/e2e-all.tgz . && mv /tmp/e2e-all.tgz "$out/all.tgz"
  find "$out" -maxdepth 1 -type f ! -name all.tgz ! -name results.txt ! -name summary.txt \
    ! -name breakdown.txt ! -name plan_bench.txt ! -name device.txt -delete
}
trap pack EXIT
trap 'exit 143' TERM

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv \
  > "$out/device.txt" 2>&1
cat "$out/device.txt"
nproc >> "$out/device.txt"

shape=(--sequences=128 --layers=32 --qo_heads=32 --kv_heads=8 --head_dim=128 --page_size=16
       --prompt_tokens=64)
port=50551

start_daemon() {  # start_daemon BINARY [ENV=VALUE...] : attnd on loopback, waits until ready
  local binary=$1; shift
  env "$@" "$bundle/run" "$binary" --listen_address=127.0.0.1:$port --metrics_address= \
    > "$out/daemon_${binary}_$port.log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 100); do
    run attnctl --server=127.0.0.1:$port health > /dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "daemon $binary did not become ready"; tail -5 "$out/daemon_${binary}_$port.log"
}
stop_daemon() { kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; port=$((port + 1)); }

bench() {  # bench NAME CLIENT ARGS... : one attnctl bench run, its RESULT line tagged NAME
  local name=$1 client=$2; shift 2
  timeout 60 "$bundle/run" "$client" --server=127.0.0.1:$port bench "${shape[@]}" "$@" \
    > "$out/bench_$name.log" 2>&1
  echo "$name $(grep -h '^RESULT' "$out/bench_$name.log" || tail -2 "$out/bench_$name.log")" \
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
timeout 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port stats > "$out/base_stats0.txt" 2>&1
timeout 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port bench "${shape[@]}" --steps=30 \
  > "$out/bench_base_unary_old_client.log" 2>&1
timeout 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port stats > "$out/base_stats1.txt" 2>&1
timeout 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port bench "${shape[@]}" --steps=30 \
  --stream --window=1 > "$out/bench_base_stream_w1_old_client.log" 2>&1
timeout 60 "$bundle/run" attnctl_base --server=127.0.0.1:$port stats > "$out/base_stats2.txt" 2>&1
grep -h "layer latency\|timed" "$out"/bench_base_*old_client.log | tee -a "$out/summary.txt"
# The new CLI (same measurements as after) against the old daemon.
bench base_unary_w1 attnctl --steps=30 --warmup_steps=3 --raw=false
bench base_stream_w1 attnctl --steps=30 --warmup_steps=3 --stream --window=1 --raw=false
bench base_stream_mb2_w2 attnctl --steps=30 --warmup_steps=3 --stream --micro_batches=2 --window=2 --raw=false
stop_daemon

# 6. The in-process breakdown (stages between the wire and the kernel), and planning cost on
# this host's CPU.
log "breakdown"
for args in "--stream --window=1" "--window=1" "--stream --window=2"; do
  timeout 60 "$bundle/run" hot_path_bench --backend=cuda --layers=32 --steps=30 --warmup_steps=3 \
    $args 2>&1 | tee -a "$out/breakdown.txt"
done
# 1. Correctness of the new CUDA backend path (lanes, lent outputs, raw messages).
log "integration tests, CUDA backend"
ATTND_TEST_BACKEND=cuda timeout 90 "$bundle/run" integration_tests > "$out/integration_cuda.log" 2>&1
grep -E "PASSED|FAILED" "$out/integration_cuda.log" | tail -5 | tee -a "$out/summary.txt"
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
"$bundle/run" attnd --listen_address=unix:/tmp/attnd-e2e.sock --metrics_address= \
  > "$out/daemon_unix.log" 2>&1 &
daemon=$!
sleep 3
for args in "stream_w1_unix --stream --window=1" "stream_mb2_w2_unix --stream --micro_batches=2 --window=2"; do
  set -- $args
  name=$1; shift
  timeout 60 "$bundle/run" attnctl --server=unix:/tmp/attnd-e2e.sock bench "${shape[@]}" \
    --steps=30 --warmup_steps=3 "$@" > "$out/bench_$name.log" 2>&1
  echo "$name $(grep -h '^RESULT' "$out/bench_$name.log" || tail -2 "$out/bench_$name.log")" \
    | tee -a "$out/results.txt"
done
kill "$daemon"; wait "$daemon" 2>/dev/null

log "cuda_backend_test"
timeout 60 "$bundle/run" cuda_backend_test > "$out/cuda_backend_test.log" 2>&1
grep -E "PASSED|FAILED" "$out/cuda_backend_test.log" | tail -5 | tee -a "$out/summary.txt"

timeout 60 "$bundle/run" plan_bench --runs=1000 2>&1 | tee "$out/plan_bench.txt"
log "done"
