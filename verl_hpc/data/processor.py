"""Image prompts through the model's own Hugging Face processor.

    vp = VisionProcessor.load(model_path)                 # None for a text-only model
    messages, n = image_messages(prompt)                  # `<image>` placeholders -> content parts
    text = vp.render(messages)                            # the model's chat template
    ids, inputs = vp.encode(text, images)                 # image tokens expanded; pixel values + grid

`inputs` is one sample's tensors as the processor returns them for that sample alone:
`pixel_values` [patches, C * t * p * p] and `image_grid_thw` [images, 3] for the Qwen-VL families
(the grid is what the model's M-RoPE positions and its vision tower read). They travel with the
sample and are joined per micro-batch by `collate_inputs` (concatenated along dim 0, the layout
these processors batch in), never padded to a batch maximum.

The families tested are the Qwen-VL ones (`FAMILIES`); another vision-language model is refused at
load, naming them, rather than fed through a batching rule nobody checked for it.

Why a fallback beside AutoProcessor: in transformers 5 the Qwen-VL processors take a video
processor, which needs torchvision, and torchvision's PyPI wheels for x86_64 are CUDA builds that do
not import beside a CPU torch. Where AutoProcessor cannot be built for that reason, the folder's
image processor (its PIL backend needs no torchvision) and tokenizer are used, and the image
placeholder is expanded by the rule the Qwen-VL processors apply: grid t*h*w / merge_size^2 image
tokens per image. On a machine with torchvision the processor itself is used. The model checks the
expansion (it refuses a prompt whose image tokens and image features differ in number:
tests/unit/data/test_data_images.py runs it on expanded prompts).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_hpc.config.sections.vision import PLACEHOLDER, VisionConfig
from verl_hpc.data.errors import DataError
from verl_hpc.data.images import ImageLimits, load_images

log = logging.getLogger(__name__)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # model_type of the vision-language models tested
IMAGE_TOKEN = "<|image_pad|>"
PROCESSOR_FILES = ("preprocessor_config.json",)  # the image processor's settings (patch size, pixel range)
Inputs = Dict[str, torch.Tensor]


@dataclass
class PromptImages:
    """One prompt's images as each consumer takes them: `images` (PIL, RGB) for vLLM's
    multi_modal_data, which runs the processor itself; `inputs` (the processor's tensors for this
    prompt alone) for transformers' generate and the training engine."""
    images: List[Any]
    inputs: Inputs = field(default_factory=dict)
    # the prompt's ids with one placeholder token per image, before expansion: what vLLM takes (it
    # expands placeholders itself, and would expand already-expanded ones again)
    placeholder_ids: List[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)


@dataclass
class ImagePrompts:
    """How a data set's rows bring images: the model's processor (None: a text-only model, whose
    rows may not hold images), the column, the limits."""
    processor: Optional["VisionProcessor"]
    image_key: str = field(default_factory=lambda: VisionConfig().image_key)
    limits: ImageLimits = field(default_factory=ImageLimits.from_config)

    @classmethod
    def from_config(cls, model, vision) -> "ImagePrompts":
        """For the job's policy model (the model section's path); the processor is loaded only for a
        VLM. vision: the vision section. A path without a config.json counts as a text model: the
        roles, built first, have refused a missing folder already (programs run with stand-in roles)."""
        folder = Path(model.path or "", "config.json").is_file()
        processor = VisionProcessor.load(model.path, model.trust_remote_code) if folder else None
        return cls(processor, vision.image_key, ImageLimits.from_config(vision))

    def prompt(self, record) -> Tuple[str, List[int], Optional[PromptImages]]:
        """encode() of a PromptRecord."""
        return self.encode(record.prompt, record.images, record.base_dir)

    def encode(self, prompt, images, base_dir: str = "") -> Tuple[str, List[int], Optional[PromptImages]]:
        """(rendered text, token ids, its images or None) of one prompt (text or messages) and its
        row's images as stored; a DataError names what is wrong (the caller names
        the row). base_dir: where relative image paths start (the data file's folder)."""
        images = load_images(images, self.limits, base_dir)
        messages, places = image_messages(prompt)
        if places != len(images):
            raise DataError(f"the prompt has {places} image placeholder(s) ('{PLACEHOLDER}' or "
                               f"{{type: image}} parts) but field '{self.image_key}' holds {len(images)} "
                               "image(s); each image needs one placeholder where it goes")
        text = self.processor.render(messages)
        try:
            ids, inputs = self.processor.encode(text, images)
        except (ValueError, TypeError, RuntimeError) as e:  # e.g. Qwen-VL's "absolute aspect ratio must be smaller than 200"
            sizes = ", ".join(f"{im.width} x {im.height}" for im in images)
            raise DataError(f"the model's image processor refuses the image(s) ({sizes}): {type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0]}") from None
        if not images:
            return text, ids, None
        unexpanded = list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        return text, ids, PromptImages(images, inputs, unexpanded)


def check_family(config: Mapping[str, Any], field: str = "model.path") -> None:
    from verl_hpc.config.errors import ConfigError

    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(f"{field}: the vision-language model type {kind!r} is not supported; the families "
                          f"tested are {', '.join(FAMILIES)} (model_type in config.json)")


def image_messages(prompt) -> Tuple[List[dict], int]:
    """(chat messages with content parts, number of images they place): a text prompt or messages
    whose text holds `<image>` placeholders become content parts {"type": "image"} / {"type":
    "text"}, as verl's data does; content already given as parts is kept."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out, count = [], 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            parts = []
            for i, piece in enumerate(re.split(re.escape(PLACEHOLDER), content)):
                if i:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
        else:
            parts = [dict(p) for p in content]
        count += sum(1 for p in parts if p.get("type") == "image")
        out.append({"role": m["role"], "content": parts})
    return out, count


class VisionProcessor:
    """The model's processor for image prompts (see the module doc for the fallback)."""

    def __init__(self, processor, tokenizer, image_processor):
        self.processor, self.tokenizer, self.image_processor = processor, tokenizer, image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    @classmethod
    def load(cls, path: str, trust_remote_code: bool = False, field: str = "model.path") -> Optional["VisionProcessor"]:
        """The processor of the folder `path`, or None when its model is text-only."""
        from verl_hpc.config.hf_model import is_vision_language, read_hf_config

        config = read_hf_config(path, field)
        if not is_vision_language(config):
            return None
        check_family(config, field)
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        from verl_hpc.config.errors import ConfigError

        try:
            try:
                proc = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
                return cls(proc, proc.tokenizer, proc.image_processor)
            except ImportError as e:
                if "torchvision" not in str(e).lower():
                    raise
                log.info("%s: the processor class needs torchvision; using its image processor and tokenizer", path)
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            images = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:  # transformers' "Can't load image processor", deep in the job otherwise
            lacks = [f for f in PROCESSOR_FILES if not (Path(path) / f).is_file()]
            raise ConfigError(f"{field}: '{path}' is a vision-language model ({config.get('model_type')}) whose image "
                              f"processor does not load{' (no ' + lacks[0] + ')' if lacks else ''}: {type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]}; valid: the folder as released, with its "
                              "preprocessor_config.json and tokenizer") from None
        return cls(None, tok, images)

    def render(self, messages: List[dict]) -> str:
        """The chat template applied to `messages` (content parts), ending with the assistant header."""
        owner = self.processor if self.processor is not None and self.processor.chat_template else self.tokenizer
        if not getattr(owner, "chat_template", None):
            raise DataError("the model's processor and tokenizer have no chat_template; image prompts need one")
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, images: Sequence[Any]) -> Tuple[List[int], Inputs]:
        """(token ids with each image's tokens expanded, the sample's image tensors)."""
        if not images:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), {}
        if self.processor is not None:
            enc = self.processor(text=[text], images=list(images), return_tensors="pt")
            ids = enc["input_ids"][0].tolist()
            return ids, {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw")}
        pix = self.image_processor(images=list(images), return_tensors="pt")
        merge = self.image_processor.merge_size ** 2
        counts = iter((pix["image_grid_thw"].prod(dim=-1) // merge).tolist())
        # each placeholder token becomes its image's tokens, in order (what the processor does)
        text = re.sub(re.escape(IMAGE_TOKEN), lambda _: IMAGE_TOKEN * next(counts), text)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}

    def image_tokens(self, ids: Sequence[int]) -> int:
        return sum(1 for t in ids if t == self.image_token_id)


def token_types(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """`mm_token_type_ids` (1 on image tokens, 0 elsewhere), what the Qwen-VL models need beside
    the grid to lay out their M-RoPE positions; without it transformers silently uses 1-D ones."""
    return (input_ids == image_token_id).to(torch.int32)


def collate_inputs(per_sample: Sequence[Optional[Inputs]]) -> Inputs:
    """One forward's image inputs from its samples' (None or {} for a text-only sample): each
    tensor concatenated along dim 0 in sample order, which is how the model pairs them with the
    image tokens of its input_ids (row by row, left to right)."""
    present = [x for x in per_sample if x]
    if not present:
        return {}
    return {k: torch.cat([x[k] for x in present], dim=0) for k in present[0]}
