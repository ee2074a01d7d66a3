"""What the planner assumes about the machines: GPU memory, link bandwidths, fixed overheads.

Every number here is an assumption the plan prints next to its result (`assumptions()`), so a
user can see what to correct with --gpu-memory-gb / --mfu instead of trusting a black box.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

GiB = 1024 ** 3
GB = 10 ** 9


@dataclass(frozen=True)
class GPUType:
    name: str
    memory_bytes: int  # what torch.cuda.mem_get_info reports as total (usable), not the box label
    bf16_tflops: float  # dense peak
    nvlink_gbps: float  # GB/s per GPU within a node (bus bandwidth of an all-reduce)


# Usable memory is a little below the label (ECC, driver reserve): what `nvidia-smi` shows as total.
GPUS: Dict[str, GPUType] = {g.name: g for g in (
    GPUType("h100-80gb", int(79.6 * GiB), 989.0, 450.0),
    GPUType("h200", int(139.8 * GiB), 989.0, 450.0),
    GPUType("a100-80gb", int(79.2 * GiB), 312.0, 240.0),
    GPUType("a100-40gb", int(39.4 * GiB), 312.0, 240.0),
    GPUType("l40s", int(44.4 * GiB), 362.0, 32.0),
    GPUType("b200", int(178.0 * GiB), 2250.0, 900.0),
    GPUType("gh200", int(94.5 * GiB), 989.0, 450.0),
)}
GPU_ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "h100-sxm": "h100-80gb"}

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


def gpu_type(name: str) -> Optional[GPUType]:
    key = (name or "").strip().lower()
    return GPUS.get(GPU_ALIASES.get(key, key))


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
