"""`vision:` images in the prompts, for vision-language models (the FSDP engine trains any of them, the
Megatron engine Qwen2.5-VL: docs/vlm.md).

A row's images are under `image_key` (bytes, a path, or {bytes, path} as parquet image columns
store them); each is checked before the queue against the limits here, and the prompt names where
each image goes: `<image>` in a message's text, or a content part {"type": "image"}. Which model is
a vision-language model is read from its config.json (a `vision_config`), never configured.
"""
from __future__ import annotations

from dataclasses import dataclass
from verl_hpc.config.fields import Section, opt
from verl_hpc.config.hf_model import VLM_ARCHITECTURES, is_vision_language

PLACEHOLDER = "<image>"


@dataclass
class VisionConfig(Section):
    image_key: str = opt("images", "column holding a row's images: a list of image bytes or paths (or "
                                   "{bytes, path} dicts, as parquet image columns store them)")
    # Why 16 megapixels: above the largest image the released Qwen-VL processors keep (12.8 MP before
    # they downscale) and far below what would exhaust a loader's memory (a 100 MP RGB image decodes
    # to 300 MB); the processor downsizes anything it keeps to its own max_pixels anyway.
    max_image_pixels: int = opt(16 * 1024 * 1024, "an image wider x higher than this is refused at load "
                                                   "(the row named)", check=">0")
    max_image_bytes: int = opt(20 * 1024 * 1024, "an encoded image larger than this is refused at load",
                               check=">0")
    max_images_per_prompt: int = opt(8, "images in one prompt at most (rollout and KV-cache sizing)",
                                     check=">0")
    train_vision_tower: bool = opt(False, "train the vision tower (and its projector) with the language "
                                          "model; false freezes them: their weights never change and are "
                                          "not sent to the rollout engine")


def vision_problems(job, config: dict, engine: str, field: str) -> list:
    """What a vision-language model (`config`: its config.json) needs of the rest of the job, one
    line each; nothing for a text model."""
    if not is_vision_language(config):
        return []
    arch = (config.get("architectures") or [config.get("model_type")])[0]
    what = f"{field} is a vision-language model ({arch})"
    if field != "model.path":
        return [f"{what}: only the policy (model.path) may be one; critics, reward models and PRMs are text "
                "models (a value head on a vision-language model is not supported)"]
    p = []
    if engine != "fsdp":
        p += _megatron_problems(job, arch, what)
    if job.placement.mode == "split":
        p.append(f"{what}: placement.mode = split does not carry images to its rollout ranks yet; use "
                 "placement.mode=colocated")
    if job.multi_turn.enable:
        p.append(f"{what}: multi_turn episodes render text turns only (no image observations); set "
                 "multi_turn.enable=false")
    if job.vision.train_vision_tower and job.train_world_size > 1 and engine == "fsdp":
        p.append(f"{what}: vision.train_vision_tower = true trains on one rank only on the FSDP engine "
                 f"({job.train_world_size} training ranks here): a micro-batch without images leaves the tower "
                 "without a gradient on its rank; keep it false on more ranks (or train Qwen2.5-VL with "
                 "parallel.engine=megatron)")
    if job.lora.enabled and job.vision.train_vision_tower:
        p.append(f"{what}: lora.enabled adapts the language model only; set vision.train_vision_tower=false")
    return p


def _megatron_problems(job, arch: str, what: str) -> list:
    """What the Megatron engine does not build for a vision-language model (models/vlm.py)."""
    if arch not in VLM_ARCHITECTURES:
        return [f"{what}: the Megatron engine maps {', '.join(VLM_ARCHITECTURES)} only; set parallel.engine=fsdp "
                "(or auto)"]
    p = []
    if job.parallel.cp > 1:
        p.append(f"{what}: parallel.cp = {job.parallel.cp}: context parallelism is not built for it (its M-RoPE "
                 "positions and image embeddings are not split over the CP ranks); set parallel.cp=1")
    if job.parallel.vpp:
        p.append(f"{what}: parallel.vpp = {job.parallel.vpp}: virtual pipeline stages are not built for it (the "
                 "vision tower sits on the first stage of a plain pipeline); set parallel.vpp=null")
    if job.lora.enabled and job.lora.init_from:
        p.append(f"{what}: lora.init_from = {job.lora.init_from!r}: the Megatron engine does not read a PEFT "
                 "adapter of a vision-language model yet (its names sit under model.language_model); start a "
                 "fresh adapter (lora.init_from=null) or use parallel.engine=fsdp")
    return p
