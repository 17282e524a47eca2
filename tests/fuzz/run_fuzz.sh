#!/usr/bin/env bash
# Builds attnd_request_fuzzer (clang-14, libFuzzer + ASan + UBSan, CPU only) and fuzzes the
# request path for a bounded time from the committed seed corpus (tests/fuzz/corpus).
#
# Fails on any crash, sanitizer report, leak, out-of-memory, timeout (a hang) or broken harness
# invariant; libFuzzer then leaves the input under $build_dir/fuzz-artifacts/ (reproduce with
# `attnd_request_fuzzer <file>`, or ATTND_FUZZ_VERBOSE=1 for a line per request). Prints
# libFuzzer's final stats and the coverage reached.
#
#   ATTND_FUZZ_SECONDS   fuzzing time (default 90)
#   ATTND_FUZZ_BUILD_DIR build tree (default build-fuzz)
#   ATTND_JOBS           build parallelism (default nproc)
set -euo pipefail
cd "$(dirname "$0")/../.."
build_dir=${ATTND_FUZZ_BUILD_DIR:-build-fuzz}
seconds=${ATTND_FUZZ_SECONDS:-90}
jobs=${ATTND_JOBS:-$(nproc)}

# libFuzzer ships with clang's runtime (libclang-rt-14-dev); neither is in install-deps.sh's set.
missing=()
for package in clang-14 libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "run_fuzz: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

if [[ ! -f $build_dir/build.ninja ]]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DATTND_CUDA=OFF \
    -DATTND_SANITIZE=address,undefined -DATTND_FUZZ=ON >/dev/null
fi
cmake --build "$build_dir" -j "$jobs" --target attnd_request_fuzzer

# New inputs go to a scratch corpus; the committed seeds are only read.
work_corpus="$build_dir/fuzz-corpus"
artifacts="$build_dir/fuzz-artifacts"
rm -rf "$work_corpus"
mkdir -p "$work_corpus" "$artifacts"
log="$build_dir/fuzz.log"
echo "run_fuzz: fuzzing the request path for ${seconds} s (log: $log)" >&2
set +e
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  "$build_dir/tests/fuzz/attnd_request_fuzzer" "$work_corpus" tests/fuzz/corpus \
    -max_total_time="$seconds" -max_len=32768 -rss_limit_mb=2048 -timeout=30 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" >"$log" 2>&1
status=$?
set -e

# The last status line carries the coverage: "#N DONE cov: C ft: F corp: ..."
grep -E '^#[0-9]+' "$log" | tail -n 1 >&2 || true
grep -E '^stat::' "$log" >&2 || true
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
if [[ $status -ne 0 ]] || grep -qE '^==[0-9]+==ERROR|^SUMMARY: |invariant broken' "$log"; then
  echo "run_fuzz: FAILED (exit $status); the end of the log:" >&2
  tail -n 60 "$log" >&2
  ls -l "$artifacts" >&2
  exit 1
fi
if [[ -z $runs || $runs -eq 0 ]]; then
  echo "run_fuzz: FAILED: the fuzzer ran no input" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
echo "run_fuzz: passed: $runs inputs, no crash, leak, hang or broken invariant" >&2
