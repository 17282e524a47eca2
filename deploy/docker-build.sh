#!/usr/bin/env bash
# Builds the attnd image from deploy/Dockerfile with the repository root as context.
#   deploy/docker-build.sh [TAG] [extra docker build args...]
# e.g. deploy/docker-build.sh attnd:dev --build-arg CUDA_ARCHITECTURES="80;90"
# Needs a Docker engine with BuildKit (for deploy/Dockerfile.dockerignore); running the image
# with a GPU needs the NVIDIA Container Toolkit on the host.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-attnd:dev}
shift || true
if ! docker info >/dev/null 2>&1; then
  echo "docker-build: no Docker engine answers here ('docker info' failed); nothing built" >&2
  exit 1
fi
DOCKER_BUILDKIT=1 docker build -f deploy/Dockerfile -t "$tag" "$@" .
echo "docker-build: built $tag. Run it with:" >&2
echo "  docker run --rm --gpus all -p 50051:50051 -p 9400:9400 $tag" >&2
echo "or the whole stack (attnd + Prometheus + Grafana): docker compose -f deploy/compose.yaml up" >&2
