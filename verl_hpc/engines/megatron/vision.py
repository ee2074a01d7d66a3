"""A vision-language model's micro-batch on the Megatron engine: the images of the model's rows and
their M-RoPE positions (the model: verl_hpc/models/vlm.py).

    positions, images = model_inputs(vision, sub, packed, device)

The model's rows are the samples, or under prompt sharing one row per prompt with its responses
after it (engines/prefix.py): then a row's images are its prompt's, once (the samples of a group
hold the same images: prefix.prompt_groups groups by tokens and images). The pixel values and grids
are concatenated in row order, the order in which the model pairs them with the image tokens (row by
row, left to right). Positions are [3, rows, S]: every row's prompt laid out by transformers'
get_rope_index, each response token at its own sequence position plus the prompt's delta
(models/vlm.sequence_positions), so a packed row's responses sit where they sat unpacked.

Also the layouts the engine does not build for such a model, refused before any weight is built.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.data.processor import collate_inputs


def check_layout(arch, *, cp: int, vpp: Optional[int], head: str) -> None:
    """One line for each layout a vision-language model does not run in on this engine."""
    if arch.vision is None:
        return
    what = f"{arch.architecture} ({arch.source})"
    if cp > 1:
        raise ConfigError(f"parallel.cp = {cp}: context parallelism is not built for the vision-language model "
                          f"{what} on the Megatron engine (its M-RoPE positions and image embeddings are not split "
                          "over the CP ranks); set parallel.cp=1")
    if vpp:
        raise ConfigError(f"parallel.vpp = {vpp}: virtual pipeline stages are not built for the vision-language "
                          f"model {what} (the vision tower sits on the first stage of a plain pipeline); set "
                          "parallel.vpp=null")
    if head != "lm":
        raise ConfigError(f"{what} is a vision-language model: a value or reward head on it is not supported; "
                          "critics, reward models and PRMs are text models")


def model_inputs(vision, sub: Mapping[str, torch.Tensor], packed, device
                 ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """([3, rows, S] M-RoPE positions, {pixel_values, image_grid_thw} or {}) of a micro-batch's model
    rows, on `device`. sub: the micro-batch's sub-batch (one row per sample; "image_inputs" its
    per-sample images, absent in a dummy); packed: its PackedRows, or None."""
    from verl_hpc.models.vlm import sequence_positions

    per_sample = list(sub.get("image_inputs") or [None] * sub["input_ids"].shape[0])
    plens = sub["prompt_lengths"]
    if packed is None:
        ids, own, lengths, rows = sub["input_ids"], None, plens, per_sample
    else:
        first = _first_members(packed.sample_rows, packed.input_ids.shape[0])
        ids, own, lengths = packed.input_ids, packed.position_ids, plens[first]
        rows = [per_sample[i] for i in first]
    if own is None:
        own = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    images = collate_inputs(rows)
    prompts = ids[:, :max(int(lengths.max()), 1)]
    positions = sequence_positions(vision, prompts, lengths, images.get("image_grid_thw"), own)
    return (positions.to(device, non_blocking=True),
            {k: v.to(device, non_blocking=True) for k, v in images.items()})


def _first_members(sample_rows: torch.Tensor, rows: int) -> List[int]:
    """For each packed row, the first sample placed in it."""
    first = [-1] * rows
    for i, r in enumerate(sample_rows.tolist()):
        if first[r] < 0:
            first[r] = i
    return first
