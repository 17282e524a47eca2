#!/usr/bin/env bash
# Issue 14's table in one device call (its item 4): attnd's decode on the issue's shapes (pages
# in order, as FlashInfer's figures were taken), attnd's prefill and POD, each beside the PyTorch
# baseline of the same call. Two halves:
#   scripts/issue14-device-run.sh pack   (here: builds attnd_bench, prefill_bench and pod_bench
#                                         and bundles them into .gpu-pack/issue14.tar.xz; cuBLAS,
#                                         which prefill_bench uses for the matmul peak, is left
#                                         out: the device has it)
#   scripts/issue14-device-run.sh run    (on the device, carrying .gpu-pack/issue14.tar.xz and
#                                         .gpu-pack/issue14.commit; logs and CSVs under $OUT)
# The card's power and SM clock are sampled through the run (scripts/device_clocks.sh,
# $OUT/dmon.log, summarised at the end). Every step runs under `timeout -k`; there is no daemon.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${ATTND_BUILD_DIR:-build}

case ${1:-} in
  pack)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" \
      --target attnd_bench prefill_bench pod_bench >/dev/null || exit 1
    source scripts/device_pack.sh
    device_pack issue14 "$build_dir/bench/attnd_bench" "$build_dir/bench/prefill_bench" \
      "$build_dir/bench/pod_bench" || exit 1
    ;;
  run)
    OUT=${OUT:-/tmp/issue14-out}
    mkdir -p "$OUT"
    source scripts/device_pack.sh
    device_unpack issue14 "$OUT/summary.txt" || exit 1
    B=/tmp/issue14
    source scripts/device_clocks.sh
    clocks_start "$OUT/dmon.log"
    echo "== decode: attnd (issue 14's shapes, pages in order), then torch" | tee -a "$OUT/summary.txt"
    timeout -k 10 200 "$B/run" attnd_bench --decode --issue14 --contiguous-pages \
      --csv="$OUT/decode.csv" > "$OUT/decode.log" 2>&1
    echo "attnd_bench rc=$?" | tee -a "$OUT/summary.txt"
    grep -E '^decode |copy bandwidth' "$OUT/decode.log" | tee -a "$OUT/summary.txt"
    timeout -k 10 400 python3 tests/bench/torch_baseline.py --ours "$OUT/decode.csv" \
      > "$OUT/torch_decode.log" 2>&1
    echo "torch_baseline rc=$?" | tee -a "$OUT/summary.txt"
    grep -E 'torch |copy|b1_kv4096|b1_kv8192|b16_kv1024|b16_kv4096|b64_kv4096|b128_kv(4096|8192)|b256_kv(4096|32768)' \
      "$OUT/torch_decode.log" | tee -a "$OUT/summary.txt"
    # prefill_bench (the planner's kernel) on NAME's cases, then torch on the same cases from its
    # CSV; logs NAME.log and torch_NAME.log, the last LINES of torch's table in the summary.
    prefill_beside_torch() {
      local name=$1 lines=$2
      shift 2
      timeout -k 10 200 "$B/run" prefill_bench "$@" --csv="$OUT/$name.csv" > "$OUT/$name.log" 2>&1
      echo "prefill_bench ($name) rc=$?" | tee -a "$OUT/summary.txt"
      (cd "$OUT" && timeout -k 10 300 python3 "$OLDPWD/tests/bench/torch_prefill_baseline.py" \
        --ours "$name.csv") > "$OUT/torch_$name.log" 2>&1
      echo "torch_prefill_baseline ($name) rc=$?" | tee -a "$OUT/summary.txt"
      tail -"$lines" "$OUT/torch_$name.log" | tee -a "$OUT/summary.txt"
    }
    echo "== prefill: attnd (the planner's kernel), then torch" | tee -a "$OUT/summary.txt"
    prefill_beside_torch prefill 12
    # Short prompts (not in issue 14's table; the eighteenth session found the Hopper prefill
    # 1.24-2.05x torch there): 8192 query tokens in requests of 64-1024 tokens.
    echo "== prefill, short prompts: attnd, then torch" | tee -a "$OUT/summary.txt"
    prefill_beside_torch prefill_short 8 --cases=c128x64,c64x128,c32x256,c16x512,c8x1024,n32x256
    echo "== POD (fused against back-to-back and merged kernels)" | tee -a "$OUT/summary.txt"
    timeout -k 10 200 "$B/run" pod_bench > "$OUT/pod.log" 2>&1
    echo "pod_bench rc=$?" | tee -a "$OUT/summary.txt"
    tail -20 "$OUT/pod.log" | tee -a "$OUT/summary.txt"
    clocks_stop
    clocks_summary "$OUT/dmon.log" | tee -a "$OUT/summary.txt"
    ;;
  *)
    echo "usage: $0 pack | run" >&2
    exit 2
    ;;
esac
