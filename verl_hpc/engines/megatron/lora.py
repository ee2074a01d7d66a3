"""LoRA in the Megatron engine: adapters on the actor's layers, the base frozen, and the base
model's identity in checkpoints.

    spec = adapter_spec(options.lora)                      # None: full-parameter training
    spec, start = read_peft_folder(spec, folder, arch)     # lora.init_from: checked tensors
    attach(gpt_chunks, spec, seed, sequence_parallel, start)   # before DDP: only adapters train

The adapter layers themselves are verl_hpc.models.lora (they sit next to the weight mapping that
exports them). Freezing happens before Megatron's DDP wraps the model: DDP and the (distributed)
optimizer collect only parameters that require gradients, so the base weights get no gradient
buffer, no fp32 main copy and no Adam moments, and checkpoints hold the adapters only.

The reference policy is the actor with its adapters off (engine.adapters_off()), not a second
model: with LoRA, `ref` costs no memory.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from verl_hpc.checkpoint.base_model import base_fingerprint, check_base_model
from verl_hpc.checkpoint.errors import CheckpointLayoutError
from verl_hpc.models.lora import AdapterSpec, adapter_parameters, attach_adapters, load_adapter

log = logging.getLogger(__name__)


def adapter_spec(lora) -> Optional[AdapterSpec]:
    """The engine's adapter from the job's lora section (None or rank 0: no adapters)."""
    if lora is None or not lora.enabled:
        return None
    return AdapterSpec.from_config(lora)


def attach(gpt_chunks, spec: AdapterSpec, *, seed: int, sequence_parallel: bool,
           start: Optional[Dict[str, torch.Tensor]] = None) -> int:
    """Adapters on every targeted layer (fresh, or this rank's shards of the PEFT tensors `start`),
    every other parameter frozen; returns this rank's trainable parameter count."""
    count = attach_adapters(gpt_chunks, spec, seed=seed, sequence_parallel=sequence_parallel)
    if start is not None:
        load_adapter(gpt_chunks, start)
    trainable = {id(p) for p in adapter_parameters(gpt_chunks)}
    frozen = 0
    for gpt in gpt_chunks:
        for p in gpt.parameters():
            if id(p) not in trainable:
                p.requires_grad_(False)
                frozen += p.numel()
    log.info("LoRA rank %d on %s: %.3f M trainable parameters on this rank, %.1f M frozen",
             spec.rank, ", ".join(spec.targets), count / 1e6, frozen / 1e6)
    return count


def read_peft_folder(spec: AdapterSpec, folder: str, arch) -> Tuple[AdapterSpec, Dict[str, torch.Tensor]]:
    """The PEFT adapter in `folder` (lora.init_from), checked as the submitter checks it before the
    queue (models/peft_adapter.py; this is the backstop for a job started without those checks),
    and the spec that holds it: one A per q/k/v (gate/up) module where its A differ (a stock PEFT
    adapter). ConfigError naming lora.init_from for an adapter the engine would compute otherwise
    than PEFT, WeightFileError (exit code 13) for an unreadable file or non-finite values."""
    from verl_hpc.models.peft_adapter import check_adapter

    found = check_adapter(folder, spec, arch, values=True, keep=True)
    found.raise_first()
    if found.per_module_a:
        log.info("lora.init_from: %s has its own lora_A per q/k/v (gate/up) module: the fused layers "
                 "hold one A per module", folder)
    return dataclasses.replace(spec, per_module_a=bool(found.per_module_a)), found.tensors


def state_meta(spec: AdapterSpec, model_path: str) -> dict:
    """What a checkpoint records about its adapters and their base."""
    return {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets), "use_rslora": spec.use_rslora,
            "per_module_a": spec.per_module_a,
            "base_path": str(model_path), "base_fingerprint": base_fingerprint(model_path)}


# what a resume must keep: the meta's key, the field that sets it, and its value in a checkpoint
# written before the key was recorded
_KEPT = (("rank", "lora.rank", None), ("alpha", "lora.alpha", None), ("targets", "lora.target_modules", None),
         ("use_rslora", "lora.use_rslora", False))


# how each engine holds its adapters (a checkpoint's lora record names its engine; none: Megatron)
_HELD = {"megatron": "the Megatron engine's fused adapters (one lora_A per fused layer)",
         "fsdp": "the FSDP engine's PEFT adapters (PEFT's names, one lora_A per module)"}


def check_state_meta(saved: Optional[dict], spec: Optional[AdapterSpec], model_path: str,
                     engine: str = "megatron") -> None:
    """Refuse a checkpoint whose adapters do not fit this engine: full weights into a LoRA
    engine or the reverse, the other engine's adapters (`engine`: the one resuming), another rank
    or targets, or another base model (CheckpointLayoutError, exit code 23, each naming what to
    change). Another alpha or use_rslora would load the factors under another scale: a different
    model, with no error."""
    if (saved is None) != (spec is None):
        have = "adapters only (lora.rank > 0)" if saved else "full weights (lora.rank = 0)"
        raise CheckpointLayoutError(f"the checkpoint holds {have}; this job has lora.rank = "
                         f"{spec.rank if spec else 0}: resume with the lora settings it was saved with")
    if spec is None:
        return
    theirs = saved.get("engine", "megatron")
    if theirs != engine:
        raise CheckpointLayoutError(f"the checkpoint holds {_HELD.get(theirs, theirs)}; this job's {engine} engine "
                                    f"holds {_HELD[engine]}: resume it with parallel.engine={theirs}")
    mine = state_meta(spec, model_path)
    for key, field, old in _KEPT:
        theirs = saved.get(key, old)
        if theirs != mine[key]:
            raise CheckpointLayoutError(f"the checkpoint's adapters have {field} = {_show(theirs)}, this job "
                                        f"{field} = {_show(mine[key])}: resume with the lora settings it was saved "
                                        f"with (set {field} = {_show(theirs)})")
    if saved.get("per_module_a", False) != mine["per_module_a"]:
        how = {True: "one lora_A per q/k/v (gate/up) module (started from a stock PEFT adapter)",
               False: "one lora_A shared by q/k/v (gate/up)"}
        raise CheckpointLayoutError(f"the checkpoint's adapters hold {how[saved.get('per_module_a', False)]}, this "
                                    f"job's {how[mine['per_module_a']]}: resume with the lora.init_from it was "
                                    "started from")
    check_base_model(saved, model_path)


def _show(value) -> str:
    """A config value as YAML writes it (true, [a, b], 8.0)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
