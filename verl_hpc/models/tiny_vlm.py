"""Tiny vision-language models for tests and the VLM demo: a real HF folder, made from nothing, offline.

    python -m verl_hpc.models.tiny_vlm OUT --family qwen2_5_vl|qwen3_vl [--layers 2] [--seed 0]

writes OUT/config.json, model.safetensors, the tokenizer (the project's tiny BPE plus the family's
vision tokens, and a chat template that renders image content parts as the family's
`<|vision_start|><|image_pad|><|vision_end|>`) and preprocessor_config.json (the family's image
processor: 14 px patches for Qwen2.5-VL, 16 px for Qwen3-VL, 2x2 merge, so an image of H x W
pixels gives (H/p)(W/p)/4 image tokens after resizing to multiples of 2p; the pixel range is kept
small, 56 x 56 .. 112 x 112, so a test image is 4 to 16 tokens). The weights are transformers'
`*ForConditionalGeneration` for that config: a 2-block vision tower (hidden 64), its patch merger
(the projector into the language model's hidden 128) and a 2-layer language model shaped like the
text families of `verl_hpc.models.tiny` (4 heads, 2 KV heads, head_dim 32) with M-RoPE sections
[4, 6, 6] (temporal, height, width) over the 16 rotary frequency pairs. Output is a pure function
of the arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.tiny import random_state_dict, save_safetensors, train_tokenizer, write_cli

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# A chat template that takes both forms of message content: text, or a list of content parts
# ({"type": "image"} / {"type": "text", "text": ...}), as the released Qwen-VL templates do.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}
MIN_SIDE, MAX_SIDE = 4, 8  # image sides in patches: the processor's pixel range


def vlm_tokenizer():
    tok = train_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def hf_config(family: str, ids: Dict[str, int], *, layers: int = 2, vocab_size: int = 500):
    """The transformers config of a tiny `family` VLM; ids: the tokenizer's special token ids."""
    if family not in FAMILIES:
        raise ConfigError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    text = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=ids["bos"],
                eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                  patch_size=PATCH[family], spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    tokens = dict(image_token_id=ids["image"], video_token_id=ids["video"],
                  vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                  tie_word_embeddings=False)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "window_size": 4 * PATCH[family],
                                                                 "fullatt_block_indexes": [1]},
                                architectures=["Qwen2_5_VLForConditionalGeneration"], **tokens)
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(text_config=text, vision_config={**vision, "num_position_embeddings": 64,
                                                          "deepstack_visual_indexes": [0]},
                         architectures=["Qwen3VLForConditionalGeneration"], **tokens)


def image_processor(family: str):
    """The family's image processor (the PIL backend: it needs no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    p = PATCH[family]
    side = 2 * p  # resized sides are multiples of patch x merge
    return Qwen2VLImageProcessorPil(patch_size=p, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": (MIN_SIDE * p) ** 2, "longest_edge": (MAX_SIDE * p) ** 2},
                                    min_pixels=(side * 2) ** 2, max_pixels=(MAX_SIDE * p) ** 2)


def make_tiny_vlm(out, family: str = "qwen2_5_vl", *, layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny VLM folder to `out` and return its path. Deterministic given the args."""
    from transformers import AutoModelForImageTextToText

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = vlm_tokenizer()
    ids = {k: tok.convert_tokens_to_ids(f"<|{k}|>") for k in ("bos", "eos", "pad")}
    ids.update(image=tok.convert_tokens_to_ids("<|image_pad|>"), video=tok.convert_tokens_to_ids("<|video_pad|>"),
               vision_start=tok.convert_tokens_to_ids("<|vision_start|>"),
               vision_end=tok.convert_tokens_to_ids("<|vision_end|>"))
    config = hf_config(family, ids, layers=layers)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    config.save_pretrained(out)
    save_safetensors(random_state_dict(model, seed), out)
    tok.save_pretrained(out)
    image_processor(family).save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.models.tiny_vlm", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output folder (created)")
    ap.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    return write_cli(a.out, {"layers": a.layers}, lambda: make_tiny_vlm(a.out, a.family, layers=a.layers, seed=a.seed))


if __name__ == "__main__":
    sys.exit(main())
