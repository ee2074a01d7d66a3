"""The LoRA tests' independent reference: Hugging Face `peft` on the transformers model.

`random_adapter(model_path, rank, targets)` makes a PEFT LoRA adapter with random, non-zero A and B
(PEFT starts B at zero, which would test nothing), the A of q/k/v and of gate/up equal (Megatron's
fused layers hold one A for them: verl_hpc/models/lora.py) unless `tie_a=False` (a stock PEFT
adapter: one A per module), and returns its tensors under PEFT's saved names. `peft_logits` runs
the HF model with that adapter in float64. `**options` are PEFT LoraConfig fields (use_rslora).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

HF_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
SHARED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def peft_model(model_path, rank: int, alpha: float, targets: Sequence[str], dtype=torch.float64,
               tie_a: bool = True, **options):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    modules = [m for t in targets for m in HF_TARGETS[t]]
    options = {"lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", **options}
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, **options))
    if not tie_a:
        return model
    # Megatron's fused layers hold ONE A for q/k/v (gate/up): tie them here too, so that a training
    # step sums their gradients into one parameter as Megatron does
    for layer in model.base_model.model.model.layers:
        for group in SHARED:
            parents = [layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp for name in group]
            mods = [getattr(p, name) for p, name in zip(parents, group)]
            if all(hasattr(m, "lora_A") for m in mods):
                for m in mods[1:]:
                    m.lora_A["default"] = mods[0].lora_A["default"]
    return model


def random_adapter(model_path, rank: int = 4, alpha: float = 8.0,
                   targets: Sequence[str] = tuple(HF_TARGETS), seed: int = 3,
                   tie_a: bool = True) -> Dict[str, torch.Tensor]:
    """{PEFT saved name: fp32 tensor} of a random adapter (module docstring)."""
    from peft import get_peft_model_state_dict

    model = peft_model(model_path, rank, alpha, targets, dtype=torch.float32)
    state = get_peft_model_state_dict(model)
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(v.shape, generator=g) * (0.2 if "lora_A" in k else 0.1) for k, v in state.items()}
    if not tie_a:
        return out
    for group in SHARED:  # one A per fused Megatron layer
        for name in list(out):
            if f".{group[0]}.lora_A" in name:
                for other in group[1:]:
                    out[name.replace(f".{group[0]}.", f".{other}.")] = out[name].clone()
    return out


def peft_logits(model_path, adapter: Dict[str, torch.Tensor], rank: int, alpha: float,
                targets: Sequence[str], input_ids: torch.Tensor, **options) -> torch.Tensor:
    """float64 logits of the HF model with `adapter` applied by peft (stock PEFT: one A per module,
    whatever the adapter's A hold)."""
    from peft import set_peft_model_state_dict

    model = peft_model(model_path, rank, alpha, targets, tie_a=False, **options)
    result = set_peft_model_state_dict(model, {k: v.double() for k, v in adapter.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def save_peft(model_path, folder, rank: int = 4, alpha: float = 8.0, targets: Sequence[str] = tuple(HF_TARGETS),
              seed: int = 7, **options):
    """A PEFT adapter folder as peft itself writes it (save_pretrained) with random non-zero factors:
    stock PEFT, so the A of q, k and v differ. `options`: LoraConfig fields (use_rslora, use_dora)."""
    model = peft_model(model_path, rank, alpha, targets, dtype=torch.float32, tie_a=False, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(folder))
    return folder
