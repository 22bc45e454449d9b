#!/usr/bin/env bash
# `make images`:      build every image target of ./Dockerfile with buildah (no Docker daemon, no registry)
# `make test-images`: build them, then run each built image as its manifest runs it (tests/images)
#   scripts/images.sh build|test [--bases local|public] [TARGET ...]
# Installs the daemonless container tools with apt when they are missing (as root), the way
# scripts/setup.sh installs redis-server; the rest is kvpool_dev.images (docs/helm.md, "Images").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mode=${1:?usage: scripts/images.sh build|test [--bases local|public] [TARGET ...]}
shift

# buildah builds, podman runs; runc where crun refuses the host's cgroups; mmdebstrap makes the base.
need=()
for tool in buildah podman runc mmdebstrap; do command -v "$tool" >/dev/null 2>&1 || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "[images] installing ${need[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

"$PY" -m kvpool_dev.images.build "$@"
if [ "$mode" = test ]; then
  KVPOOL_IMAGES=out/images/build.json "$PY" -m pytest tests/images -p no:cacheprovider
fi
