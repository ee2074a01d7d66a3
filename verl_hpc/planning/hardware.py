"""What the planner assumes about the machines: GPU memory, link bandwidths, fixed overheads.

Every number here is an assumption the plan prints next to its result (`assumptions()`), so a
user can see what to correct with --gpu-memory-gb / --mfu instead of trusting a black box.
"""
from __future__ import annotations

import math
import os
from typing import Dict

# The GPU table lives with the config, which checks slurm.gpu_type against it; named here too.
from verl_hpc.config.gpus import GPU_ALIASES, GPUS, GiB, GPUType, gpu_type  # noqa: F401

GB = 10 ** 9

# Per-GPU memory no tensor accounts for, apart from NCCL (comms.py counts it per communicator):
# the CUDA context (~0.5 GiB on Hopper with lazy module loading), cuBLAS/cuBLASLt and Transformer
# Engine workspaces, torch's own kernels; plus the caching allocator's fragmentation, taken as a
# fraction of the tensor total.
CUDA_CONTEXT_BYTES = 1 * GiB
FRAGMENTATION = 0.05
# NCCL, per communicator this rank belongs to (groups of >= 2 ranks; a 1-rank group moves no
# bytes). The bootstrap passes `device_id` to init_process_group, so every new_group creates its
# communicator at once (eager init), used or not. NCCL (>= 2.22, NCCL_RUNTIME_CONNECT=1) connects
# a communicator's channel buffers (per channel and peer: the 4 MiB Simple FIFO, LL128 and LL
# buffers) only at its first collective, so:
# - a communicator that runs collectives: NVIDIA/nccl#964 measured 544 MiB (2 ranks) and 688 MiB
#   (4 ranks) per communicator after one all-reduce on 4 x A100 NVLink; memory grows with the
#   channel count (nccl#986), which H100 NVLink raises, so 0.75 GiB. NVLS (NVLink SHARP) buffers
#   come on top where NCCL enables NVLS (NCCL_NVLS_ENABLE=0 turns them off): not counted;
# - one created and never used: its own structures only (work FIFO, channel and proxy state):
#   64 MiB assumed (not measured).
NCCL_COMM_BYTES = int(0.75 * GiB)
NCCL_IDLE_COMM_BYTES = 64 * 2 ** 20
# Host memory of one rank's process that no tensor accounts for: Python, torch, CUDA/NCCL host
# libraries and (where the rollout is vLLM) vLLM's own imports. Measured on this project's CPU
# runs as ~1.5-2.5 GiB per rank (RSS right after the imports); the GPU figure adds the CUDA host
# runtime.
HOST_PROCESS_BYTES_CPU = int(2.5 * GiB)
HOST_PROCESS_BYTES_GPU = 6 * GiB
# vLLM CUDA graphs (enforce_eager: false): captured for 67 batch sizes by default; a few hundred MB
# for dense models at TP >= 2, ~1-2 GB at TP 1 (vLLM's logs); they live inside vLLM's budget while
# it is awake. vLLM 0.32's sleep (CuMemBackend.suspend) copies the "cudagraph" and "runtime" pools
# to pinned host memory at EVERY level (level 1 adds the weights) and unmaps them: asleep, the
# graphs hold ~0 device bytes and this much host memory.
VLLM_GRAPH_BYTES = int(1.5 * GiB)


def pinned(nbytes: float) -> float:
    """Host bytes torch's pinned (CachingHostAllocator) allocation of `nbytes` takes: rounded up to
    a power of two (c10::llvm::PowerOf2Ceil in ATen/core/CachingHostAllocator.h, torch 2.13; the
    freed block stays cached for reuse, so the rounded size is held for the process's life)."""
    n = int(math.ceil(nbytes))
    return float(1 << (n - 1).bit_length()) if n > 0 else 0.0


# Step-time model (--suggest): rough public figures, printed with the ranking.
ASSUMED_TRAIN_MFU = 0.40
ASSUMED_DECODE_MFU = 0.10  # decoding is memory-bound: a low effective MFU
INTER_NODE_GBPS = 50.0  # 400 Gb/s InfiniBand per GPU
PCIE_GBPS = 25.0  # host <-> GPU copies (offload), pinned memory, PCIe Gen4/5 x16 effective


def memory_figure_problems(gpu_memory_gb, node_memory_gb) -> list:
    """A memory size the user gave (--gpu-memory-gb, --node-memory-gb; None = not given) must be a
    finite number > 0: a negative or NaN size would print a plan with a negative headroom, or be
    taken as "unknown" and pass every job."""
    return [f"{option}: got {value}; valid: a number of GB > 0 (1 GB = 1e9 bytes)"
            for option, value in (("--gpu-memory-gb", gpu_memory_gb), ("--node-memory-gb", node_memory_gb))
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0)]


def local_ram_bytes() -> int:
    """This machine's RAM (the node RAM assumed for local CPU runs with no slurm.mem_gb)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def assumptions() -> Dict[str, str]:
    return {
        "CUDA context and library workspaces per GPU": f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB",
        "NCCL per communicator (in use / created, idle)":
            f"{NCCL_COMM_BYTES / GiB:.2f} / {NCCL_IDLE_COMM_BYTES / GiB:.2f} GiB",
        "allocator fragmentation": f"{FRAGMENTATION:.0%} of tensor bytes",
        "host bytes per rank process (GPU / CPU job)":
            f"{HOST_PROCESS_BYTES_GPU / GiB:.1f} / {HOST_PROCESS_BYTES_CPU / GiB:.1f} GiB",
        "vLLM CUDA graphs (enforce_eager false)":
            f"{VLLM_GRAPH_BYTES / GiB:.1f} GiB, on the host while asleep",
        "pinned host buffers": "rounded up to a power of two each",
    }


def time_assumptions() -> Dict[str, str]:
    return {
        "training MFU": f"{ASSUMED_TRAIN_MFU:.0%}", "decode MFU": f"{ASSUMED_DECODE_MFU:.0%}",
        "inter-node bandwidth per GPU": f"{INTER_NODE_GBPS:.0f} GB/s",
        "host<->GPU (offload) bandwidth": f"{PCIE_GBPS:.0f} GB/s",
    }
