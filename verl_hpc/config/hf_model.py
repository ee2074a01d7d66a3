"""The one reader of a Hugging Face model folder's config.json (plain JSON).

Everything that needs a model's numbers reads them here: config validation on a login node, the
Megatron config mapping, the rollout engines. Errors name the config field that pointed at the
folder (`model.path`, `critic.model_path`, ...) and what a valid folder holds.

Families name their numbers differently: GPT-2 and BLOOM say `n_head`, `n_layer`, `n_embd`, and
transformers' config class maps them to the common names (its `attribute_map`). `language_model_config`
gives the numbers under the common names through that map (transformers is imported only for a
config.json that lacks one of them), plus what transformers' modelling code derives without a map:
Falcon's KV heads, the MLP width under Falcon's and GPT-2's names.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, NamedTuple

from verl_hpc.config.errors import ConfigError

FOLDER = "a Hugging Face model folder (config.json + *.safetensors)"


# The architectures verl_hpc maps by hand into Megatron-Core (HF class -> family), here in the config
# layer so that the engine choice (config/sections/fsdp.py) can ask on a login node; the mapping
# itself is verl_hpc.models.config_mapping (dense) and verl_hpc.models.moe (mixture of experts).
DENSE_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                     "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}
# vision-language models whose language model Megatron holds (the HF vision tower beside it on the
# first pipeline stage: verl_hpc/models/vlm.py); any other vision-language model is the FSDP engine's
VLM_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
MEGATRON_ARCHITECTURES = {**DENSE_ARCHITECTURES, **MOE_ARCHITECTURES, **VLM_ARCHITECTURES}


def read_hf_config(path, field: str = "model.path") -> Dict[str, Any]:
    """config.json of the folder `path` as a dict; a ConfigError naming `field` otherwise."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        raise ConfigError(f"{field}: no such folder {str(path or '')!r}; expected {FOLDER}")
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{field}: '{folder}' has no config.json; expected {FOLDER}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{field}: cannot read '{file}': not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{field}: '{file}': expected a JSON object at the top level")
    return data


def stored_tensor_names(path, field: str = "model.path") -> set:
    """The tensor names a folder's weights hold: the index's weight_map, else every *.safetensors
    file's header (an 8-byte little-endian length, then JSON), read without the tensors."""
    import struct

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text())["weight_map"])
        names = set()
        for f in sorted(folder.glob("*.safetensors")):
            with open(f, "rb") as handle:
                (n,) = struct.unpack("<Q", handle.read(8))
                names.update(k for k in json.loads(handle.read(n)) if k != "__metadata__")
        return names
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ConfigError(f"{field}: cannot read the tensor names of '{folder}' ({type(e).__name__}: {e}); "
                          "expected complete safetensors files (and their index)") from None


def is_vision_language(data: Dict[str, Any]) -> bool:
    """config.json (as a dict) of a vision-language model: it describes a vision tower."""
    return isinstance(data.get("vision_config"), dict)


def language_model_config(data: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's numbers under the common names (`canonical_names`); multimodal configs
    nest them under text_config."""
    if "num_attention_heads" not in data and isinstance(data.get("text_config"), dict):
        return canonical_names(data["text_config"])
    return canonical_names(data)


COMMON = ("num_attention_heads", "num_hidden_layers", "hidden_size", "max_position_embeddings")


def canonical_names(data: Dict[str, Any]) -> Dict[str, Any]:
    """config.json's numbers with the common names added where the family uses others (a copy;
    the family's own keys stay)."""
    out = dict(data)
    if any(k not in data for k in COMMON):
        for common, own in _attribute_map(data.get("model_type")).items():
            if common not in out and own in data:
                out[common] = data[own]
    if "num_key_value_heads" not in out and "num_kv_heads" in data:
        # as transformers' Falcon attention counts them: one KV head under multi-query attention
        # unless the new decoder architecture says num_kv_heads
        mqa = data.get("multi_query", True) and not data.get("new_decoder_architecture", False)
        out["num_key_value_heads"] = 1 if mqa else data["num_kv_heads"]
    if "intermediate_size" not in out:  # Falcon's ffn_hidden_size, GPT-2's n_inner (null: 4 x hidden)
        ffn = data.get("ffn_hidden_size") or data.get("n_inner")
        if ffn:
            out["intermediate_size"] = ffn
    return out


def _attribute_map(model_type) -> Dict[str, str]:
    """transformers' config class's map for `model_type` ({} where transformers does not know it)."""
    try:
        from transformers import CONFIG_MAPPING

        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})
    except (ImportError, KeyError, TypeError):
        return {}


class ModelShape(NamedTuple):
    """The numbers of a config.json that constrain the parallel layout."""

    heads: int
    kv_heads: int
    layers: int
    vocab_size: int
    max_positions: int = 0  # max_position_embeddings; 0 when config.json does not say
    ffn: int = 0  # intermediate_size; 0 when config.json does not say
    source: str = "config.json"
    head_dim: int = 0  # head_dim, else hidden_size / heads; 0 when config.json says neither
    experts: int = 0  # routed experts of a mixture-of-experts model; 0 for a dense one
    expert_ffn: int = 0  # each routed expert's intermediate size (then `ffn` is 0: no dense MLP)
    shared_ffn: int = 0  # the shared expert's intermediate size (split over tp like a dense MLP)
    router: str = "softmax"  # the MoE router's score function: softmax, or sigmoid (DeepSeek-V3's scoring_func)


def _shared_ffn(data: Dict[str, Any], expert_ffn: int) -> int:
    """The shared expert's width: Qwen2-MoE's shared_expert_intermediate_size, or DeepSeek's
    n_shared_experts experts of moe_intermediate_size (one fused MLP)."""
    if data.get("n_shared_experts"):
        return int(data["n_shared_experts"]) * expert_ffn
    return int(data.get("shared_expert_intermediate_size") or 0)


def read_model_shape(path: str, field: str = "model.path") -> ModelShape:
    data = language_model_config(read_hf_config(path, field))
    file = Path(path) / "config.json"
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "vocab_size") if k not in data]
    if missing:
        raise ConfigError(f"{field}: '{file}' has no {', '.join(missing)}")
    try:
        heads = int(data["num_attention_heads"])
        head_dim = int(data.get("head_dim") or int(data.get("hidden_size") or 0) // max(heads, 1))
        ffn = int(data.get("intermediate_size") or 0)
        experts = int(data.get("num_local_experts") or data.get("num_experts") or data.get("n_routed_experts") or 0)
        # Mixtral's experts are intermediate_size wide; Qwen-MoE's moe_intermediate_size
        expert_ffn = int(data.get("moe_intermediate_size") or ffn) if experts else 0
        return ModelShape(heads, int(data.get("num_key_value_heads") or heads), int(data["num_hidden_layers"]),
                          int(data["vocab_size"]), int(data.get("max_position_embeddings") or 0),
                          0 if experts else ffn, f"({field} config.json)", head_dim, experts=experts,
                          expert_ffn=expert_ffn,
                          shared_ffn=_shared_ffn(data, expert_ffn) if experts else 0,
                          router=str(data.get("scoring_func") or "softmax"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{field}: '{file}' has a non-integer head, layer or vocabulary count ({e})") from None
