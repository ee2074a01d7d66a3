#!/usr/bin/env bash
# The vLLM kit's CPU check (make gpu-vllm-kit-check; docs/gpu.md): the kit installed as the offline
# GPU node installs it, on this machine, and what an engine imports.
#
#   bash scripts/check_vllm_kit.sh [PYTHON]   # default: the first of python3.12 (the node's), 3.11, 3 that runs
#
# 1. "the image": a venv of PYTHON with what the GPU node brings (PyPI's torch 2.11.0, the CUDA
#    build, which runs on a CPU; numba) and the kit folder's wheels installed offline (wheels.py);
#    made once in build/vllm_kit_check/image-X.Y (FRESH=1 makes it again), and it never holds vLLM;
# 2. the vLLM kit's pieces (vllm_kit.py, for PYTHON's version), each stashed on its own as a transfer
#    brings it, then verified, assembled and installed offline (--no-index) into a new, empty folder
#    on PYTHONPATH (vllm_pieces.py install --target);
# 3. the probe (vllm_kit_probe.py): `from vllm import LLM`, the engine's modules, and LLM(tiny model)
#    failing for want of a GPU, not for a missing module.
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

if [ "${FRESH:-0}" = 1 ] || [ ! -x "$IMAGE/bin/python" ] || [ ! -f "$IMAGE/.ready" ]; then
  rm -rf "$IMAGE"
  "$PY" -m venv "$IMAGE"
  "$IMAGE/bin/pip" install -q torch==2.11.0 numba==0.65.0          # the GPU node's image
  "$IMAGE/bin/pip" install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
  touch "$IMAGE/.ready"
fi
if "$IMAGE/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "check_vllm_kit: $IMAGE holds vLLM: not the node's image (FRESH=1 remakes it)" >&2
  exit 2
fi

# each piece on its own, as a transfer carries it with the manifest
HOME_DIR=$OUT/home; SITE=$OUT/site
rm -rf "$HOME_DIR" "$SITE" "$OUT/transfer"
for piece in $("$PY" -c 'import json, sys; print(" ".join(p["name"] for p in json.load(open(sys.argv[1]))["pieces"]))' "$KIT/MANIFEST.json"); do
  mkdir -p "$OUT/transfer"
  cp "$KIT/MANIFEST.json" "$KIT/$piece" "$OUT/transfer/"
  "$IMAGE/bin/python" -m verl_hpc.gpu_check.vllm_pieces stash "$OUT/transfer" --home "$HOME_DIR"
  rm -rf "$OUT/transfer"
done
start=$(date +%s)
"$IMAGE/bin/python" -m verl_hpc.gpu_check.vllm_pieces install --home "$HOME_DIR" --target "$SITE"
echo "assembled and installed in $(( $(date +%s) - start )) s: $(du -sm "$SITE" | cut -f1) MB in $SITE"

MODEL=$OUT/tiny_llama
[ -f "$MODEL/config.json" ] || "$PROJECT_PY" -c "from verl_hpc.models.tiny import make_tiny_model; make_tiny_model('$MODEL', 'llama', layers=2)"
PYTHONPATH="$SITE:$PWD" "$IMAGE/bin/python" -m verl_hpc.gpu_check.vllm_kit_probe --model "$MODEL"
echo "check_vllm_kit: PASS (Python $VER, $(du -sh "$KIT" | cut -f1) of pieces)"
