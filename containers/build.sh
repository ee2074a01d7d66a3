#!/usr/bin/env bash
# Build the CPU image verl_hpc:cpu with Charliecloud, without an image registry (`make container`):
#
#   1. a Debian bookworm base root filesystem made by mmdebstrap from Debian's package archive,
#      cached as a tarball (CACHE below) and imported into Charliecloud's storage once;
#   2. containers/Dockerfile on top with BASE=that base and EXTRA=cpu (containers/install.sh),
#      through ch-image's build cache: a rebuild after a code change reruns only the project layer.
#
#   containers/build.sh            build (or refresh) verl_hpc:cpu; prints the image directory
#   containers/build.sh --print    print the image directory only (nothing is built)
#
# Environment: CH_IMAGE_STORAGE (Charliecloud storage, default /var/tmp/$USER.ch),
# VERL_HPC_CONTAINER_CACHE (base tarball, default ~/.cache/verl_hpc/containers),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), TAG (default verl_hpc:cpu).
# Needs root or unprivileged user namespaces; Debian packages: charliecloud mmdebstrap git.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export USER=${USER:-$(id -un)}
export CH_IMAGE_STORAGE=${CH_IMAGE_STORAGE:-/var/tmp/$USER.ch}
CACHE=${VERL_HPC_CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/verl_hpc/containers}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TAG=${TAG:-verl_hpc:cpu}
BASE_TAG=verl_hpc-base:bookworm
IMAGE_DIR="$CH_IMAGE_STORAGE/img/${TAG//:/+}"
if [ "${1:-}" = "--print" ]; then echo "$IMAGE_DIR"; exit 0; fi

# A fresh Debian/Ubuntu machine (CI): install the builders, as start.sh does for Slurm.
if ! command -v ch-image >/dev/null || ! command -v mmdebstrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q charliecloud mmdebstrap git
  fi
fi
for tool in ch-image ch-run mmdebstrap git; do
  command -v "$tool" >/dev/null || {
    echo "build.sh: '$tool' not found; install Debian's charliecloud, mmdebstrap and git packages" >&2; exit 1; }
done
# ch-image is a Python program that needs Debian's python3-lark: run it with the system Python
# even where another python3 (pyenv, a venv) comes first on PATH.
ch_image() { PATH="/usr/bin:/bin:$PATH" nice ch-image "$@"; }
stamp() { printf '[build.sh %s] %s\n' "$(date +%T)" "$*"; }
t0=$(date +%s)

# 1. Base root filesystem. `minbase` + ca-certificates: apt and TLS for pip, nothing else.
mkdir -p "$CACHE"
BASE_TAR="$CACHE/bookworm-minbase.tar.gz"
if [ ! -s "$BASE_TAR" ]; then
  stamp "mmdebstrap bookworm -> $BASE_TAR"
  # (mmdebstrap picks the output format from the file name: the partial file keeps the suffix)
  nice mmdebstrap --variant=minbase --include=ca-certificates bookworm "$CACHE/partial.tar.gz" "$MIRROR"
  mv "$CACHE/partial.tar.gz" "$BASE_TAR"
fi
# (tested on the storage directory: `ch-image list NAME` also asks the image registry, which fails
# without one, so it would re-import the base on every build)
if [ ! -d "$CH_IMAGE_STORAGE/img/${BASE_TAG//:/+}" ]; then
  stamp "import $BASE_TAR as $BASE_TAG"
  ch_image import "$BASE_TAR" "$BASE_TAG"
fi

# 2. The torch CPU wheel where this machine's pip finds it locally (see containers/install.sh).
mkdir -p "$ROOT/containers/local"
links=$( { python3 -m pip config get global.find-links 2>/dev/null || true; echo "${PIP_FIND_LINKS:-}"; } | tr ' ' '\n')
for dir in $links; do
  dir=${dir#file://}
  for whl in "$dir"/torch-2.13.0+cpu-cp311-*x86_64.whl; do
    if [ -f "$whl" ] && [ ! -f "$ROOT/containers/local/$(basename "$whl")" ]; then
      stamp "using local wheel $whl"
      ln "$whl" "$ROOT/containers/local/" 2>/dev/null || cp "$whl" "$ROOT/containers/local/"
    fi
  done
done

# The CA bundle this machine's pip trusts (an inspecting proxy's CA is in it, not in Debian's).
cert=$(python3 -m pip config get global.cert 2>/dev/null || echo "${PIP_CERT:-}")
# (copied only when it changed, keeping its time: ch-image's cache key for a COPY includes the
# files' modification times, and a new key here would reinstall every Python dependency)
if [ -n "$cert" ] && [ -f "$cert" ] && ! cmp -s "$cert" "$ROOT/containers/local/ca-certificates.crt"; then
  cp -p "$cert" "$ROOT/containers/local/ca-certificates.crt"
fi

# 3. The image. --force: ch-image's workarounds that let apt-get run as an unprivileged root.
stamp "ch-image build $TAG (storage $CH_IMAGE_STORAGE)"
ch_image build --cache --force -f "$ROOT/containers/Dockerfile" \
  --build-arg BASE="$BASE_TAG" --build-arg EXTRA=cpu -t "$TAG" "$ROOT"
[ -x "$IMAGE_DIR/usr/bin/python3" ] || { echo "build.sh: $IMAGE_DIR has no python3 after the build" >&2; exit 1; }
stamp "built $TAG in $(( $(date +%s) - t0 ))s; $(du -sh "$IMAGE_DIR" | cut -f1) at $IMAGE_DIR"
echo "$IMAGE_DIR"
