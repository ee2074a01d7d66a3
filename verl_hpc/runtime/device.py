"""The one place that decides CPU or CUDA (DESIGN.md: no module reaches torch.cuda directly)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def device_for(local_rank: int) -> torch.device:
    """One rank per GPU: the local rank picks the device (Slurm's CUDA_VISIBLE_DEVICES or all)."""
    if not has_gpu():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    index = local_rank % n
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device() -> torch.device:
    """Where tensors for torch.distributed collectives must live for the active backend."""
    import torch.distributed as dist

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
