#!/usr/bin/env bash
# Copies the built attnd and attnctl, and every shared library they load except the C library
# and the GPU driver, into a self-contained tree:
#   DEST/bin/attnd  DEST/bin/attnctl  DEST/lib/*.so*
# The image's runtime stage is exactly this tree on top of the CUDA runtime image (see
# deploy/Dockerfile). The C library is the base image's own (same distribution as the build
# stage); libcuda and libnvidia-* come from the host's driver through the NVIDIA container
# runtime and must never be baked in.
# Usage: deploy/stage-runtime.sh BUILD_DIR DEST
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 BUILD_DIR DEST" >&2
  exit 2
fi
build_dir=$1
dest=$2
binaries=("$build_dir/server/attnd" "$build_dir/client/attnctl")
for binary in "${binaries[@]}"; do
  [[ -x $binary ]] || { echo "stage-runtime: $binary is missing; build it first" >&2; exit 1; }
done

mkdir -p "$dest/bin" "$dest/lib"
install -m 0755 "${binaries[@]}" "$dest/bin/"

# Provided by the base image (glibc) or by the host driver (libcuda, libnvidia-*).
is_provided() {
  case "$1" in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|\
    libresolv.so.*|libutil.so.*|libcuda.so*|libnvidia-*) return 0 ;;
  esac
  return 1
}

count=0
while read -r name path; do
  if is_provided "$name"; then continue; fi
  if [[ ! -e $path ]]; then
    echo "stage-runtime: $name is not found by the loader (ldd says '$path')" >&2
    exit 1
  fi
  # -L: copy the file a soname link points to, under the soname the binaries ask for.
  cp -L "$path" "$dest/lib/$name"
  count=$((count + 1))
done < <(ldd "${binaries[@]}" | awk '/=>/ { print $1, $3 }' | sort -u)
echo "stage-runtime: $dest: ${#binaries[@]} binaries, $count libraries" \
     "($(du -sh "$dest" | cut -f1))" >&2
