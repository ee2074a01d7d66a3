"""The environment variables set before vLLM builds any engine of the project's (the rollout, the
judge, the quantization probe, the GPU kit's probe), and why each. vLLM reads them when the engine
is built, so they are set at construction (compat.engine_construction and the probes' own
environments), never changing a value the user set, except one that cannot work here (below).

- VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine stays in the calling process (the hybrid engine).
- VLLM_USE_FLASHINFER_SAMPLER=0 where FlashInfer is not installed. On CUDA, vLLM's samplers ask
  `flashinfer_sampler_supported()`, which imports FlashInfer's attention backend (and so FlashInfer)
  unless this variable is 0: vLLM 0.25's default V1 sampler asks for every log-prob mode but the
  processed ones, and its V2 model runner's sampler asks always. A node without FlashInfer (the
  slim vLLM kit does not carry it) then fails at the engine's build with `No module named
  'flashinfer'`. With it 0, vLLM samples with its PyTorch top-k/top-p (the same distribution).
  Set to 1 by the user where FlashInfer is missing: refused in one line (vLLM's own error would
  be the import's traceback).
- VLLM_USE_V2_MODEL_RUNNER=0: vLLM 0.25 runs dense models on its V2 GPU model runner by default.
  The CPU worker every test here runs is V1's runner (vLLM's CPUModelRunner derives from V1's
  GPUModelRunner): the weight reload, the served-weights check's reads and the prefix-cache reset
  were verified on that runner, so the GPU runs it too. A user may set 1 to try V2.
The variables are plain names here (no vLLM import): the launcher's environment and the probes'
subprocesses take them too.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Dict, MutableMapping, Optional

from verl_hpc.config.errors import ConfigError

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
FLASHINFER_SAMPLER = "VLLM_USE_FLASHINFER_SAMPLER"
V2_MODEL_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
_TRUE = ("1", "true", "yes", "on")


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def engine_environment(environ: Optional[MutableMapping[str, str]] = None,
                       flashinfer: Optional[bool] = None) -> Dict[str, str]:
    """The variables to set in `environ` (default os.environ) before an engine is built: those the
    user has not set. ConfigError where the user asks for FlashInfer's sampler without FlashInfer."""
    environ = os.environ if environ is None else environ
    flashinfer = flashinfer_installed() if flashinfer is None else flashinfer
    out = {MULTIPROCESSING: "0"}  # not the user's to change: the hybrid engine needs it in-process
    asked = environ.get(FLASHINFER_SAMPLER)
    if not flashinfer:
        if asked is not None and asked.strip().lower() in _TRUE:
            raise ConfigError(f"environment: {FLASHINFER_SAMPLER}={asked} asks for FlashInfer's sampler, but "
                              "flashinfer is not installed; valid: unset it or 0 (vLLM then samples with "
                              "PyTorch), or install flashinfer-python")
        if asked is None:
            out[FLASHINFER_SAMPLER] = "0"
    if V2_MODEL_RUNNER not in environ:
        out[V2_MODEL_RUNNER] = "0"
    return out


def apply(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set engine_environment() in `environ` (default os.environ); returns what was set."""
    environ = os.environ if environ is None else environ
    values = engine_environment(environ)
    environ.update(values)
    return values
