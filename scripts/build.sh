#!/usr/bin/env bash
# Configures and builds attnd into ${ATTND_BUILD_DIR:-build}. Extra arguments go to cmake's
# configure step (e.g. -DATTND_CUDA=OFF, -DATTND_CUDA_ARCHITECTURES="80;90").
# ATTND_BUILD_TARGETS (space-separated) builds only those targets (scripts/run.sh: attnd attnctl).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${ATTND_BUILD_DIR:-build}
jobs=${ATTND_JOBS:-$(nproc)}
if [[ ! -f $build_dir/build.ninja ]] || [[ $# -gt 0 ]]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=${ATTND_BUILD_TYPE:-RelWithDebInfo} "$@"
fi
targets=()
for target in ${ATTND_BUILD_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
