"""vLLM's model registry, asked about a model folder: its architecture, the module of vLLM's class
for it, and whether that module imports here. Apart from support.py so that the support
check and the probe's subprocess (probe.py), which the check runs, share it without importing
each other."""
from __future__ import annotations

from typing import Optional

from verl_hpc.config.hf_model import read_hf_config

BACKEND_MODULE = "vllm.model_executor.models.transformers"


def architecture(model_path: str) -> str:
    """config.json's architecture (the first listed), else its model_type."""
    data = read_hf_config(model_path)
    return (data.get("architectures") or [data.get("model_type") or "an unnamed architecture"])[0]


def vllm_model_module(arch: str) -> Optional[str]:
    """The module of vLLM's class for `arch` in its registry; None when vLLM lists none."""
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(arch)
    if entry is None:
        return None
    return getattr(entry, "module_name", None) or getattr(getattr(entry, "model_cls", None), "__module__", "")


def missing_import(module: str) -> Optional[str]:
    """The package `module` cannot import for lack of (vLLM's vision-language classes import
    torchvision at module level), or None when it imports."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        return e.name or str(e)
    return None
