#!/usr/bin/env bash
# Install verl_hpc's GPU stack into the current Python environment, around the CUDA torch it has.
#
#   bash scripts/install_gpu.sh [--dry-run] [--python PY] [--vllm auto|yes|no] [--no-te] [SRC]
#
# Why a script and not `pip install .[gpu]`: Transformer Engine's torch extension
# (transformer_engine_torch) is source-only and must be compiled against the torch that is
# installed; pip's isolated build would fetch another torch and the extension would fail at import
# (undefined symbols). And TE's core library comes as one package per CUDA major version
# (core_cu12 / core_cu13), which no requirement marker can pick. So, in this order:
#   1. read torch's version and CUDA build from PY (torch must be there: the machine's CUDA torch);
#   2. vLLM at the verified release that goes with that torch (each vLLM wheel pins one torch: the
#      verified pairs are VLLM_FOR_TORCH, rollout/vllm/versions.py): --vllm auto installs vllm 0.25.0
#      beside torch 2.11, vllm 0.32.0 beside torch 2.13, and for any other torch says why it skips
#      vLLM (no verified vLLM keeps it); --vllm yes installs VLLM_VERSION there anyway;
#   3. transformer-engine[pytorch,core_cuNN] with --no-build-isolation, NN from torch.version.cuda
#      (needs nvcc and the CUDA headers; MAX_JOBS bounds the compile's parallelism);
#   4. megatron-core and peft (the FSDP engine's LoRA), then verl_hpc itself (editable) with its core
#      dependencies; the `gpu` extra is not used, so that the machine's torch stays.
# --dry-run prints the commands and runs none (the probe of PY's torch still runs).
# The same versions as setup.py and containers/install.sh (tests/unit/test_gpu_runtime_paths.py).
set -euo pipefail
VLLM_VERSION=0.32.0
MEGATRON_CORE_VERSION=0.16.1
TE_VERSION=2.11.0   # megatron-core 0.16.1 declares transformer-engine >=2.9,<2.12
TORCH_VERSION=2.13.0  # what vllm 0.32.0 pins
VLLM_FOR_TORCH="2.11.0=0.25.0 2.13.0=0.32.0"  # the verified range: torch=the vLLM whose wheel pins it
PEFT_VERSION=0.21.2  # the FSDP engine's LoRA (setup.py's gpu extra)

DRY=0 PY=${PYTHON:-python3} VLLM=auto TE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --python) PY=$2; shift 2 ;;
    --vllm) VLLM=$2; shift 2 ;;
    --no-te) TE=0; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "install_gpu.sh: unknown option '$1' (valid: --dry-run, --python PY, --vllm auto|yes|no, --no-te)" >&2; exit 2 ;;
    *) break ;;
  esac
done
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
case "$VLLM" in auto|yes|no) ;; *) echo "install_gpu.sh: --vllm '$VLLM': valid are auto, yes, no" >&2; exit 2 ;; esac

run() {  # print, then run unless --dry-run
  echo "+ $*"
  [ "$DRY" = 1 ] || "$@"
}

probe=$("$PY" -c 'import sys, torch; print(torch.__version__, torch.version.cuda or "none", "%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
  echo "install_gpu.sh: $PY has no torch. Install the CUDA torch for this machine first (e.g." \
       "'pip install torch==$TORCH_VERSION' for CUDA 13, or torch's cu12x index for CUDA 12), then rerun." >&2
  exit 2
}
read -r torch_version cuda_version py_version <<<"$probe"
cuda_major=${cuda_version%%.*}
echo "python $py_version, torch $torch_version, CUDA $cuda_version"
case "$cuda_major" in
  12|13) ;;
  *) echo "install_gpu.sh: torch $torch_version has CUDA '$cuda_version': a CUDA 12 or 13 build of torch is needed" >&2; exit 2 ;;
esac
# the verified vLLM for this torch, if there is one
paired=""
for pair in $VLLM_FOR_TORCH; do
  [ "${torch_version%%+*}" = "${pair%%=*}" ] && paired=${pair#*=}
done
[ -n "$paired" ] || \
  echo "WARNING: torch $torch_version is not one the verified vLLM releases pin (${VLLM_FOR_TORCH// /, }; torch=vLLM): the kit runs; results say so"

PIP=("$PY" -m pip install)
# 2. vLLM, the release that keeps this torch
if [ "$VLLM" = auto ]; then
  if [ -n "$paired" ]; then VLLM=yes; else
    VLLM=no
    echo "vLLM skipped: no verified vLLM pins torch ${torch_version%%+*} (${VLLM_FOR_TORCH// /, }; torch=vLLM), and vllm==$VLLM_VERSION would replace it by torch $TORCH_VERSION (--vllm yes to install it anyway)"
  fi
fi
[ "$VLLM" = yes ] && run "${PIP[@]}" "vllm==${paired:-$VLLM_VERSION}"
# 3. Transformer Engine, compiled against this torch
if [ "$TE" = 1 ]; then
  command -v nvcc >/dev/null || [ -n "${CUDA_HOME:-}" ] || \
    echo "WARNING: no nvcc on PATH and no CUDA_HOME: Transformer Engine's torch extension needs the CUDA toolkit to compile"
  run env MAX_JOBS="${MAX_JOBS:-8}" NVTE_FRAMEWORK=pytorch "${PIP[@]}" --no-build-isolation \
    "transformer-engine[pytorch,core_cu${cuda_major}]==$TE_VERSION"
fi
# 4. Megatron-Core, PEFT and the project (core dependencies only: the machine's torch stays)
run "${PIP[@]}" "megatron-core==$MEGATRON_CORE_VERSION" "peft==$PEFT_VERSION"
run "${PIP[@]}" -e "$SRC"
