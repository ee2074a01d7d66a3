"""The FSDP engine's weight stream: (HF name, full tensor) on every rank, what the weight sync and
save_hf read (the sliced sync reads this rank's shards instead: holdings.py).

    for name, tensor in hf_weights(engine):   # inside engine.resident("forward")
        ...

One parameter at a time, each an all-gather over the mesh, in the model's parameter order, under
the checkpoint's names: an MoE model's fused experts one tensor per expert and matrix, as the
folder stores them and the rollouts load them (models/moe.checkpoint_tensors). Then the persistent
buffers, which are checkpoint tensors too (DeepSeek-V3's router bias), whole on every rank. Under
LoRA the merged weights (lora.py).
"""
from __future__ import annotations

from typing import Iterator, Tuple

import torch

from verl_hpc.models.moe import checkpoint_tensors


def hf_weights(engine) -> Iterator[Tuple[str, torch.Tensor]]:
    if engine.lora is not None:
        from verl_hpc.engines.fsdp.lora import merged_weights

        yield from merged_weights(engine)
        return
    yield from model_tensors(engine.model)


def model_tensors(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """A sharded model's parameters gathered whole, in the checkpoint's names, then its persistent buffers."""
    for name, p in model.named_parameters():
        yield from checkpoint_tensors(model, name, full_tensor(p))
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buf.detach()


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (an all-gather for a sharded one), detached."""
    data = p.detach()
    return data.full_tensor() if hasattr(data, "full_tensor") else data
