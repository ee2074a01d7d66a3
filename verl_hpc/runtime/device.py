"""The one place that decides CPU or CUDA (no other module reaches torch.cuda; docs/architecture.md)."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist


@functools.cache
def has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def visible_device_count() -> int:
    return torch.cuda.device_count() if has_gpu() else 0


def local_device_index(local_rank: int, device_count: Optional[int] = None) -> int:
    """Index of this rank's GPU among the visible ones: THE rule for torch (device_for) and for
    vLLM (the rollout exports it as LOCAL_RANK, which vLLM's external launcher turns into
    `cuda:LOCAL_RANK`). One rank per GPU, whatever the launcher made visible: all GPUs of the node
    (index = local rank) or, with per-task GPU binding, only this task's (index 0). Without GPUs it
    is the launcher's local rank unchanged (vLLM's CPU worker reads it as such)."""
    n = visible_device_count() if device_count is None else device_count
    return local_rank % n if n > 0 else local_rank


def device_for(local_rank: int) -> torch.device:
    """One rank per GPU: cuda:local_device_index(local_rank), made current; cpu without GPUs."""
    if not has_gpu():
        return torch.device("cpu")
    index = local_device_index(local_rank)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device() -> torch.device:
    """Where tensors for torch.distributed collectives must live for the active backend."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(requested: str) -> str:
    """'auto' -> nccl with GPUs, gloo without. An explicit nccl without a GPU is an error."""
    if requested == "auto":
        return "nccl" if has_gpu() else "gloo"
    if requested == "nccl" and not has_gpu():
        raise RuntimeError("parallel.backend=nccl but this rank sees no CUDA device; use auto or gloo")
    return requested


def accelerator_rng_state():
    """The current CUDA device's default generator state (a CPU uint8 tensor), or None where no
    CUDA context exists yet (nothing has drawn from it: there is nothing to save)."""
    if not (has_gpu() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.get_rng_state()


def set_accelerator_rng_state(state: torch.Tensor) -> bool:
    """Restore what accelerator_rng_state() returned; False (nothing done) without a GPU."""
    if not has_gpu():
        return False
    torch.cuda.set_rng_state(state)
    return True


def synchronize() -> None:
    """Wait for the current accelerator's queued work (asynchronous copies); a no-op on CPU."""
    if has_gpu():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    """Start a new peak-memory window on the current GPU (no-op without one)."""
    if has_gpu():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_allocated() -> int | None:
    """Peak bytes allocated by torch on the current GPU since reset_peak_memory(); None on CPU."""
    if not has_gpu():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def memory_allocated() -> int | None:
    """Bytes torch holds in tensors on the current GPU now (a baseline for a peak); None on CPU."""
    if not has_gpu():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def describe_accelerator() -> str:
    """e.g. 'NVIDIA H100 80GB HBM3 (sm 9.0), CUDA 13.0' or 'no GPU'."""
    if not has_gpu():
        return "no GPU"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm {major}.{minor}), CUDA {torch.version.cuda}"


def compute_capability() -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability()) if has_gpu() else None


def release_cached_memory() -> None:
    """Give torch's cached, unused GPU blocks back to the driver (no-op on CPU): between two models
    that take turns on one GPU (benchmarks), so the second is not limited by the first's cache."""
    if has_gpu():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
