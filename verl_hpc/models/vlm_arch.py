"""A vision-language model's facts for the Megatron engine, from config.json alone (no torch: the
memory planner and the submit check read it on login nodes).

    text_cfg, vision = parse_vision(cfg, src)   # the language model's config.json fields, VisionArch

Mapped: Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`). Its language model is Qwen2's decoder
(q/k/v biases, SwiGLU, RMSNorm) whose rotary positions are M-RoPE: each token has a temporal,
a height and a width position, and the rotary frequency pairs are split into three sections
(`mrope_section`, e.g. [16, 24, 24] of head_dim / 2 = 64 pairs) that turn by one of them each. Text
tokens have three equal positions (plain RoPE); an image's tokens lie on its grid. The vision
tower and its patch merger stay transformers' own module (models/vlm.py says why). Any other
vision-language model is refused here, naming the FSDP engine, which trains them as transformers
builds them.

Both config.json layouts are read: transformers 5's (the language model under `text_config`,
`rope_parameters.mrope_section`) and the released checkpoints' older one (the language model's
fields at the top level, `rope_scaling: {type: mrope, mrope_section}`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import VLM_ARCHITECTURES

LM = "model.language_model."  # transformers 5's Qwen2.5-VL decoder names (hf_name)
# the token ids M-RoPE's layout reads from config.json (transformers' get_rope_index)
TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id")


@dataclasses.dataclass(frozen=True)
class VisionArch:
    """The vision side of a mapped vision-language model."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    mrope_section: Tuple[int, int, int]  # rotary frequency pairs turned by t, h, w positions
    spatial_merge_size: int  # merge x merge patches become one image token
    tokens_per_second: float  # M-RoPE's temporal scale (videos; images have one frame)
    hidden_size: int  # the tower's width
    depth: int
    # vision_config as config.json holds it: the tower is built from it (models/vlm.py)
    config: Dict[str, Any] = dataclasses.field(compare=False, hash=False, repr=False)


def is_mapped_vlm(cfg: Dict[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return len(archs) == 1 and archs[0] in VLM_ARCHITECTURES


def refusal(cfg: Dict[str, Any], src: str) -> str:
    """The line for a vision-language model Megatron does not map."""
    name = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    return (f"{src}: {name} is a vision-language model the Megatron engine does not map (it maps "
            f"{', '.join(VLM_ARCHITECTURES)}); the FSDP engine trains it as transformers builds it (vision "
            "tower, projector, language model): set parallel.engine=fsdp (or auto)")


def _int(value, key: str, src: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{src}: {key}={value!r}: expected a positive integer")
    return value


def _rope(text: Dict[str, Any], src: str) -> Tuple[Dict[str, Any], Tuple[int, ...]]:
    """(the text fields with plain rope parameters, mrope_section). transformers 5 writes
    rope_parameters {rope_type: default, mrope_section, rope_theta}; the released configs
    rope_scaling {type: mrope, mrope_section} beside rope_theta."""
    field = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    params = dict(text.get(field) or {})
    section = params.pop("mrope_section", None)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in ("default", "mrope"):
        raise ConfigError(f"{src}: {field}.rope_type={kind!r} is not built for M-RoPE; valid: default (or mrope)")
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) and s > 0 for s in section)):
        raise ConfigError(f"{src}: {field}.mrope_section={section!r}: expected three positive integers "
                          "(the rotary pairs of the temporal, height and width positions)")
    out = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")}
    theta = params.pop("rope_theta", text.get("rope_theta"))
    out["rope_parameters"] = {"rope_type": "default", **({"rope_theta": theta} if theta is not None else {}), **params}
    return out, tuple(section)


def parse_vision(cfg: Dict[str, Any], src: str) -> Tuple[Dict[str, Any], VisionArch]:
    """(the language model's config.json fields, the vision side) of a mapped vision-language model;
    a ConfigError naming the field for anything the engine would compute otherwise."""
    if not is_mapped_vlm(cfg):
        raise ConfigError(refusal(cfg, src))
    nested = isinstance(cfg.get("text_config"), dict) and "hidden_size" in cfg["text_config"]
    text = dict(cfg["text_config"]) if nested else {k: v for k, v in cfg.items() if k != "vision_config"}
    if "tie_word_embeddings" in cfg:  # the model's own (top-level) flag decides lm_head
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text, section = _rope(text, src)
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // max(int(text.get("num_attention_heads") or 1), 1))
    if sum(section) * 2 != head_dim:
        raise ConfigError(f"{src}: mrope_section={list(section)} covers {2 * sum(section)} rotary dimensions, the "
                          f"heads have head_dim={head_dim}; valid: sections summing to head_dim / 2")
    v = cfg["vision_config"]
    tokens = {k: cfg.get(k, text.get(k)) for k in TOKEN_FIELDS}
    for key, value in tokens.items():
        _int(value, key, src)
    merge = _int(v.get("spatial_merge_size", 2), "vision_config.spatial_merge_size", src)
    out_hidden = _int(v.get("out_hidden_size"), "vision_config.out_hidden_size", src)
    if out_hidden != text.get("hidden_size"):
        raise ConfigError(f"{src}: vision_config.out_hidden_size={out_hidden} differs from the language model's "
                          f"hidden_size={text.get('hidden_size')}; valid: equal (the merger's output is a token embedding)")
    vision = VisionArch(**tokens, mrope_section=section, spatial_merge_size=merge,
                        tokens_per_second=float(v.get("tokens_per_second", 2)),
                        hidden_size=_int(v.get("hidden_size"), "vision_config.hidden_size", src),
                        depth=_int(v.get("depth"), "vision_config.depth", src), config=dict(v))
    return text, vision


def hf_name(name: str) -> str:
    """A text-family HF name (weight_rules' `model.layers.*`, PEFT's `base_model.model.model.*`)
    -> transformers 5's Qwen2.5-VL name; the tower's and lm_head keep theirs."""
    for prefix in ("base_model.model.", ""):
        rest = name[len(prefix):] if name.startswith(prefix) else None
        if rest is not None and rest.startswith("model.") and not rest.startswith(("model.visual.", LM)):
            return prefix + LM + rest[len("model."):]
    return name


class FolderReader:
    """An HFCheckpointReader seen through `hf_name`: a rule's name is looked up as transformers 5
    writes it, else as the released checkpoints do (`model.layers.*`, `visual.*`)."""

    def __init__(self, reader):
        self.reader = reader

    def _name(self, name: str) -> str:
        for candidate in (hf_name(name), name, name[len("model."):] if name.startswith("model.visual.") else name):
            if candidate in self.reader:
                return candidate
        return hf_name(name)  # the reader's own error names it

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.reader

    def shape(self, name):
        return self.reader.shape(self._name(name))

    def dtype(self, name):
        return self.reader.dtype(self._name(name))

    def read(self, name, index=None):
        return self.reader.read(self._name(name), index)
