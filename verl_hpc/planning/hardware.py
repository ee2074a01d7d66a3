"""What the planner assumes about the machines: GPU memory, link bandwidths, fixed overheads.

Every number here is an assumption the plan prints next to its result (`assumptions()`), so a
user can see what to correct with --gpu-memory-gb / --mfu instead of trusting a black box.
"""
from __future__ import annotations

import os
from typing import Dict

# The GPU table lives with the config, which checks slurm.gpu_type against it; named here too.
from verl_hpc.config.gpus import GPU_ALIASES, GPUS, GiB, GPUType, gpu_type  # noqa: F401

GB = 10 ** 9

# Per-GPU memory no tensor accounts for: the CUDA context and cuBLAS/NCCL workspaces (NCCL's
# channel buffers grow with the number of communicators; 3 GiB covers TP+PP+DP+rollout groups of a
# dense model, slime/verl reports put residual non-tensor memory at 2-5 GB), plus the caching
# allocator's fragmentation, taken as a fraction of the tensor total.
GPU_OVERHEAD_BYTES = 3 * GiB
FRAGMENTATION = 0.05
# Host memory of one rank's process that no tensor accounts for: Python, torch, CUDA/NCCL host
# libraries and (where the rollout is vLLM) vLLM's own imports. Measured on this project's CPU
# runs as ~1.5-2.5 GiB per rank (RSS right after the imports); the GPU figure adds the CUDA host
# runtime.
HOST_PROCESS_BYTES_CPU = int(2.5 * GiB)
HOST_PROCESS_BYTES_GPU = 6 * GiB
# vLLM CUDA graphs (enforce_eager: false): captured for 67 batch sizes by default; a few hundred MB
# for dense models at TP >= 2, ~1-2 GB at TP 1 (vLLM's logs); they live outside the KV budget.
VLLM_GRAPH_BYTES = int(1.5 * GiB)

# Step-time model (--suggest): rough public figures, printed with the ranking.
ASSUMED_TRAIN_MFU = 0.40
ASSUMED_DECODE_MFU = 0.10  # decoding is memory-bound: a low effective MFU
INTER_NODE_GBPS = 50.0  # 400 Gb/s InfiniBand per GPU
PCIE_GBPS = 25.0  # host <-> GPU copies (offload), pinned memory, PCIe Gen4/5 x16 effective


def local_ram_bytes() -> int:
    """This machine's RAM (the node RAM assumed for local CPU runs with no slurm.mem_gb)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def assumptions() -> Dict[str, str]:
    return {
        "per-GPU overhead (CUDA context, NCCL, cuBLAS)": f"{GPU_OVERHEAD_BYTES / GiB:.1f} GiB",
        "allocator fragmentation": f"{FRAGMENTATION:.0%} of tensor bytes",
        "host bytes per rank process (GPU / CPU job)":
            f"{HOST_PROCESS_BYTES_GPU / GiB:.1f} / {HOST_PROCESS_BYTES_CPU / GiB:.1f} GiB",
        "vLLM CUDA graphs (enforce_eager false)": f"{VLLM_GRAPH_BYTES / GiB:.1f} GiB",
    }


def time_assumptions() -> Dict[str, str]:
    return {
        "training MFU": f"{ASSUMED_TRAIN_MFU:.0%}", "decode MFU": f"{ASSUMED_DECODE_MFU:.0%}",
        "inter-node bandwidth per GPU": f"{INTER_NODE_GBPS:.0f} GB/s",
        "host<->GPU (offload) bandwidth": f"{PCIE_GBPS:.0f} GB/s",
    }
