"""What vLLM needs to serve a vision-language policy as transformers trains it (docs/vlm.md).

Qwen3-VL's M-RoPE: transformers' Qwen3-VL class always interleaves the temporal, height and width
rotary frequencies (`Qwen3VLTextRotaryEmbedding.recomposition_frequencies`: T H W T H W ...),
whatever config.json says, while vLLM's rotary embedding reads `mrope_interleaved` from the text
config's rope parameters and lays the sections out in blocks (T... H... W...) where the key is
missing. The released Qwen3-VL folders carry `mrope_interleaved: true`; one without it (the
project's tiny Qwen3-VL, verl_hpc/models/tiny_vlm.py) made vLLM 0.25 serve another model: its
log-probs off the trainer's by up to 2e-2 on image prompts, equal on text-only ones (where the three
positions are alike). So the engine is told to interleave, as the trained class does
(tests/unit/rollout/test_rol_vllm_vision.py).
"""
from __future__ import annotations

from typing import Any, Dict

INTERLEAVED_MROPE = ("qwen3_vl", "qwen3_vl_moe")  # model_type whose transformers class interleaves always


def _interleave(config):
    """vLLM's hf_overrides hook: the loaded config with its text rope parameters interleaved."""
    text = getattr(config, "text_config", None) or config
    params = dict(getattr(text, "rope_parameters", None) or {})
    params["mrope_interleaved"] = True
    text.rope_parameters = params
    return config


def engine_args(folder_config: Dict[str, Any]) -> Dict[str, Any]:
    """vLLM engine keywords for the folder's config.json (a dict): {} for any model but those above."""
    if folder_config.get("model_type") in INTERLEAVED_MROPE:
        return {"hf_overrides": _interleave}
    return {}
