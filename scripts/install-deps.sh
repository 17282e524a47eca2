#!/usr/bin/env bash
# Installs what attnd needs to build and test on Debian 12 (bookworm), from Debian packages.
# Idempotent: skips apt entirely when everything is already there. The CUDA toolkit is not
# installed here: the CUDA backend is built when /usr/local/cuda/bin/nvcc exists.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config curl ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev
)
# Extra tools for the end-to-end tests (a real Prometheus, and buf via npm).
if [[ "${ATTND_E2E_DEPS:-0}" == 1 ]]; then
  packages+=(prometheus nodejs npm)
fi

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
