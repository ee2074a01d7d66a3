"""torch dtype <-> what the HDF5 dataset declares. Data always moves as raw bytes, so it is bit-exact.

HDF5 has no bfloat16 or float8 type: those are stored as unsigned integers of the same width
(bfloat16 -> uint16, float8_* -> uint8) and the `dtype` attribute says what the bits mean. A plain
h5py reader gets them back with `torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)`.
bool is stored as uint8 (0/1). Complex tensors are refused: no engine state needs them.
"""
from __future__ import annotations

import numpy as np
import torch

from verl_hpc.checkpoint.errors import CheckpointLayoutError

# torch dtype name -> numpy dtype of the HDF5 dataset (little-endian, what h5ls shows)
STORAGE = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "i1",
    "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "u1", "bool": "u1",
    "float8_e4m3fn": "u1", "float8_e5m2": "u1", "float8_e4m3fnuz": "u1", "float8_e5m2fnuz": "u1",
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in STORAGE:
        raise CheckpointLayoutError(f"tensors of dtype {name} cannot be checkpointed; supported: {sorted(STORAGE)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if name not in STORAGE or not isinstance(dt, torch.dtype):
        raise CheckpointLayoutError(f"unknown stored dtype {name!r}; known: {sorted(STORAGE)}")
    return dt


def storage_dtype(name: str) -> np.dtype:
    return np.dtype(STORAGE[name])


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a flat uint8 numpy array (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def as_storage_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as a numpy array of its storage dtype, shaped like the tensor."""
    return as_bytes(t).view(storage_dtype(dtype_name(t.dtype))).reshape(t.shape)
