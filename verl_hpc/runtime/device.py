"""The one place that decides CPU or CUDA (no other module reaches torch.cuda; docs/architecture.md)."""
from __future__ import annotations

import functools
import os
import re
from typing import Optional

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError


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


# CUDA_VISIBLE_DEVICES entries, as `nvidia-smi -L` prints them. CUDA also takes a UUID's unique
# prefix, but vLLM looks UUIDs up through NVML (device_control_id_to_physical_device_id), which
# needs the whole one.
_HEX = "[0-9a-fA-F]"
_UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_GPU_UUID = re.compile(f"GPU-{_UUID}")
_MIG_UUID = re.compile(f"MIG-(?:{_UUID}|GPU-{_UUID}/\\d+/\\d+)")  # current and pre-R470 forms
VISIBLE_DEVICES_VALID = ("comma-separated GPU indices (0,1,...) or full UUIDs as `nvidia-smi -L` prints "
                         "them (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx; one MIG-... per rank)")


def visible_devices_problem(value: Optional[str], cuda_count: int) -> Optional[str]:
    """Why CUDA_VISIBLE_DEVICES=`value` cannot give each rank its own GPU by position, or None.

    local_device_index places ranks by position in the list, so GPU UUIDs work as indices do (torch,
    NCCL and vLLM take them; vLLM maps LOCAL_RANK -> list entry -> NVML). What silently goes wrong
    is refused: an entry CUDA cannot read (it stops there and hides every later GPU), a UUID
    prefix (NVML needs the whole UUID), several MIG devices (CUDA exposes only the first to a
    process: every rank would share it), and a list longer than what CUDA sees (an index or UUID
    of a GPU this node does not have, or one listed twice)."""
    if not value or cuda_count <= 0:
        return None
    entries = [e.strip() for e in value.split(",")]
    where = f"CUDA_VISIBLE_DEVICES={value!r}"
    for i, e in enumerate(entries):
        if not (e.isdigit() or _GPU_UUID.fullmatch(e) or _MIG_UUID.fullmatch(e)):
            return (f"{where}: entry {i} ({e!r}) is not a GPU index or a full GPU/MIG UUID (CUDA stops "
                    f"reading the list there and hides the GPUs after it); valid: {VISIBLE_DEVICES_VALID}")
    mig = [e for e in entries if e.startswith("MIG-")]
    if mig and len(entries) > 1:
        return (f"{where}: lists {len(entries)} devices, {len(mig)} of them MIG; CUDA shows a process only "
                f"the first MIG device, so every rank of the node would share it; give each rank its own "
                f"(Slurm: --gpus-per-task=1, or one MIG UUID per task); valid: {VISIBLE_DEVICES_VALID}")
    if len(entries) > cuda_count:
        return (f"{where}: lists {len(entries)} devices but CUDA sees {cuda_count}: an entry names a GPU "
                f"this node does not have, or is repeated; valid: {VISIBLE_DEVICES_VALID}")
    return None


def check_visible_devices() -> None:
    """Refuse a CUDA_VISIBLE_DEVICES that would put ranks on the wrong GPUs (visible_devices_problem)."""
    problem = visible_devices_problem(os.environ.get("CUDA_VISIBLE_DEVICES"), visible_device_count())
    if problem:
        raise ConfigError(problem)


def device_for(local_rank: int) -> torch.device:
    """One rank per GPU: cuda:local_device_index(local_rank), made current; cpu without GPUs."""
    if not has_gpu():
        return torch.device("cpu")
    check_visible_devices()
    index = local_device_index(local_rank)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device() -> torch.device:
    """Where tensors for torch.distributed collectives must live for the active backend (NCCL's
    device also where the default group takes host tensors too: process_group_backend)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_group_backend(backend: str, host_collectives: bool = False) -> str:
    """The default group's backend string. NCCL takes device tensors only; where host tensors must
    cross ranks too (fsdp.cpu_offload: FSDP2 keeps the sharded parameters and gradients on the host,
    and gradient clipping and the export reduce or gather those host DTensors) the group gets gloo
    for the CPU beside NCCL for CUDA, as torchtitan sets it up for CPU offload."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" and host_collectives else backend


def compute_device() -> torch.device:
    """Where this rank's models and their tensors live: its GPU (the current device, which
    device_for made this rank's), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu() else torch.device("cpu")


def misplaced_tensors(modules, device: torch.device, limit: int = 3) -> list:
    """'name (device)' of up to `limit` parameters or buffers of `modules` that are not on `device`.
    The device contract of every engine after its build: Megatron builds some modules itself with
    torch defaults (its torch-norm fallback without apex, for one), which stay on the CPU unless the
    whole model is moved, and the first sign on a GPU is a mixed-device error deep in a forward."""
    want = torch.device(device)
    out = []
    for module in modules:
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
                out.append(f"{name} ({t.device})")
                if len(out) >= limit:
                    return out
    return out


def place_on_device(modules, what: str):
    """Move `modules` (a list) to compute_device(), as Megatron-LM's get_model does after building,
    then check that nothing stayed behind; returns the device. RuntimeError naming the tensors
    otherwise."""
    device = compute_device()
    for m in modules:
        m.to(device)
    stray = misplaced_tensors(modules, device)
    if stray:
        raise RuntimeError(f"{what}: tensors not on {device} after moving the model there: {', '.join(stray)}")
    return device


def backend_for(requested: str) -> str:
    """'auto' -> nccl with GPUs, gloo without. An explicit nccl without a GPU is an error."""
    if requested == "auto":
        return "nccl" if has_gpu() else "gloo"
    if requested == "nccl" and not has_gpu():
        raise ConfigError("parallel.backend=nccl but this rank sees no CUDA device; use auto or gloo")
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


def memory_reserved() -> int | None:
    """Bytes torch's caching allocator holds from the current GPU now; None on CPU."""
    if not has_gpu():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_reserved())


def peak_memory_reserved() -> int | None:
    """Peak bytes torch's caching allocator held since reset_peak_memory(); None on CPU."""
    if not has_gpu():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_reserved())


def device_memory_in_use() -> int | None:
    """Bytes in use on the current GPU by every allocator and process (total - free, after the
    queued work): what vLLM's sleep gives back, which torch's counters do not see (vLLM maps its
    pool outside torch's caching allocator). None on CPU."""
    if not has_gpu():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def free_memory_bytes(device: torch.device) -> Optional[float]:
    """Bytes a tensor allocated now on `device` could take: the driver's free memory plus what
    torch's caching allocator holds unused; None for a CPU device. Host-side queries only (no
    device synchronization): the output layer asks per micro-batch (engines/logits.py)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


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
