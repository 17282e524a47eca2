# The "pack" half of the device scripts (scripts/issue14-device-run.sh, issue15-device-run.sh,
# shapes-device-run.sh), and the unpacking their "run" half starts with. Sourced, not run.
#
#   device_pack NAME BINARY...
#       bundles the binaries with their shared libraries (/work/shared/tools/gpu-bundle; cuBLAS
#       left out: the device has it, and a call carries at most 64 MiB) into
#       .gpu-pack/NAME.tar.xz, and the commit they were built from (+dirty when the tree differs)
#       into .gpu-pack/NAME.commit. On the device the bundle unpacks to /tmp/NAME; run a program
#       as /tmp/NAME/run PROGRAM ARGS.

#   device_unpack NAME SUMMARY
#       on the device: unpacks .gpu-pack/NAME.tar.xz into /tmp/NAME, puts the device's cuBLAS on
#       LD_LIBRARY_PATH (the bundle leaves it out) and starts SUMMARY with "commit ... on GPU,
#       driver" (also on stdout); returns 1 when the bundle does not unpack.

#   device_xz NAME OUT
#       tars .gpu-pack/NAME into OUT, xz-compressed with a 192 MiB dictionary in one thread: the
#       kernels' fatbins repeat in every test binary, and a window that spans binaries stores them
#       once (the full regression bundle: 15 MB against 50-64 MB at xz -6, which with the working
#       tree overflowed a call's 64 MiB).

device_xz() {
  tar -C .gpu-pack -cf - "$1" | xz -T1 --lzma2=preset=6,dict=192MiB > "$2"
}

device_pack() {
  local name=$1; shift
  rm -rf ".gpu-pack/$name" && mkdir -p .gpu-pack || return 1
  /work/shared/tools/gpu-bundle ".gpu-pack/$name" "$@" || return 1
  rm -f ".gpu-pack/$name"/lib/libcublas*
  device_xz "$name" ".gpu-pack/$name.tar.xz" && rm -rf ".gpu-pack/$name" || return 1
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-pack' || echo '+dirty')" \
    > ".gpu-pack/$name.commit"
  ls -la ".gpu-pack/$name.tar.xz"
}

device_unpack() {
  local name=$1 summary=$2 cublas
  timeout -k 10 120 tar -C /tmp -xJf ".gpu-pack/$name.tar.xz" || return 1
  cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.1*' 2>/dev/null | head -1)
  export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "commit $(cat ".gpu-pack/$name.commit" 2>/dev/null) on" \
    "$(timeout -k 2 20 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)" |
    tee "$summary"
}
