"""Load an HF checkpoint into this rank's Megatron shards; export full HF-named tensors back.

Loading is local: every rank reads its own slices from the safetensors files (no collective, no
rank ever holds a whole TP-split tensor).

Export is collective over the model-parallel ranks of each replica, and its layout contract is:

    every rank yields every HF tensor of the model, full (not sharded), in the same order
    (HF order: embeddings, layers 0..L-1, final norm, lm_head), named and shaped as in the HF
    checkpoint, vocabulary padding removed, lm_head omitted when embeddings are tied.

How: the owning pipeline stage all-gathers each parameter over its TP group (so all its TP ranks
hold the full tensor), converts it to HF tensors, and broadcasts them over the pipeline group to
the ranks of the other stages. Data-parallel replicas each do this among themselves.

Why this contract: the consumer is the resharding step into vLLM, which runs an engine on every
rank of the job and whose tensor parallelism need not match training's. vLLM's loader takes full
checkpoint-format tensors and cuts its own shards, so every rank needs every full tensor; and
yielding one tensor at a time bounds the extra memory to one full tensor plus the consumer's
bucket. `all_stages=False` yields only the caller's stage (still TP-gathered), for writers that
store each stage's part themselves (HF or HDF5 export) and need no cross-stage traffic.

The iterator is a collective: all model-parallel ranks of a replica must exhaust it together.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from verl_hpc.models.hf_checkpoint import HFCheckpointReader
from verl_hpc.models.weight_rules import Layout, rule_for

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadReport:
    parameters: int  # Megatron parameters filled on this rank
    elements: int  # their total number of elements
    bytes_read: int  # bytes copied out of the checkpoint files by this rank


def _layer_numbers(model) -> Dict[int, int]:
    """Stage-local layer index -> global HF layer index (carries the pipeline offset)."""
    return {j: layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}


def _layout(model) -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(tp_rank=ps.get_tensor_model_parallel_rank(),
                  tp=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.vocab_size)


def _exported_params(model) -> List[Tuple[str, torch.nn.Parameter]]:
    """Parameters in a stable order, minus the tied output layer of the last stage (the HF
    checkpoint stores a tied lm_head once, as the embedding)."""
    arch = model.verl_arch
    return [(n, p) for n, p in model.named_parameters()
            if not (arch.tie_word_embeddings and n == "output_layer.weight")]


def load_hf_weights(model, checkpoint: Union[str, Path, HFCheckpointReader]) -> LoadReport:
    """Fill every parameter of this rank's `model` (from `gpt.build_gpt_model`) from the HF
    checkpoint, reading only this rank's slices."""
    arch = model.verl_arch
    reader = checkpoint if isinstance(checkpoint, HFCheckpointReader) else HFCheckpointReader(checkpoint)
    lay, layers = _layout(model), _layer_numbers(model)
    start_bytes, count, elements = reader.bytes_read, 0, 0
    for name, param in model.named_parameters():
        rule, layer = rule_for(name, arch, layers)
        shard = rule.load(reader, arch, layer, lay)
        if tuple(shard.shape) != tuple(param.shape):
            raise RuntimeError(f"{name}: the HF checkpoint gives shape {tuple(shard.shape)} for "
                               f"TP rank {lay.tp_rank}/{lay.tp}, the model expects "
                               f"{tuple(param.shape)}; does config.json match the weights?")
        if getattr(param, "tensor_model_parallel", False) and lay.tp > 1:
            assert param.partition_dim == rule.tp_dim, (name, param.partition_dim, rule.tp_dim)
        with torch.no_grad():
            param.copy_(shard)
        count, elements = count + 1, elements + param.numel()
    report = LoadReport(count, elements, reader.bytes_read - start_bytes)
    log.info("loaded %d parameters (%.1f M elements, %.1f MB read) from %s", count, elements / 1e6,
             report.bytes_read / 1e6, reader.folder)
    return report


def _tp_gather(tensor: torch.Tensor, dim: Optional[int], group, tp: int) -> torch.Tensor:
    if dim is None or tp == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _stage_entries(model) -> List[Tuple[str, Tuple[int, ...]]]:
    """(HF name, shape) of everything this stage exports, in export order."""
    arch, layers = model.verl_arch, _layer_numbers(model)
    out = []
    for name, _ in _exported_params(model):
        rule, layer = rule_for(name, arch, layers)
        out.extend(rule.hf_entries(arch, layer))
    return out


def _stage_tensors(model, dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors, TP-gathered (collective over the TP group)."""
    from megatron.core import parallel_state as ps

    arch, lay, layers = model.verl_arch, _layout(model), _layer_numbers(model)
    group = ps.get_tensor_model_parallel_group()
    for name, param in _exported_params(model):
        rule, layer = rule_for(name, arch, layers)
        tp_dim = rule.tp_dim if getattr(param, "tensor_model_parallel", False) else None
        full = _tp_gather(param, tp_dim, group, lay.tp)
        for hf_name, t in rule.to_hf(full, arch, layer, lay):
            yield hf_name, (t if dtype is None else t.to(dtype))


def export_hf_weights(model, *, all_stages: bool = True,
                      dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` per the layout contract in the module docstring.

    dtype: cast each tensor (default: the parameters' dtype). A collective iterator.
    """
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if not all_stages or pp == 1:
        yield from _stage_tensors(model, dtype)
        return
    group, my_stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    param_dtype = dtype or next(p for _, p in model.named_parameters()).dtype
    # Every stage learns every stage's (name, shape) list: one small exchange per export.
    plans: List[List[Tuple[str, Tuple[int, ...]]]] = [None] * pp  # type: ignore[list-item]
    dist.all_gather_object(plans, _stage_entries(model), group=group)
    device = next(p for _, p in model.named_parameters()).device
    for stage, plan in enumerate(plans):
        src = dist.get_global_rank(group, stage)
        mine = _stage_tensors(model, dtype) if stage == my_stage else None
        for hf_name, shape in plan:
            if mine is not None:
                got_name, tensor = next(mine)
                assert got_name == hf_name, (got_name, hf_name)
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(shape, dtype=param_dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            yield hf_name, tensor
