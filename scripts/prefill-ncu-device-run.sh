#!/usr/bin/env bash
# ncu on the Hopper prefill, one launch per case, with per-instruction stall samples: where a
# work's time goes at the SASS level (the short prompts' ~7 us a work, docs/benchmarks.md).
# Two halves:
#   scripts/prefill-ncu-device-run.sh pack   (here: builds prefill_bench, bundles it into
#                                             .gpu-pack/prefill_ncu.tar.xz; cuBLAS left out)
#   scripts/prefill-ncu-device-run.sh run    (on the device, carrying .gpu-pack; per case
#                                             $OUT/CASE.ncu-rep, CASE_sass.csv.xz, CASE_details.csv
#                                             and the top instructions by stall samples in
#                                             $OUT/summary.txt)
# PREFILL_NCU_CASES picks the cases (default c128x64,c8x2048). ncu runs with --clock-control
# none (the device notes: leave the clocks alone). Every step runs under `timeout -k`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build_dir=${ATTND_BUILD_DIR:-build}
cases=${PREFILL_NCU_CASES:-c128x64,c8x2048}

case ${1:-} in
  pack)
    cmake --build "$build_dir" -j "${ATTND_JOBS:-$(nproc)}" --target prefill_bench >/dev/null || exit 1
    source scripts/device_pack.sh
    device_pack prefill_ncu "$build_dir/bench/prefill_bench" || exit 1
    ;;
  run)
    OUT=${OUT:-/tmp/prefill-ncu-out}
    mkdir -p "$OUT"
    S=$OUT/summary.txt
    source scripts/device_pack.sh
    device_unpack prefill_ncu "$S" || exit 1
    B=/tmp/prefill_ncu
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    if [[ -z $ncu ]]; then
      echo "no ncu on this machine" | tee -a "$S"
      exit 1
    fi
    for c in ${cases//,/ }; do
      echo "== $c" | tee -a "$S"
      # The bench launches each case a few times before timing it: the 6th Hopper launch is a
      # warm one. The bundle's run wrapper sets the library path; ncu wraps the program itself.
      timeout -k 10 240 "$ncu" --clock-control none -k regex:HopperPrefill --launch-skip 5 -c 1 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
        -f -o "$OUT/$c" "$B/run" prefill_bench --cases="$c" > "$OUT/${c}_ncu.log" 2>&1
      echo "ncu rc=$?" | tee -a "$S"
      [[ -f $OUT/$c.ncu-rep ]] || continue
      timeout -k 10 120 "$ncu" -i "$OUT/$c.ncu-rep" --page details --csv > "$OUT/${c}_details.csv" 2>&1
      timeout -k 10 120 "$ncu" -i "$OUT/$c.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/${c}_sass.csv" 2>&1
      grep -E '"(Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued Instruction|Issue Slots Busy)"' \
        "$OUT/${c}_details.csv" | cut -d, -f12- | head -12 | tee -a "$S"
      timeout -k 10 120 python3 - "$OUT/${c}_sass.csv" <<'PY' | tee -a "$S"
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
header = next((i for i, r in enumerate(rows) if any("Samples" in c for c in r)), None)
if header is None:
    print("no stall-sample columns"); sys.exit(0)
cols = rows[header]
src = next(i for i, c in enumerate(cols) if c.strip('"') in ("Source", "SASS"))
allc = next(i for i, c in enumerate(cols) if "Warp Stall Sampling (All" in c)
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return 0.0
body = [r for r in rows[header + 1:] if len(r) > max(src, allc)]
total = sum(num(r[allc]) for r in body) or 1.0
print(f"samples {total:.0f} over {len(body)} instructions; top 40:")
for r in sorted(body, key=lambda r: -num(r[allc]))[:40]:
    print(f"{100 * num(r[allc]) / total:5.1f}%  {r[0][:10]:>10}  {r[src][:90]}")
PY
      xz -T1 -6 "$OUT/${c}_sass.csv"
    done
    ;;
  *)
    echo "usage: $0 pack | run" >&2
    exit 2
    ;;
esac
