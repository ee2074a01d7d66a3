#!/usr/bin/env bash
# Build the Enroot/pyxis image (a squashfs file) for CONTAINER=pyxis in launch/*.sbatch.
# Run on a machine with Docker (or Podman as `docker`) and Enroot, from anywhere:
#
#   containers/enroot/build.sh                      -> containers/enroot/verl_hpc.sqsh
#   NGC_TAG=26.05-py3 OUT=/shared/images/verl_hpc.sqsh containers/enroot/build.sh
#
# Steps: build containers/Dockerfile (verl_hpc:gpu), add the Enroot settings
# (containers/enroot/Dockerfile -> verl_hpc:enroot), then `enroot import dockerd://` turns the
# local Docker image into one squashfs file that pyxis mounts on every node. Without a local
# Docker daemon: push verl_hpc:enroot to a registry and run
#   enroot import -o verl_hpc.sqsh 'docker://REGISTRY#verl_hpc:enroot'
# (Enroot separates the registry host with '#'). Put the .sqsh on a filesystem every node reads.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
: "${NGC_TAG:=26.05-py3}"
: "${OUT:=$ROOT/containers/enroot/verl_hpc.sqsh}"
for tool in docker enroot; do
  command -v "$tool" >/dev/null || { echo "build.sh: '$tool' not found (see containers/README.md)" >&2; exit 1; }
done

docker build -f "$ROOT/containers/Dockerfile" --build-arg NGC_TAG="$NGC_TAG" -t verl_hpc:gpu "$ROOT"
docker build -f "$ROOT/containers/enroot/Dockerfile" --build-arg BASE=verl_hpc:gpu -t verl_hpc:enroot \
  "$ROOT/containers/enroot"
rm -f "$OUT"
enroot import -o "$OUT" dockerd://verl_hpc:enroot
echo "built $OUT; use: CONTAINER=pyxis IMAGE=$OUT sbatch launch/grpo_8b.sbatch"
