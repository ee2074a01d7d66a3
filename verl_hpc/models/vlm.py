"""Qwen2.5-VL on Megatron-Core: the language model as Megatron's `GPTModel` with M-RoPE
(`position_embedding_type="mrope"`, Megatron's MultimodalRotaryEmbedding), the vision tower and its
patch merger as transformers' own module on the first pipeline stage (`VisionGPTModel.visual`),
whose image embeddings replace the image tokens' embeddings before the first layer.

    model = build_gpt_model(arch)        # a VisionGPTModel when arch.vision (models/gpt.py)
    out = model(ids, mrope_positions, mask, pixel_values=..., image_grid_thw=...)
    pos, deltas = rope_index(arch.vision, prompt_ids, prompt_lengths, image_grid_thw)

Why transformers' tower, not Megatron-Core's vision model: megatron-core 0.16.1 ships CLIP's ViT and
RADIO (learned absolute positions, full attention, LayerNorm, an MLP projector apart). Qwen2.5-VL's
tower is another network: 2-D rotary positions, attention inside 112-pixel windows with a few
full-attention blocks, RMSNorm, a gated MLP with biases and a 2 x 2 patch merger. Rebuilt from
Megatron's modules it would be a new model to prove equal to the released one; transformers' module
is that model (its weights load by their names, its outputs are the reference's). It is small beside
the language model (0.67 B of Qwen2.5-VL-7B's 8.3 B), so it is replicated over the tensor-parallel
ranks rather than split: every TP rank runs it on the same images and gets the same gradient (the
embedding's input gradient is all-reduced over TP by the first layer's column-parallel input, and
under sequence parallelism all-gathered by the scatter's backward). When it trains its parameters
carry Megatron's `average_gradients_across_tp_domain`, so finalize_model_grads averages them over
TP (the replicas cannot drift apart by a kernel's rounding), and its gradient norm counts once
(Megatron counts a parameter without `tensor_model_parallel` on TP rank 0 only).

M-RoPE positions are transformers' own (`Qwen2_5_VLModel.get_rope_index`, called on the prompt):
text tokens count on, an image's tokens lie on its (t, h, w) grid from the position after the text
before it, and the text after an image continues from the image's largest position + 1. A
response is text, so its token at sequence position p has p + delta in all three (delta: the
prompt's largest position + 1 - its length, get_rope_index's `mrope_position_deltas`): the
positions of a packed row (prompt, then each response at its own positions: engines/prefix.py)
follow from the prompt's alone.

HF names: the folder of a transformers 5 Qwen2.5-VL holds `model.language_model.*` (the decoder),
`model.visual.*` (the tower) and `lm_head.weight`; the released checkpoints hold `model.layers.*`,
`visual.*`, `lm_head.weight`. The weight rules (weight_rules.py) speak the text families' names;
`hf_name` turns them into transformers 5's, which the export writes (what transformers saves and the
FSDP engine's export names), and `FolderReader` finds either layout on load.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from typing import List, Optional, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from verl_hpc.models.vlm_arch import FolderReader, VisionArch, hf_name  # noqa: F401 (the names' home is vlm_arch)
from verl_hpc.models.weight_rule_classes import Piece

VISUAL = "visual."  # the tower's parameters in VisionGPTModel (the folder's model.visual.*)


@dataclasses.dataclass(frozen=True)
class TowerTensor:
    """A weight rule (weight_rule_classes.py's contract) for a tower parameter: one HF tensor,
    whole on every TP rank."""

    hf: str
    shape: Tuple[int, ...]
    tp_dim: Optional[int] = None
    group: str = "tp"

    @classmethod
    def of(cls, name: str, param: torch.Tensor) -> "TowerTensor":
        return cls("model." + name, tuple(param.shape))

    def hf_entries(self, arch, layer):
        return [(self.hf, self.shape)]

    def load(self, reader, arch, layer, lay) -> torch.Tensor:
        return reader.read(self.hf)

    def to_hf(self, full, arch, layer, lay):
        return [(self.hf, full)]

    def pieces(self, local, arch, layer, lay) -> List[Piece]:
        return [Piece(self.hf, None, 0, local)]


def _no_init():
    """transformers' no_init_weights (5: transformers.initialization, 4: modeling_utils): the
    tower's weights come from the folder, so its random initialisation would be wasted work."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return __import__(module, fromlist=["no_init_weights"]).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def build_tower(vision: VisionArch, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision tower with its merger, from config.json's vision_config
    (weights empty: models/weights.py loads them with the rest)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(**vision.config)
    cfg._attn_implementation = "sdpa"  # what the FSDP engine's from_pretrained picks (and the reference)
    with _no_init():
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=dtype)
    return tower


class VisionGPTModel(GPTModel):
    """GPTModel whose first stage embeds images: `visual` (transformers' tower) turns pixel values
    into one embedding per image token, put in place of those tokens' word embeddings before the
    first layer. Built without the embedding's sequence-parallel scatter
    (`scatter_embedding_sequence_parallel=False`): the images go in first, then this model scatters."""

    def __init__(self, *args, vision: VisionArch, **kwargs):
        super().__init__(*args, scatter_embedding_sequence_parallel=False, **kwargs)
        self.vision = vision
        self.visual = build_tower(vision, self.config.params_dtype) if self.pre_process else None

    def tower_trains(self) -> bool:
        return self.visual is not None and any(p.requires_grad for p in self.visual.parameters())

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                **kwargs):
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                               labels=labels, **kwargs)

    def image_features(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """[image tokens, hidden]: the tower's merged output (`pooler_output`), in the images' order."""
        dtype = next(self.visual.parameters()).dtype
        with contextlib.nullcontext() if self.tower_trains() else torch.no_grad():  # frozen: no activations kept
            out = self.visual(pixel_values.to(dtype), grid_thw=grid)
        return out.pooler_output if hasattr(out, "pooler_output") else out

    def embed(self, input_ids, pixel_values, grid) -> torch.Tensor:
        """The decoder's input [s, b, h] (this rank's sequence slice under sequence parallelism)."""
        emb = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole
        image = input_ids == self.vision.image_token_id  # [b, s]
        wanted = int(image.sum())
        if pixel_values is not None:
            feats = self.image_features(pixel_values, grid)
            if feats.shape[0] != wanted:
                raise ValueError(f"the micro-batch has {wanted} image tokens and its images give {feats.shape[0]} "
                                 "embeddings: the prompts' image placeholders do not match their images")
            # row by row, left to right: the order of the images (and of transformers' masked_scatter)
            emb = emb.transpose(0, 1).masked_scatter(image.unsqueeze(-1), feats.to(emb.dtype)).transpose(0, 1)
        elif wanted:
            raise ValueError(f"the micro-batch has {wanted} image tokens but no pixel values")
        elif self.tower_trains():
            # A trained tower must get a gradient (0) in every backward: with overlapped gradient
            # reduction Megatron's DDP starts a bucket's reduction only once all its parameters have
            # one, and waits for it at the step. One merge unit of zero pixels, times 0: exact.
            emb = emb + 0.0 * self.image_features(*dummy_image(self.vision, emb.device)).sum()
        emb = emb.contiguous()
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb


def dummy_image(vision: VisionArch, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pixel values, grid) of the smallest image the tower takes: one merge unit of patches."""
    c = vision.config
    m = vision.spatial_merge_size
    width = int(c.get("in_channels", 3)) * int(c.get("temporal_patch_size", 2)) * int(c["patch_size"]) ** 2
    return (torch.zeros(m * m, width, device=device),
            torch.tensor([[1, m, m]], dtype=torch.long, device=device))


def mark_tower_gradients(model) -> None:
    """The trained tower's parameters averaged over TP by Megatron's finalize_model_grads."""
    if getattr(model, "visual", None) is not None:
        for p in model.visual.parameters():
            p.average_gradients_across_tp_domain = True


@functools.lru_cache(maxsize=None)
def _takes_token_types() -> bool:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    return "mm_token_type_ids" in inspect.signature(Qwen2_5_VLModel.get_rope_index).parameters


def rope_index(vision: VisionArch, ids: torch.Tensor, lengths: torch.Tensor,
               grid: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' M-RoPE layout of right-padded prompts `ids` [r, P] (real tokens: `lengths`),
    with their images' grids in row order: (positions [3, r, P], deltas [r])."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=vision.spatial_merge_size,
                                            tokens_per_second=vision.tokens_per_second),
        image_token_id=vision.image_token_id, video_token_id=vision.video_token_id,
        vision_start_token_id=vision.vision_start_token_id)
    # get_rope_index is a method of the model that reads only these: its config's numbers and a
    # helper that does not touch the model either
    holder = types.SimpleNamespace(config=config, get_vision_position_ids=functools.partial(
        Qwen2_5_VLModel.get_vision_position_ids, None))
    mask = (torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)).long()
    kwargs = dict(image_grid_thw=grid, attention_mask=mask)
    if _takes_token_types():
        kwargs["mm_token_type_ids"] = (ids == vision.image_token_id).to(torch.int32)
    pos, deltas = Qwen2_5_VLModel.get_rope_index(holder, ids, **kwargs)
    return pos, deltas.view(-1)


def sequence_positions(vision: VisionArch, prompts: torch.Tensor, prompt_lengths: torch.Tensor,
                       grid: Optional[torch.Tensor], own: torch.Tensor) -> torch.Tensor:
    """M-RoPE positions [3, r, S] of rows whose token j sits at position own[r, j] of its own
    sequence (0..S-1 for plain rows; a packed row's responses restart after the prompt): the prompt's
    layout where own < the prompt's length, own + delta (text) elsewhere. prompts [r, P]: each row's
    prompt, right-padded; grid: the rows' images in row order (None: text only)."""
    pos, deltas = rope_index(vision, prompts, prompt_lengths, grid)
    inside = own < prompt_lengths.unsqueeze(1)
    taken = pos.gather(2, own.clamp(max=prompts.shape[1] - 1).unsqueeze(0).expand(3, -1, -1))
    return torch.where(inside.unsqueeze(0), taken, (own + deltas.unsqueeze(1)).unsqueeze(0).expand(3, -1, -1))
