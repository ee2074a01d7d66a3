"""The environment every rank starts with: project defaults, GPU-cluster defaults, user overrides."""
from __future__ import annotations

import os

# Bitwise-reproducible CPU math. torch's CPU BLAS is MKL, whose default picks kernels by the
# memory alignment of each operand, which varies from run to run: the same job on the same machine
# then differs in the last bit from the first step and drifts apart over hundreds of steps (a
# 600-step SFT ended at loss 0.42 in one run, 0.67 in the next). AUTO,STRICT keeps MKL's fastest
# code path for the CPU and makes it independent of alignment (docs/platform-notes.md, "Reproducible
# runs"). MKL reads it once, when it starts, so it must be in the environment before torch's first
# BLAS call: set for every rank here, and by `verl_hpc.job` for ranks started without the launcher.
REPRODUCIBLE_CPU = {"MKL_CBWR": "AUTO,STRICT"}

# Always set. HDF5 file locking fails on Lustre without flock and when a reader opens a file a
# writer holds (docs/platform-notes.md, "HDF5"); vLLM must stay in the calling process for the hybrid engine.
BASE = {
    "PYTHONUNBUFFERED": "1",
    "HDF5_USE_FILE_LOCKING": "FALSE",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    **REPRODUCIBLE_CPU,
}

# Only for GPU jobs; every value is a default the user can override with `slurm.env`.
GPU = {
    "NCCL_DEBUG": "WARN",
    "NCCL_IB_TIMEOUT": "22",  # InfiniBand retry timeout exponent: survive transient fabric hiccups
    # A failed or timed-out collective ends the rank instead of hanging it. 3 = exit without
    # aborting the communicators: torch's default, explicit so jobs do not depend on the torch
    # release (1 would call ncclCommAbort first, which can itself hang on a wedged fabric). The
    # old spelling NCCL_ASYNC_ERROR_HANDLING is not set: deprecated, and vLLM's GPU worker unsets it.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "NVTE_FWD_LAYERNORM_SM_MARGIN": "0",
}
# Only for GPU jobs whose roles train on the Megatron engine: its tensor/sequence-parallel layers
# rely on one hardware queue per device to keep a weight-gradient GEMM ahead of the communication
# it overlaps. The FSDP engine does not: FSDP2 runs its all-gathers and reduce-scatters on streams
# of their own, and one queue would put them behind the compute they are meant to overlap.
MEGATRON_GPU = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def trains_on_megatron(parallel) -> bool:
    """Whether any role of the job can train on the Megatron engine (config/sections/fsdp.py
    choose_engine's rule without the model folders: auto picks Megatron exactly where the layout
    asks for tensor, pipeline or expert parallelism)."""
    if parallel.engine == "auto":
        return parallel.tp > 1 or parallel.pp > 1 or parallel.ep > 1
    return parallel.engine == "megatron"


def job_environment(cfg) -> dict[str, str]:
    env = dict(BASE)
    # A code path chosen where the job is started (MKL_CBWR=AVX2 to reproduce another machine's
    # arithmetic: docs/testing.md) reaches the ranks too; slurm.env still wins over it.
    if os.environ.get("MKL_CBWR"):
        env["MKL_CBWR"] = os.environ["MKL_CBWR"]
    env["OMP_NUM_THREADS"] = str(max(1, cfg.slurm.cpus_per_task))
    if cfg.slurm.gpus_per_node > 0:
        env.update(GPU)
        if trains_on_megatron(cfg.parallel):
            env.update(MEGATRON_GPU)
    env.update({str(k): str(v) for k, v in cfg.slurm.env.items()})
    return env
