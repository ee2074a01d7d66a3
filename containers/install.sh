#!/usr/bin/env bash
# Install verl_hpc with its `gpu` extra into an NGC PyTorch image. One recipe, called by
# containers/Dockerfile (RUN) and containers/verl_hpc.def (%post), so the two images match.
#
#   bash containers/install.sh /opt/verl_hpc     (source copied there beforehand)
#
# Not run on the development machine (no CUDA, no container runtime): see containers/README.md.
set -euxo pipefail
SRC=${1:-/opt/verl_hpc}
export PIP_NO_CACHE_DIR=1
# NGC images run a system Python; a no-op on images without the PEP 668 marker.
export PIP_BREAK_SYSTEM_PACKAGES=1

# h5ls/h5dump: inspect HDF5 checkpoints inside the container like on the host.
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends hdf5-tools
rm -rf /var/lib/apt/lists/*

# NGC pins its own torch build through /etc/pip/constraint.txt. vLLM wheels pin an exact PyPI
# torch, so that pin cannot be honoured: we deliberately take vLLM's torch (and the matching
# torchvision/torchaudio it pins) and drop NGC's constraints.
[ -f /etc/pip/constraint.txt ] && : > /etc/pip/constraint.txt

# Packages NGC compiled against its own torch break (undefined symbols) once torch is replaced.
# transformer-engine is rebuilt below; the others are not used by verl_hpc (vLLM brings its own
# flash-attention kernels).
pip uninstall -y transformer-engine transformer_engine transformer-engine-torch \
  transformer-engine-cu12 flash-attn apex torch-tensorrt || true

# The GPU stack verl_hpc was written against; the same pins as setup.py's `gpu` extra
# (tests/unit/test_gpu_stack_pins.py keeps them equal).
VLLM_VERSION=0.32.0
MEGATRON_CORE_VERSION=0.16.1
TE_VERSION=2.11.0   # megatron-core 0.16.1 declares transformer-engine >=2.9,<2.12
# 1. vLLM first: it decides the torch version for the whole image (vllm 0.32.0 pins torch 2.13.0).
pip install "vllm==${VLLM_VERSION}"
# 2. Transformer Engine's core library comes as one package per CUDA major version; it must match
#    the CUDA of the torch just installed (a cu12 core under a cu13 torch fails at import).
TORCH_CUDA_MAJOR=$(python -c 'import torch; print((torch.version.cuda or "none").split(".")[0])')
case "$TORCH_CUDA_MAJOR" in
  12|13) TE_CORE="core_cu${TORCH_CUDA_MAJOR}" ;;
  *) echo "torch has CUDA '${TORCH_CUDA_MAJOR}': expected a CUDA 12 or 13 build" >&2; exit 1 ;;
esac
#    Its torch extension is source-only; --no-build-isolation compiles it against the torch just
#    installed (an isolated build would fetch another torch and fail at import with undefined
#    symbols). Uses the image's CUDA headers and nvcc.
MAX_JOBS=${MAX_JOBS:-8} NVTE_FRAMEWORK=pytorch pip install --no-build-isolation \
  "transformer-engine[pytorch,${TE_CORE}]==${TE_VERSION}"
pip install "megatron-core==${MEGATRON_CORE_VERSION}"
# 3. The project and the rest of its `gpu` extra (core deps); the pieces above are kept.
#    Editable, so binding a newer checkout over $SRC runs that code.
pip install -e "${SRC}[gpu]"
# 4. mpi4py built against the image's MPI (HPC-X Open MPI, with PMIx and UCX for InfiniBand)
#    rather than the binary wheel, which loads whichever libmpi it finds first.
pip install --force-reinstall --no-deps --no-binary=mpi4py mpi4py

# Build-time check: imports only (no GPU here). Fails the build if the stack is inconsistent.
VLLM_VERSION=$VLLM_VERSION MEGATRON_CORE_VERSION=$MEGATRON_CORE_VERSION TE_VERSION=$TE_VERSION \
  python - <<'EOF'
import importlib, os
for name in ["torch", "vllm", "megatron.core", "transformer_engine", "h5py", "mpi4py", "verl_hpc"]:
    mod = importlib.import_module(name)
    print(f"{name:20s} {getattr(mod, '__version__', '')}")
import torch
print("torch CUDA build:", torch.version.cuda)
from importlib.metadata import version
want = {"vllm": os.environ["VLLM_VERSION"], "megatron-core": os.environ["MEGATRON_CORE_VERSION"],
        "transformer_engine": os.environ["TE_VERSION"]}
got = {name: version(name) for name in want}
bad = {n: (got[n], w) for n, w in want.items() if not got[n].startswith(w)}
assert not bad, f"installed (got, pinned) differ: {bad}"
EOF
pip check || echo "WARNING: pip check reports conflicts (often NGC extras left behind); see above"
