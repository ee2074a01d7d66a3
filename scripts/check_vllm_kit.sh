#!/usr/bin/env bash
# The vLLM kit's CPU check (make gpu-vllm-kit-check; docs/gpu.md): the kit installed as the offline
# GPU node installs it (into the prefix over the image), on this machine, and what an engine imports.
#
#   bash scripts/check_vllm_kit.sh [PYTHON]   # default: the first of python3.12 (the node's), 3.11, 3 that runs
#
# 1. "the image": a venv of PYTHON with what the GPU node brings (PyPI's torch 2.11.0, the CUDA
#    build, which runs on a CPU; numba), made once in build/vllm_kit_check/image-X.Y (FRESH=1 makes
#    it again); it never holds vLLM nor the kit folder;
# 2. the kits' prefix over it (image.py, as gpu-all makes it on the node): the kit folder's wheels
#    (wheels.py) installed offline into it, then the vLLM kit's pieces (vllm_kit.py, for PYTHON's
#    version), each stashed on its own as a transfer brings it, verified, assembled and installed
#    offline (--no-index) with the prefix's Python; the image's package list before and after must
#    be the same;
# 3. the probe (vllm_kit_probe.py) with the prefix's Python: `from vllm import LLM`, the engine's
#    modules, and LLM(tiny model) failing for want of a GPU, not for a missing module.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-}
if [ -z "$PY" ]; then  # the first that runs (a pyenv shim may exist for a version it does not select)
  for p in python3.12 python3.11 python3; do if "$p" -c pass 2>/dev/null; then PY=$p; break; fi; done
fi
PROJECT_PY=${PROJECT_PY:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
VER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
OUT=build/vllm_kit_check
IMAGE=$OUT/image-$VER
if [ "$VER" = 3.12 ]; then KIT=${KIT:-gpu_vllm_kit}; WHEELS=${WHEELS:-gpu_check_wheels}  # what travels
else KIT=${KIT:-$OUT/kit-$VER}; WHEELS=${WHEELS:-$OUT/wheels-$VER}; fi
mkdir -p "$OUT"

[ -f "$KIT/MANIFEST.json" ] || "$PROJECT_PY" -m verl_hpc.gpu_check.vllm_kit "$KIT" --python-version "$VER"
[ -f "$WHEELS/requirements.txt" ] || "$PROJECT_PY" -m verl_hpc.gpu_check.wheels "$WHEELS" --python-version "$VER"
kit_py=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python"])' "$KIT/MANIFEST.json")
if [ "$kit_py" != "$VER" ]; then
  echo "check_vllm_kit: $KIT is built for Python $kit_py, not $VER (make gpu-vllm-kit GPU_VLLM_KIT_ARGS=--python-version $VER)" >&2
  exit 2
fi

if [ "${FRESH:-0}" = 1 ] || [ ! -x "$IMAGE/bin/python" ] || [ ! -f "$IMAGE/.image-only" ]; then
  rm -rf "$IMAGE"   # an image of an older check also held the kit folder: made again
  "$PY" -m venv "$IMAGE"
  "$IMAGE/bin/pip" install -q torch==2.11.0 numba==0.65.0          # the GPU node's image
  touch "$IMAGE/.image-only"
fi
if "$IMAGE/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "check_vllm_kit: $IMAGE holds vLLM: not the node's image (FRESH=1 remakes it)" >&2
  exit 2
fi

# the prefix over the image, as gpu-all makes it; the image's packages listed before and after
HOME_DIR=$OUT/home; PREFIX=$OUT/prefix-$VER
rm -rf "$HOME_DIR" "$PREFIX" "$OUT/transfer"
PYPY=$("$IMAGE/bin/python" -m verl_hpc.gpu_check.image prefix "$PREFIX" --record "$OUT/image-before.txt")
"$PYPY" -m pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
# each piece on its own, as a transfer carries it with the manifest
for piece in $("$PY" -c 'import json, sys; print(" ".join(p["name"] for p in json.load(open(sys.argv[1]))["pieces"]))' "$KIT/MANIFEST.json"); do
  mkdir -p "$OUT/transfer"
  cp "$KIT/MANIFEST.json" "$KIT/$piece" "$OUT/transfer/"
  "$IMAGE/bin/python" -m verl_hpc.gpu_check.vllm_pieces stash "$OUT/transfer" --home "$HOME_DIR"
  rm -rf "$OUT/transfer"
done
start=$(date +%s)
"$PYPY" -m verl_hpc.gpu_check.vllm_pieces install --home "$HOME_DIR"
SITE=$("$PYPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "assembled and installed in $(( $(date +%s) - start )) s: $(du -sm "$SITE" | cut -f1) MB in $SITE"
"$IMAGE/bin/python" -m verl_hpc.gpu_check.image list > "$OUT/image-after.txt"
if ! cmp -s "$OUT/image-before.txt" "$OUT/image-after.txt"; then
  echo "check_vllm_kit: the install changed the image's packages:" >&2
  diff "$OUT/image-before.txt" "$OUT/image-after.txt" >&2 || true
  exit 1
fi

MODEL=$OUT/tiny_llama
[ -f "$MODEL/config.json" ] || "$PROJECT_PY" -c "from verl_hpc.models.tiny import make_tiny_model; make_tiny_model('$MODEL', 'llama', layers=2)"
PYTHONPATH="$PWD" "$PYPY" -m verl_hpc.gpu_check.vllm_kit_probe --model "$MODEL"
echo "check_vllm_kit: PASS (Python $VER, $(du -sh "$KIT" | cut -f1) of pieces, the image's packages unchanged)"
