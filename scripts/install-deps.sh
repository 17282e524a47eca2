#!/usr/bin/env bash
# Installs what attnd needs to build and test on Debian 12 (bookworm), from Debian packages.
# Idempotent: skips apt entirely when everything is already there. The CUDA toolkit is not
# installed here: the CUDA backend is built when /usr/local/cuda/bin/nvcc exists.
set -euo pipefail

# openssl: the trust tests make throwaway certificates with its CLI at test time.
# python3-*: the Python client (client/python) and its tests (tests/python): Debian's grpcio
# and protobuf, numpy, pytest, venv (the pip-install test), and torch (CPU) for the Llama model
# whose attention attnd serves in CI.
packages=(
  build-essential cmake ninja-build ccache pkg-config curl ca-certificates openssl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev
  python3 python3-grpcio python3-protobuf python3-numpy python3-pytest python3-venv
  python3-pip python3-setuptools python3-torch
)
# Tools of the end-to-end tests (tests/e2e), with ATTND_E2E_DEPS=1 (scripts/test.sh sets it):
# a real Prometheus (and promtool), npm to install buf, docker-compose to validate
# deploy/compose.yaml offline, python3-yaml to read the manifests.
e2e_packages=()
# npm alone, with ATTND_CLIENT_DEPS=1 (scripts/run.sh sets it): it installs buf, the reflection
# client behind scripts/grpcurl.
if [[ "${ATTND_CLIENT_DEPS:-0}" == 1 ]] && ! command -v npm >/dev/null; then
  e2e_packages+=(npm)
fi
if [[ "${ATTND_E2E_DEPS:-0}" == 1 ]]; then
  e2e_packages+=(prometheus docker-compose python3-yaml)
  # npm may come with a Node.js that is not Debian's (e.g. NodeSource's nodejs bundles npm);
  # Debian's npm package would conflict with it, so only ask for it when there is no npm.
  command -v npm >/dev/null || [[ " ${e2e_packages[*]} " == *" npm "* ]] || e2e_packages+=(npm)
fi

missing_of() {
  local package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
      echo "$package"
  done
}
mapfile -t missing < <(missing_of "${packages[@]}")
mapfile -t missing_e2e < <(missing_of "${e2e_packages[@]}")
if [[ ${#missing[@]} -eq 0 && ${#missing_e2e[@]} -eq 0 ]]; then
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
apt_install() {
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
$sudo apt-get update -qq
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "install-deps: installing ${missing[*]}" >&2
  apt_install "${missing[@]}"
fi
if [[ ${#missing_e2e[@]} -gt 0 ]]; then
  echo "install-deps: installing e2e test tools ${missing_e2e[*]}" >&2
  # The build does not need these: without them the e2e tests say loudly that they skip
  # (and fail under CI=true).
  if ! apt_install "${missing_e2e[@]}"; then
    echo "install-deps: WARNING: could not install ${missing_e2e[*]}; e2e tests will skip" >&2
  fi
fi
