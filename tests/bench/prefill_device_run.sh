#!/usr/bin/env bash
# One device call for batch prefill (issue 4): SASS check of the Hopper kernel, the GPU tests,
# compute-sanitizer memcheck on the small sweeps, then prefill_bench for both kernels and the torch
# baseline in the same run. Expects the binaries bundled by
#   /work/shared/tools/gpu-bundle .gpu-hopper build-hopper/tests/kernels/prefill_tests build-hopper/bench/prefill_bench
# (cuBLAS is left out of the bundle: too large to carry; the device image has it). Writes logs
# under $OUT. Usage: tests/bench/prefill_device_run.sh [STAGES...] (default, most needed first:
# sass hopper bench sanitizer rest; racecheck (with synccheck), ncu and ncufull on request).
# Every command runs under `timeout -k` (no daemons here, so no stack dumps).
set -o pipefail
cd "$(dirname "$0")/../.."
B=.gpu-hopper
OUT=${OUT:-/tmp/prefill-out}
mkdir -p "$OUT"
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$PWD/$B/lib${cublas:+:$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
stages=${*:-sass hopper bench sanitizer rest}
timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
for stage in $stages; do
  case $stage in
    sass)
      echo "== SASS of the Hopper kernels"
      timeout -k 10 120 cuobjdump --dump-sass $B/bin/prefill_tests > "$OUT/sass.txt" 2>&1
      awk '/Function : /{name=$3} /HGMMA/{h[name]++} /HMMA/{m[name]++} END{for(n in h) if (n ~ /Hopper/) print "HGMMA", h[n], n; c=0; for(n in m) c++; print "functions with HMMA:", c}' "$OUT/sass.txt"
      ;;
    hopper)
      echo "== prefill_tests: a small Hopper case first (a hang shows in 60 s), then every Hopper test"
      timeout -k 10 60 $B/bin/prefill_tests --gtest_filter='BatchPrefillHopperTest.FullyMasked*' > "$OUT/tests_smoke.log" 2>&1
      rc=$?; echo "rc=$rc"; tail -5 "$OUT/tests_smoke.log"
      if [[ $rc == 124 || $rc == 137 ]]; then echo "HANG: skipping the Hopper kernel from here"; export HOPPER_HANG=1; fi
      [[ -n $HOPPER_HANG ]] || timeout -k 10 200 $B/bin/prefill_tests --gtest_filter='*Hopper*:PrefillPlan*' > "$OUT/tests_hopper.log" 2>&1; echo "rc=$?"
      grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran|Failure|Expected|Which is|Value of|error" "$OUT/tests_hopper.log" | head -40
      ;;
    rest)
      echo "== prefill_tests: the rest (kAuto runs 128-row tiles on the Hopper kernel on sm_90)"
      timeout -k 10 200 $B/bin/prefill_tests --gtest_filter='-*Hopper*:PrefillPlan*' > "$OUT/tests_rest.log" 2>&1; echo "rc=$?"
      grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran|Failure|Expected|Which is|Value of|error" "$OUT/tests_rest.log" | head -30
      ;;
    sanitizer)
      echo "== compute-sanitizer memcheck, sanitizer sweeps"
      filter='*SanitizerSweep*'; [[ -z $HOPPER_HANG ]] || filter='BatchPrefillTest.SanitizerSweep'
      timeout -k 10 150 compute-sanitizer --tool memcheck --error-exitcode 3 $B/bin/prefill_tests --gtest_filter="$filter" > "$OUT/memcheck.log" 2>&1; echo "rc=$?"
      grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) |Invalid|out of bounds" "$OUT/memcheck.log" | head -20
      ;;
    racecheck)
      echo "== compute-sanitizer racecheck, one small Hopper case"
      timeout -k 10 120 compute-sanitizer --tool racecheck --error-exitcode 3 $B/bin/prefill_tests --gtest_filter='BatchPrefillHopperTest.FullyMasked*' > "$OUT/racecheck.log" 2>&1; echo "rc=$?"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|^\[  (PASSED|FAILED) " "$OUT/racecheck.log" | head -20
      echo "== compute-sanitizer synccheck, same case"
      timeout -k 10 120 compute-sanitizer --tool synccheck --error-exitcode 3 $B/bin/prefill_tests --gtest_filter='BatchPrefillHopperTest.FullyMasked*' > "$OUT/synccheck.log" 2>&1; echo "rc=$?"
      grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " "$OUT/synccheck.log" | head -10
      ;;
    ncu)
      echo "== ncu, Hopper kernel, noncausal 1x2048"
      timeout -k 10 200 ncu --kernel-name regex:HopperPrefill --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats \
        $B/bin/prefill_bench --only="noncausal 1x2048" > "$OUT/ncu.txt" 2>&1; echo "rc=$?"
      grep -E "Duration|Throughput|Pipe|Stall|Warp Cycles|Eligible|Issued Warp|Registers|Achieved Occupancy|Hit Rate|Bank|Tensor|ERROR|error" "$OUT/ncu.txt" | head -50
      ;;
    ncufull)
      echo "== ncu --set full, Hopper kernel, noncausal 1x2048: details and per-instruction SASS with stall samples"
      timeout -k 10 300 ncu --set full --import-source no --kernel-name regex:HopperPrefill --launch-skip 2 --launch-count 1 \
        -o "$OUT/prof" $B/bin/prefill_bench --only="noncausal 1x2048" > "$OUT/ncu_run.txt" 2>&1; echo "rc=$?"
      tail -3 "$OUT/ncu_run.txt"
      timeout -k 10 120 ncu -i "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
      timeout -k 10 120 ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2>&1
      timeout -k 10 120 ncu -i "$OUT/prof.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
      rm -f "$OUT/prof.ncu-rep"
      ls -la "$OUT"; grep -iE "stall|Warp Cycles" "$OUT/details.txt" | head -20
      ;;
    bench)
      echo "== prefill_bench (mma.sync, then auto = Hopper on sm_90) and torch"
      timeout -k 10 200 $B/bin/prefill_bench --kernel=mma --csv="$OUT/mma.csv" 2>&1 | grep -v "plan\|launch\|split" | tee "$OUT/bench_mma.log"
      [[ -n $HOPPER_HANG ]] || timeout -k 10 200 $B/bin/prefill_bench --csv="$OUT/hopper.csv" 2>&1 | grep -v "plan\|launch \|split" | tee "$OUT/bench_hopper.log"
      (cd "$OUT" && timeout -k 10 200 python3 "$OLDPWD/tests/bench/torch_prefill_baseline.py" --ours mma.csv $([[ -f hopper.csv ]] && echo --ours hopper.csv)) 2>&1 | tee "$OUT/torch.log"
      ;;
  esac
done
