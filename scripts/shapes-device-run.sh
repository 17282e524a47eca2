#!/usr/bin/env bash
# attnd's prefill and decode beside the PyTorch baseline on shapes other than PERFORMANCE.md's
# standard one (head_dim 64 and 256, groups of 1, 7 and 8), in one device call: the general case
# that the standard table (scripts/issue14-device-run.sh) does not show. Two halves:
#   scripts/shapes-device-run.sh pack   (here: builds attnd_bench and prefill_bench, bundles them
#                                        into .gpu-pack/shapes.tar.xz; cuBLAS left out)
#   scripts/shapes-device-run.sh run    (on the device, carrying .gpu-pack/shapes.tar.xz and
#                                        .gpu-pack/shapes.commit; logs and CSVs under $OUT)
# ATTND_SHAPES: the shapes, "Hq:Hkv:D" each (default below); ATTND_SHAPE_STEPS: "prefill decode"
# (default both); ATTND_SHAPE_KV_DTYPES: the decode caches' dtypes, "bf16 fp8" say (default bf16;
# torch has no fp8 cache, so fp8 rows carry attnd's figures and % of copy alone). Every attnd case is checked against the float64 reference before it is timed;
# every step runs under `timeout -k`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${ATTND_BUILD_DIR:-build}

case ${1:-} in
  pack)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" --target attnd_bench prefill_bench >/dev/null ||
      exit 1
    source scripts/device_pack.sh
    device_pack shapes "$build_dir/bench/attnd_bench" "$build_dir/bench/prefill_bench" || exit 1
    ;;
  run)
    OUT=${OUT:-/tmp/shapes-out}
    mkdir -p "$OUT"
    source scripts/device_pack.sh
    device_unpack shapes "$OUT/summary.txt" || exit 1
    B=/tmp/shapes
    # Llama-3 8B's shape first (the reference), then head_dim 64, Gemma-2's 256, Llama-3 70B's
    # group of 8, Qwen2-7B's group of 7, and MHA (Llama-2 7B).
    shapes=${ATTND_SHAPES:-"32:8:128 32:8:64 16:8:256 64:8:128 28:4:128 32:32:128"}
    steps=${ATTND_SHAPE_STEPS:-"prefill decode"}
    prefill_cases=${ATTND_PREFILL_CASES:-c1x2048,c1x8192,c8x2048,n1x4096}
    decode_cases=${ATTND_DECODE_CASES:-1x4096,16x4096,64x4096,128x2048}
    deadline=${ATTND_SHAPES_DEADLINE_S:-480}  # no shape starts after this many seconds
    for shape in $shapes; do
      if (( SECONDS > deadline )); then
        echo "== skipped $shape: past ${deadline} s" | tee -a "$OUT/summary.txt"
        continue
      fi
      IFS=: read -r hq hkv d <<<"$shape"
      flags=(--qo_heads="$hq" --kv_heads="$hkv" --head_dim="$d")
      tag="q${hq}_kv${hkv}_d${d}"
      if [[ " $steps " == *" prefill "* ]]; then
        echo "== prefill Hq $hq Hkv $hkv D $d" | tee -a "$OUT/summary.txt"
        timeout -k 10 150 "$B/run" prefill_bench "${flags[@]}" --cases="$prefill_cases" \
          --csv="$OUT/prefill_$tag.csv" > "$OUT/prefill_$tag.log" 2>&1
        echo "prefill_bench rc=$?" | tee -a "$OUT/summary.txt"
        grep -E 'plan:' "$OUT/prefill_$tag.log" | head -1 | cut -c1-200 | tee -a "$OUT/summary.txt"
        (cd "$OUT" && timeout -k 10 150 python3 "$OLDPWD/tests/bench/torch_prefill_baseline.py" \
          --ours "prefill_$tag.csv") > "$OUT/torch_prefill_$tag.log" 2>&1
        echo "torch_prefill_baseline rc=$?" | tee -a "$OUT/summary.txt"
        tail -n +2 "$OUT/torch_prefill_$tag.log" | tee -a "$OUT/summary.txt"
      fi
      if [[ " $steps " == *" decode "* ]]; then
        for kv_dtype in ${ATTND_SHAPE_KV_DTYPES:-bf16}; do
          echo "== decode Hq $hq Hkv $hkv D $d, $kv_dtype cache" | tee -a "$OUT/summary.txt"
          timeout -k 10 150 "$B/run" attnd_bench "${flags[@]}" --kv_dtype="$kv_dtype" \
            --decode_cases="$decode_cases" --csv="$OUT/decode_${tag}_$kv_dtype.csv" \
            > "$OUT/decode_${tag}_$kv_dtype.log" 2>&1
          echo "attnd_bench rc=$?" | tee -a "$OUT/summary.txt"
          if [[ $kv_dtype == fp8 ]]; then
            grep -E '^decode ' "$OUT/decode_${tag}_$kv_dtype.log" | cut -c1-120 | tee -a "$OUT/summary.txt"
            continue
          fi
          timeout -k 10 150 python3 tests/bench/torch_baseline.py "${flags[@]}" --only_ours \
            --ours "$OUT/decode_${tag}_$kv_dtype.csv" > "$OUT/torch_decode_${tag}_$kv_dtype.log" 2>&1
          echo "torch_baseline rc=$?" | tee -a "$OUT/summary.txt"
          grep -E '^b[0-9]' "$OUT/torch_decode_${tag}_$kv_dtype.log" | tee -a "$OUT/summary.txt"
        done
      fi
    done
    # At most 8 files come back from a device call: the logs and CSVs travel as one archive.
    (cd "$OUT" && shopt -s nullglob && files=(./*.log ./*.csv) && tar -czf logs.tgz "${files[@]}" &&
      rm -f "${files[@]}")
    ;;
  *)
    echo "usage: $0 pack | run" >&2
    exit 2
    ;;
esac
