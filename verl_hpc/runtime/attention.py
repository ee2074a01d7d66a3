"""Which scaled-dot-product-attention kernels the training engines run, whatever vLLM set.

Importing vLLM's CUDA platform (`vllm/platforms/cuda.py`, in every vLLM release this project runs)
calls `torch.backends.cuda.enable_cudnn_sdp(False)` for the whole process: vLLM works around a
cuDNN SDPA crash of some models. A training engine in the same process would then run
FlashAttention-2's or the memory-efficient kernel where torch picks cuDNN's first on Hopper, and
where the GPU benchmarks timed cuDNN's: a job with vLLM would train on another kernel than the one
measured, and than the same job with HF rollout.

The trainer's choice is torch's own: the SDPA backends the process had before vLLM's import
(torch's defaults, every backend on, unless the user's code changed them). `training_attention()`
puts back cuDNN's flag for the length of an engine's forward or train step, and only when vLLM's
import is the one change since (its CUDA platform module is loaded and the flags are those it
leaves): a caller's own `torch.nn.attention.sdpa_kernel([...])` around an engine call is kept.
vLLM's own forward, outside those calls, keeps vLLM's choice. Colocated roles run one phase at a
time in a rank, so the two never overlap. The flags are process-wide booleans on every torch
build: the rule runs, and is tested, on CPU as on GPU (only CUDA kernels read them).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Dict, TypeVar

import torch

VLLM_CUDA_PLATFORM = "vllm.platforms.cuda"  # the module whose import turns cuDNN SDPA off
BACKENDS = ("flash", "mem_efficient", "math", "cudnn")
F = TypeVar("F", bound=Callable)


def sdpa_flags() -> Dict[str, bool]:
    """Which SDPA backends torch may pick now (torch.backends.cuda's process-wide flags)."""
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}


def sdpa_flags_before_vllm() -> Dict[str, bool]:
    """The flags when this module was first imported; cuDNN's taken as torch's default (on) where
    vLLM's CUDA platform was already imported then (its import is what turned it off)."""
    flags = dict(_AT_IMPORT)
    if _VLLM_FIRST:
        flags["cudnn"] = True
    return flags


_AT_IMPORT = sdpa_flags()
_VLLM_FIRST = VLLM_CUDA_PLATFORM in sys.modules


def vllm_turned_cudnn_off() -> bool:
    """vLLM's CUDA platform is imported and the flags are exactly what its import leaves: cuDNN's off
    where it was on, every other as it was before."""
    if VLLM_CUDA_PLATFORM not in sys.modules:
        return False
    now, before = sdpa_flags(), sdpa_flags_before_vllm()
    return (before["cudnn"] and not now["cudnn"]
            and all(now[k] == before[k] for k in BACKENDS if k != "cudnn"))


@contextlib.contextmanager
def training_attention():
    """Around a training engine's forward or step: the SDPA backends as before vLLM's import."""
    if not vllm_turned_cudnn_off():
        yield
        return
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)  # vLLM's choice again for its own forward


def trains_with_torch_attention(method: F) -> F:
    """Decorator for a TrainingEngine method that runs the model: it runs in training_attention()."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with training_attention():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
