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

Mixture-of-experts models: a routed expert's weights are gathered over the expert-TP group, then
all-gathered over the expert-parallel group, whose ranks hold the other experts (local expert j of
EP rank r is global expert r * E/ep + j): a stage yields, for each local expert j, the experts
j, E/ep + j, ... of every EP rank in that order. The expert-parallel group spans data-parallel
replicas, so every rank of a stage takes part in an export together (the trainer's ranks all do).

Why this contract: the consumer is the resharding step into vLLM, which runs an engine on every
rank of the job and whose tensor parallelism need not match training's. vLLM's loader takes full
checkpoint-format tensors and cuts its own shards, so every rank needs every full tensor; and
yielding one tensor at a time bounds the extra memory to one full tensor plus the consumer's
bucket. `all_stages=False` yields only the caller's stage (still TP-gathered), for writers that
store each stage's part themselves (HF or HDF5 export) and need no cross-stage traffic.

The iterator is a collective: all model-parallel ranks of a replica must exhaust it together.
Yielded tensors may share storage with the live parameters (no copy is made where none is
needed): consume or copy them before the next optimizer step.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from verl_hpc.models.hf_checkpoint import HFCheckpointReader, WeightFileError
from verl_hpc.models.weight_rules import Layout, Piece, rule_for

log = logging.getLogger(__name__)
EXPERT_BIAS = ".mlp.router.expert_bias"  # Megatron's name (after the layer) of a router's bias buffer


@dataclasses.dataclass
class LoadReport:
    parameters: int  # Megatron parameters filled on this rank
    elements: int  # their total number of elements
    bytes_read: int  # bytes copied out of the checkpoint files by this rank


def _chunks(model) -> list:
    """A model, or the list of this rank's virtual-pipeline chunks, as a list of the GPTModels
    from build_gpt_model (unwrapping Megatron's DDP / Float16Module wrappers)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for i, chunk in enumerate(chunks):
        while not hasattr(chunk, "verl_arch") and hasattr(chunk, "module"):
            chunk = chunk.module
        if not hasattr(chunk, "verl_arch"):
            raise TypeError(f"{type(chunk).__name__} was not built by "
                            f"verl_hpc.models.build_gpt_model (it has no verl_arch)")
        chunks[i] = chunk
    return chunks


def _layer_numbers(model) -> Dict[int, int]:
    """Stage-local layer index -> global HF layer index (carries the pipeline offset)."""
    return {j: layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}


def _layout(model) -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(tp_rank=ps.get_tensor_model_parallel_rank(),
                  tp=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.vocab_size,
                  ep_rank=ps.get_expert_model_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
                  etp_rank=ps.get_expert_tensor_parallel_rank(),
                  etp=ps.get_expert_tensor_parallel_world_size())


def _exported_params(chunk) -> List[Tuple[str, torch.nn.Parameter]]:
    """Parameters in a stable order, minus the tied output layer of the last stage (the HF
    checkpoint stores a tied lm_head once, as the embedding) and minus adapter parameters (LoRA
    factors, marked `hf_adapter`: models/lora.py exports them, or merged into their weight)."""
    arch = chunk.verl_arch
    return [(n, p) for n, p in _loaded_params(chunk)
            if not (arch.tie_word_embeddings and n == "output_layer.weight")]


def _loaded_params(chunk) -> List[Tuple[str, torch.nn.Parameter]]:
    """The parameters an HF folder holds: all but adapter parameters; and the buffers it holds:
    a sigmoid router's per-expert bias (DeepSeek-V3's e_score_correction_bias), which Megatron
    keeps as a buffer and moves by its own rule (models/deepseek.py)."""
    params = [(n, p) for n, p in chunk.named_parameters() if not getattr(p, "hf_adapter", False)]
    return params + [(n, b) for n, b in chunk.named_buffers() if n.endswith(EXPERT_BIAS)]


def _export_value(chunk, name: str, param: torch.Tensor) -> torch.Tensor:
    """What the export sends for a parameter: the owning module's `exported_weight()` where it
    has one (a LoRA-adapted layer: W merged with its adapter, models/lora.py), else the parameter."""
    if name.endswith(".weight"):
        merged = getattr(chunk.get_submodule(name.rpartition(".")[0]), "exported_weight", None)
        if merged is not None:
            return merged()
    return param


def _rule(chunk, name: str, param, layers, lay):
    """(rule, global layer or None) of a parameter: the text families' (weight_rules.rule_for), or a
    vision-language model's tower tensor, whole and under its own name (models/vlm.py)."""
    arch = chunk.verl_arch
    if arch.vision is not None and name.startswith("visual."):
        from verl_hpc.models.vlm import TowerTensor

        return TowerTensor.of(name, param), None
    return rule_for(name, arch, layers, lay.expert_offset(arch))


def _named(arch, name: str) -> str:
    """The name an HF tensor is exported under: a vision-language model's decoder under
    transformers 5's names (models/vlm_arch.hf_name), any other model's as the rules give it."""
    if arch.vision is None:
        return name
    from verl_hpc.models.vlm_arch import hf_name

    return hf_name(name)


def _load_param(reader, chunk, name, param, layers, lay) -> None:
    arch = chunk.verl_arch
    rule, layer = _rule(chunk, name, param, layers, lay)
    lay = lay.for_group(rule.group)
    shard = rule.load(reader, arch, layer, lay)
    if tuple(shard.shape) != tuple(param.shape):
        raise WeightFileError(f"{name}: the HF checkpoint gives shape {tuple(shard.shape)} for "
                              f"TP rank {lay.tp_rank}/{lay.tp}, the model expects "
                              f"{tuple(param.shape)}; does config.json match the weights?")
    split = bool(getattr(param, "tensor_model_parallel", False))
    if lay.tp > 1 and (split != (rule.tp_dim is not None)
                       or (split and param.partition_dim != rule.tp_dim)):
        raise RuntimeError(f"{name}: Megatron marks it tensor_model_parallel={split} "
                           f"partition_dim={getattr(param, 'partition_dim', None)}, the HF "
                           f"mapping splits dim {rule.tp_dim}; build it with build_gpt_model")
    with torch.no_grad():
        param.copy_(shard)


def load_hf_weights(model, checkpoint: Union[str, Path, HFCheckpointReader]) -> LoadReport:
    """Fill every parameter of this rank's `model` (from `gpt.build_gpt_model`, or the list of
    its virtual-pipeline chunks) from the HF checkpoint, reading only this rank's slices."""
    reader = checkpoint if isinstance(checkpoint, HFCheckpointReader) else HFCheckpointReader(checkpoint)
    start_bytes, count, elements = reader.bytes_read, 0, 0
    for chunk in _chunks(model):
        lay, layers = _layout(chunk), _layer_numbers(chunk)
        source = reader
        if chunk.verl_arch.vision is not None:  # either layout of a Qwen2.5-VL folder (models/vlm_arch.py)
            from verl_hpc.models.vlm_arch import FolderReader

            source = FolderReader(reader)
        for name, param in _loaded_params(chunk):
            _load_param(source, chunk, name, param, layers, lay)
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


def _expert_peers(rule, arch, lay: Layout) -> List[Any]:
    """A routed expert's rule bound to the same local expert of every EP rank, in EP-rank order:
    what the EP all-gather of this rank's expert yields (one rule, unbound, for anything else)."""
    if getattr(rule, "expert", None) is None or lay.ep == 1:
        return [rule]
    per_rank = arch.moe.num_experts // lay.ep
    local = rule.expert - lay.expert_offset(arch)
    return [dataclasses.replace(rule, expert=r * per_rank + local) for r in range(lay.ep)]


# An export source: for a chunk, its items (name, tensor, rule, global layer) in a stable order,
# and the (HF name, shape) entries they produce without any tensor (for the pipeline plan).
def _weight_items(chunk):
    layers, lay = _layer_numbers(chunk), _layout(chunk)
    for name, param in _exported_params(chunk):
        rule, layer = _rule(chunk, name, param, layers, lay)
        yield _export_value(chunk, name, param), rule, layer, rule.to_hf


def _weight_entries(chunk):
    """(HF name, shape, dtype): the dtype is the parameter's own. Not every tensor has the model's
    dtype (a sigmoid router's expert_bias stays fp32 in a bf16 model), and a pipeline stage that
    receives a tensor must allocate it as the sender sends it."""
    layers, arch, lay = _layer_numbers(chunk), chunk.verl_arch, _layout(chunk)
    for name, param in _exported_params(chunk):
        rule, layer = _rule(chunk, name, param, layers, lay)
        for peer in _expert_peers(rule, arch, lay):
            for hf_name, shape in peer.hf_entries(arch, layer):
                yield hf_name, shape, param.dtype


def _stage_entries(model, entries=_weight_entries) -> List[tuple]:
    """(HF name, shape[, dtype]) of everything this stage exports, in export order."""
    return [(_named(chunk.verl_arch, e[0]), *e[1:]) for chunk in _chunks(model) for e in entries(chunk)]


def _stage_tensors(model, dtype, items=_weight_items) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors, TP-gathered (collective over the TP group)."""
    from megatron.core import parallel_state as ps

    groups = {"tp": ps.get_tensor_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group}
    for chunk in _chunks(model):
        arch, lay = chunk.verl_arch, _layout(chunk)
        for tensor, rule, layer, to_hf in items(chunk):
            rlay = lay.for_group(rule.group)
            group = groups[rule.group]() if rlay.tp > 1 else None
            full = _tp_gather(tensor, rule.tp_dim, group, rlay.tp)
            peers = _expert_peers(rule, arch, lay)
            fulls = [full]
            if len(peers) > 1:  # the same local expert of every EP rank
                fulls = [torch.empty_like(full) for _ in peers]
                dist.all_gather(fulls, full.contiguous(), group=ps.get_expert_model_parallel_group())
            for peer, one in zip(peers, fulls):
                for hf_name, t in (peer.to_hf(one, arch, layer, rlay) if len(peers) > 1
                                   else to_hf(one, arch, layer, rlay)):
                    yield _named(arch, hf_name), (t if dtype is None else t.to(dtype))


def local_hf_pieces(model) -> Iterator[Piece]:
    """This rank's own parts of the HF tensors, in HF coordinates, with no collective: views of
    its parameters (LoRA-adapted weights merged), for the sliced weight sync
    (verl_hpc.resharding.plan). Replicated tensors (norms) come from every TP rank."""
    for chunk in _chunks(model):
        arch, lay = chunk.verl_arch, _layout(chunk)
        for tensor, rule, layer, _ in _weight_items(chunk):
            for piece in rule.pieces(tensor.detach(), arch, layer, lay.for_group(rule.group)):
                yield dataclasses.replace(piece, hf=_named(arch, piece.hf))


def stage_entries(model) -> List[Tuple[str, Tuple[int, ...]]]:
    """(HF name, full shape) of every tensor this rank's stage exports, in export order."""
    return [(name, shape) for name, shape, *_ in _stage_entries(model)]


def model_arch(model):
    """The ModelArch the model was built from."""
    return _chunks(model)[0].verl_arch


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's parameters (what the full export sends)."""
    return next(p for chunk in _chunks(model) for _, p in chunk.named_parameters()).dtype


def export_hf_weights(model, *, all_stages: bool = True,
                      dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` per the layout contract in the module docstring.

    model: this rank's model, or its list of virtual-pipeline chunks (then the order is stage
    by stage, chunk by chunk: still the same on every rank, no longer strictly HF order).
    dtype: cast each tensor (default: the parameters' dtype). A collective iterator.
    LoRA-adapted weights are exported merged with their adapter (models/lora.py).
    """
    yield from export_stages(model, _weight_items, _weight_entries, all_stages=all_stages, dtype=dtype)


def export_stages(model, items, entries, *, all_stages: bool = True,
                  dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The export machinery for any source of items (the weights here, LoRA factors in
    models/lora.py): TP-gather per item, then every stage's tensors broadcast over the pipeline."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if not all_stages or pp == 1:
        yield from _stage_tensors(model, dtype, items)
        return
    group, my_stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    first_param = next(p for chunk in _chunks(model) for _, p in chunk.named_parameters())
    param_dtype, device = first_param.dtype, first_param.device
    # Every stage learns every stage's (name, shape[, dtype]) list: one small exchange per export.
    plans: List[List[tuple]] = [None] * pp  # type: ignore[list-item]
    dist.all_gather_object(plans, _stage_entries(model, entries), group=group)
    for stage, plan in enumerate(plans):
        src = dist.get_global_rank(group, stage)
        mine = _stage_tensors(model, dtype, items) if stage == my_stage else None
        for hf_name, shape, *sent_dtype in plan:
            if mine is not None:
                got_name, tensor = next(mine)
                if got_name != hf_name or tuple(tensor.shape) != tuple(shape):
                    raise RuntimeError(f"export plan mismatch: planned {hf_name} {shape}, "
                                       f"produced {got_name} {tuple(tensor.shape)}")
                tensor = tensor.contiguous()
            else:
                # as the sender sends it: the cast dtype, else the tensor's own (entries carry it)
                tensor = torch.empty(shape, dtype=dtype or (sent_dtype[0] if sent_dtype else param_dtype),
                                     device=device)
            dist.broadcast(tensor, src=src, group=group)
            yield hf_name, tensor
