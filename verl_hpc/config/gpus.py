"""The GPUs `slurm.gpu_type` may name, and what the memory planner assumes about each.

Here, in the config layer, because validation refuses an unknown name; verl_hpc.planning.hardware
(the planner's assumptions) names the same table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

GiB = 1024 ** 3


@dataclass(frozen=True)
class GPUType:
    name: str
    memory_bytes: int  # what torch.cuda.mem_get_info reports as total (usable), not the box label
    bf16_tflops: float  # dense peak
    nvlink_gbps: float  # GB/s per GPU within a node (bus bandwidth of an all-reduce)
    hbm_tbps: float = 0.0  # device memory bandwidth, TB/s (datasheet): a decode step's floor; 0 = unknown


# Usable memory is a little below the label (ECC, driver reserve): what `nvidia-smi` shows as total.
GPUS: Dict[str, GPUType] = {g.name: g for g in (
    GPUType("h100-80gb", int(79.6 * GiB), 989.0, 450.0, 3.35),
    GPUType("h200", int(139.8 * GiB), 989.0, 450.0, 4.8),
    GPUType("a100-80gb", int(79.2 * GiB), 312.0, 240.0, 2.04),
    GPUType("a100-40gb", int(39.4 * GiB), 312.0, 240.0, 1.56),
    GPUType("l40s", int(44.4 * GiB), 362.0, 32.0, 0.86),
    GPUType("b200", int(178.0 * GiB), 2250.0, 900.0, 8.0),
    GPUType("gh200", int(94.5 * GiB), 989.0, 450.0, 4.0),
    # PCIe Gen5 x16 between GPUs (NVLink bridges join pairs only)
    GPUType("h100-pcie", int(79.6 * GiB), 756.0, 64.0, 2.0),
)}
GPU_ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "h100-sxm": "h100-80gb"}


def gpu_type(name: str) -> Optional[GPUType]:
    key = (name or "").strip().lower()
    return GPUS.get(GPU_ALIASES.get(key, key))


# torch.cuda.get_device_name() spellings -> table entries, most specific first: every substring of a
# row must occur in the lower-cased name. None: a variant whose peak differs from its family's
# (NVL boards, GB200, MIG slices), so that no peak is guessed for it.
_DEVICE_NAMES = (
    (("mig",), None),
    (("gh200",), "gh200"),
    (("h200", "nvl"), None),
    (("h200",), "h200"),
    (("h100", "nvl"), None),
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-80gb"),  # "NVIDIA H100 80GB HBM3": the SXM board
    (("a100", "40gb"), "a100-40gb"),
    (("a100",), "a100-80gb"),
    (("l40s",), "l40s"),
    (("gb200",), None),
    (("b200",), "b200"),
)


def gpu_type_for_device(device_name: str) -> Optional[GPUType]:
    """The table entry of a GPU as torch names it (e.g. 'NVIDIA H100 80GB HBM3'), or None where
    the table does not know that board (benchmarks then report no MFU)."""
    name = (device_name or "").lower()
    for parts, key in _DEVICE_NAMES:
        if all(p in name for p in parts):
            return GPUS[key] if key else None
    return None
