"""A vision-language model's vision side in the memory plan (either engine trains it, docs/vlm.md).

    v = vision_shape(model_path)     # None for a text model
    v.params, v.tokens_per_image, v.image_bytes(c)

Counted from config.json's vision_config in the Qwen-VL layout (transformers' Qwen2.5-VL and
Qwen3-VL vision towers): a patch embedding (in_channels x temporal_patch x patch^2 -> hidden, no
bias), `depth` blocks of attention (qkv and proj, with biases) and a gated MLP (Qwen2.5-VL) or a
plain one (Qwen3-VL: fc1, fc2) with two norms, and the patch merger (a norm, then merge^2 x hidden ->
merge^2 x hidden -> out_hidden, with biases); Qwen3-VL's learned position table too. The largest
image is preprocessor_config.json's max_pixels (or size.longest_edge): its patches are what one image
costs in pixel values (fp32, the processor's output) and in the tower's activations, and its
patches / merge^2 are its image tokens in the language model.

Where the engines hold them: on the FSDP engine the vision blocks are in the root's FSDP group
(engines/fsdp/build.py shard_units), so every rank gathers the whole tower in every forward; frozen
(the default) the tower has fp32 weight shards and no gradients or optimizer states. On the Megatron
engine (Qwen2.5-VL, models/vlm.py) every rank of the first pipeline stage holds the whole tower in the
model dtype, replicated over TP (`megatron_tower_bytes`); trained, its fp32 gradients whole and its
Adam states (and fp32 masters) sharded over DP by the distributed optimizer, as any replicated weight.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Optional

from verl_hpc.config.hf_model import is_vision_language, read_hf_config

# bytes the tower saves per patch and hidden unit per block in a training forward (residual, two
# norms' inputs and outputs, q/k/v and attention output, the MLP's input, its two branches and
# product): ~12 values, at the compute dtype's size
SAVED_PER_BLOCK = 12


@dataclasses.dataclass(frozen=True)
class VisionShape:
    params: int  # the tower and its merger (the projector into the language model)
    hidden: int
    depth: int
    patches_per_image: int  # of the largest image the processor keeps
    values_per_patch: int  # in_channels x temporal_patch x patch^2
    merge: int

    @property
    def tokens_per_image(self) -> int:
        return self.patches_per_image // (self.merge * self.merge)

    def image_bytes(self, c: int, train: bool) -> float:
        """One (largest) image in a micro-batch: its pixel values (fp32) and the tower's activations
        (saved over every block when the tower trains, one block's otherwise)."""
        pixels = 4.0 * self.patches_per_image * self.values_per_patch
        blocks = self.depth if train else 1
        return pixels + float(self.patches_per_image * self.hidden * SAVED_PER_BLOCK * c * blocks)


def megatron_tower_bytes(v: VisionShape, param_bytes: int, master_copy: bool, *, trains: bool, dp: int,
                         distributed_optimizer: bool) -> Dict[str, float]:
    """weights / grads / optimizer bytes of the tower on a first-stage rank of the Megatron engine."""
    out = {"weights": float(v.params * param_bytes), "grads": 0.0, "optimizer": 0.0}
    if trains:
        out["grads"] = float(v.params * 4)
        out["optimizer"] = float(v.params * (8 + (4 if master_copy else 0)) / (dp if distributed_optimizer else 1))
    return out


def vision_shape(path: str, field: str = "model.path") -> Optional[VisionShape]:
    """The vision side of the model folder `path`, or None for a text model (or no folder)."""
    if not (path and Path(path, "config.json").is_file()):
        return None
    data = read_hf_config(path, field)
    if not is_vision_language(data):
        return None
    v = data["vision_config"]
    h, ffn, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["depth"])
    p, t, merge = int(v["patch_size"]), int(v.get("temporal_patch_size", 2)), int(v.get("spatial_merge_size", 2))
    values = int(v.get("in_channels", 3)) * t * p * p
    # Qwen2.5-VL: RMSNorms, a gated MLP (gate, up, down), a bias-free patch embedding. Qwen3-VL:
    # LayerNorms (with biases), a plain MLP (fc1, fc2), a patch embedding with a bias, a learned
    # position table, and one more merger per deepstack layer (normalised after the shuffle)
    qwen3 = data.get("model_type") == "qwen3_vl"
    norm = 2 * h if qwen3 else h
    mlp = (2 * h * ffn + ffn + h) if qwen3 else (3 * h * ffn + 2 * ffn + h)
    block = 2 * norm + (3 * h * h + 3 * h) + (h * h + h) + mlp
    wide, out = h * merge * merge, int(v["out_hidden_size"])
    linears = (wide * wide + wide) + (wide * out + out)
    mergers = norm + linears + len(v.get("deepstack_visual_indexes") or ()) * (2 * wide + linears)
    positions = int(v.get("num_position_embeddings") or 0) * h
    params = values * h + (h if qwen3 else 0) + depth * block + mergers + positions
    return VisionShape(params, h, depth, _patches(Path(path), p), values, merge)


def _patches(folder: Path, patch: int) -> int:
    """Patches of the largest image the folder's image processor keeps (max_pixels / patch^2);
    Qwen-VL's released default (12,845,056 pixels) without a preprocessor_config.json."""
    pixels = 12845056
    file = folder / "preprocessor_config.json"
    if file.is_file():
        pre = json.loads(file.read_text())
        pixels = int(pre.get("max_pixels") or (pre.get("size") or {}).get("longest_edge") or pixels)
    return max(1, pixels // (patch * patch))
