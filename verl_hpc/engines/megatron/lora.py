"""LoRA in the Megatron engine: adapters on the actor's layers, the base frozen, and the base
model's identity in checkpoints.

    spec = adapter_spec(options.lora)                      # None: full-parameter training
    attach(gpt_chunks, spec, seed, sequence_parallel)     # before DDP: only adapters train

The adapter layers themselves are verl_hpc.models.lora (they sit next to the weight mapping that
exports them). Freezing happens before Megatron's DDP wraps the model: DDP and the (distributed)
optimizer collect only parameters that require gradients, so the base weights get no gradient
buffer, no fp32 main copy and no Adam moments, and checkpoints hold the adapters only.

The reference policy is the actor with its adapters off (engine.adapters_off()), not a second
model: with LoRA, `ref` costs no memory.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from verl_hpc.checkpoint.base_model import base_fingerprint, check_base_model
from verl_hpc.checkpoint.errors import CheckpointLayoutError
from verl_hpc.models.lora import AdapterSpec, adapter_parameters, attach_adapters

log = logging.getLogger(__name__)


def adapter_spec(lora) -> Optional[AdapterSpec]:
    """The engine's adapter from the job's lora section (None or rank 0: no adapters)."""
    if lora is None or not lora.enabled:
        return None
    return AdapterSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                       targets=tuple(lora.target_modules), init=lora.init)


def attach(gpt_chunks, spec: AdapterSpec, *, seed: int, sequence_parallel: bool) -> int:
    """Adapters on every targeted layer, every other parameter frozen; returns this rank's
    trainable parameter count."""
    count = attach_adapters(gpt_chunks, spec, seed=seed, sequence_parallel=sequence_parallel)
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


def load_peft_folder(gpt_chunks, spec: AdapterSpec, folder: str) -> None:
    """Start from the PEFT adapter in `folder` (lora.init_from): this rank's shards of its factors.
    Its rank and target modules must be the job's (ConfigError naming lora.init_from otherwise)."""
    from safetensors.torch import load_file

    from verl_hpc.config import ConfigError
    from verl_hpc.models.lora import hf_target_modules, load_adapter

    path = Path(folder)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"lora.init_from: {folder!r} is not a readable PEFT adapter folder "
                          f"(adapter_config.json + adapter_model.safetensors): {e}") from e
    want = sorted(hf_target_modules(spec.targets))
    if config.get("r") != spec.rank or sorted(config.get("target_modules") or []) != want:
        raise ConfigError(f"lora.init_from: {folder} has r = {config.get('r')} on "
                          f"{sorted(config.get('target_modules') or [])}; this job has lora.rank = {spec.rank} "
                          f"on {want} (lora.target_modules): set them to the adapter's")
    if float(config.get("lora_alpha", spec.alpha)) != spec.alpha:
        log.warning("lora.init_from: the adapter was trained with lora_alpha %s, this job scales by "
                    "lora.alpha = %s", config.get("lora_alpha"), spec.alpha)
    try:
        load_adapter(gpt_chunks, tensors)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"lora.init_from: {folder}: {e}") from e


def state_meta(spec: AdapterSpec, model_path: str) -> dict:
    """What a checkpoint records about its adapters and their base."""
    return {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets),
            "base_path": str(model_path), "base_fingerprint": base_fingerprint(model_path)}


def check_state_meta(saved: Optional[dict], spec: Optional[AdapterSpec], model_path: str) -> None:
    """Refuse a checkpoint whose adapters do not fit this engine: full weights into a LoRA
    engine or the reverse, another rank or targets, or another base model
    (CheckpointLayoutError, exit code 23, each naming what to change)."""
    if (saved is None) != (spec is None):
        have = "adapters only (lora.rank > 0)" if saved else "full weights (lora.rank = 0)"
        raise CheckpointLayoutError(f"the checkpoint holds {have}; this job has lora.rank = "
                         f"{spec.rank if spec else 0}: resume with the lora settings it was saved with")
    if spec is None:
        return
    mine = {"rank": spec.rank, "targets": list(spec.targets)}
    for key in ("rank", "targets"):
        if saved[key] != mine[key]:
            raise CheckpointLayoutError(f"the checkpoint's adapters have lora {key} {saved[key]}, this job "
                             f"{mine[key]}: resume with the lora settings it was saved with")
    check_base_model(saved, model_path)
