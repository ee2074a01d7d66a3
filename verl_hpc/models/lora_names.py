"""PEFT's names and layouts of LoRA adapter factors: pure rules, no Megatron, no layers.

    hf_target_modules(["linear_qkv"])             # PEFT target_modules: ["q_proj", "k_proj", "v_proj"]
    peft_config(rank, alpha, targets, use_rslora=False)    # adapter_config.json
    factor_peft_name("model.layers.3.self_attn.q_proj.weight", "A")
    factor_rule(target, "A" | "B", per_module_a)  # the weight_rules rule of a factor (TP split, HF names)
    factor_hf_entries(arch, target, factor, layer, rank)   # (PEFT name, shape), no tensors

A factor is laid out over the TP ranks as its layer's weight is (models/lora.py says why), so B of
a fused layer follows the weight's own rules (QKV, GateUp); the fused layers' A follow _FusedA.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.weight_rules import LAYER, QKV, Copy, GateUp, Layout, Split

PEFT_PREFIX = "base_model.model."
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")  # fused: one HF module per part
# Megatron target -> the HF modules it is (PEFT's target_modules)
HF_MODULES = {"linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "linear_proj": ("self_attn.o_proj",),
              "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
              "linear_fc2": ("mlp.down_proj",)}


def hf_target_modules(targets: Sequence[str]) -> List[str]:
    """PEFT's target_modules for Megatron targets: ["q_proj", "k_proj", ...]."""
    return [m.rpartition(".")[2] for t in targets for m in HF_MODULES[t]]


# a vision-language model's tower in PEFT's exclude_modules (a regex over module names): its MLP layers
# have the decoder's leaf names (gate_proj, up_proj, down_proj), and the adapters are the decoder's only
VISION_EXCLUDE = r".*\.visual\..*"


def peft_config(rank: int, alpha: float, targets: Sequence[str], *, use_rslora: bool, dropout: float = 0.0,
                base_model: str = "", vision: bool = False) -> dict:
    """The adapter_config.json that PEFT (and vLLM) read for an adapter of Megatron `targets`
    (`vision`: of a vision-language model's language model)."""
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
           "lora_dropout": dropout, "target_modules": hf_target_modules(targets),
           "bias": "none", "fan_in_fan_out": False, "use_rslora": bool(use_rslora), "use_dora": False,
           "modules_to_save": None, "base_model_name_or_path": base_model, "inference_mode": True}
    if vision:
        out["exclude_modules"] = VISION_EXCLUDE
    return out


def factor_peft_name(hf_weight_name: str, factor: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"""
    stem = hf_weight_name[: -len(".weight")]
    return f"{PEFT_PREFIX}{stem}.lora_{factor}.weight"


class PeftReader:
    """A weight_rules reader over PEFT tensors: the rules ask for HF weight names, it answers with
    the factor's tensor of the same module."""

    def __init__(self, tensors: Dict[str, torch.Tensor], factor: str):
        self.tensors, self.factor = tensors, factor

    def _get(self, name):
        key = factor_peft_name(name, self.factor)
        if key not in self.tensors:
            raise KeyError(f"the adapter has no {key}")
        return self.tensors[key]

    def shape(self, name):
        return tuple(self._get(name).shape)

    def dtype(self, name):
        return self._get(name).dtype

    def read(self, name, index=None):
        t = self._get(name)
        return (t if index is None else t[index]).clone()


@dataclasses.dataclass(frozen=True)
class _FusedA:
    """The A of a fused column layer (q/k/v, gate/up), whole on every TP rank. Shared (one [r, in]):
    exported to each HF module, loaded from the first after checking the others are equal. Per
    module ([parts * r, in]): module k's A is rows k*r..(k+1)*r."""

    hf: Tuple[str, ...]
    per_module: bool = False
    tp_dim: Optional[int] = None
    group: str = "tp"

    def to_hf(self, full, arch, layer, lay):
        names = [h.format(i=layer) for h in self.hf]
        return list(zip(names, full.chunk(len(names)) if self.per_module else [full] * len(names)))

    def load(self, reader, arch, layer, lay):
        names = [h.format(i=layer) for h in self.hf]
        if self.per_module:
            return torch.cat([reader.read(n) for n in names])
        first = reader.read(names[0])
        for other in names[1:]:
            if not torch.equal(reader.read(other), first):
                a, b = (factor_peft_name(n, reader.factor) for n in (other, names[0]))
                raise ConfigError(f"{a} differs from {b}: Megatron's fused layer holds one lora_A for "
                                  "them; this adapter cannot be loaded exactly")
        return first


def _hf_weight(module_name: str) -> str:
    return f"{LAYER}{module_name}.weight"


def factor_rule(target: str, factor: str, per_module_a: bool = False):
    """The weight_rules rule of one adapter factor (`factor` "A" or "B"), over HF weight names
    that PeftReader / factor_peft_name translate to the factor's PEFT names."""
    hf = [_hf_weight(m) for m in HF_MODULES[target]]
    if target == "linear_qkv":
        return _FusedA(tuple(hf), per_module_a) if factor == "A" else QKV("weight")
    if target == "linear_fc1":
        return _FusedA(tuple(hf), per_module_a) if factor == "A" else GateUp()
    return Split(hf[0], "proj" if target == "linear_proj" else "ffn") if factor == "A" else Copy(hf[0])


def factor_hf_entries(arch, target: str, factor: str, layer: int, rank: int):
    """(PEFT name, shape) of what one factor exports to, without any tensor (export plans)."""
    q_rows = arch.num_attention_heads * arch.head_dim
    kv_rows = arch.num_query_groups * arch.head_dim
    h, f = arch.hidden_size, arch.ffn_hidden_size
    # (rows of each HF module's B, columns of A) per target
    outs, width = {"linear_qkv": ((q_rows, kv_rows, kv_rows), h),
                   "linear_proj": ((h,), q_rows),
                   "linear_fc1": ((f, f), h),
                   "linear_fc2": ((h,), f)}[target]
    names = [_hf_weight(m).format(i=layer) for m in HF_MODULES[target]]
    if factor == "A":
        return [(factor_peft_name(n, "A"), (rank, width)) for n in names]
    return [(factor_peft_name(n, "B"), (rows, rank)) for n, rows in zip(names, outs)]


def to_peft(rule, full: torch.Tensor, arch, layer: int, lay: Layout, factor: str):
    """PEFT (name, tensor) pairs of one TP-gathered factor."""
    return [(factor_peft_name(name, factor), t) for name, t in rule.to_hf(full, arch, layer, lay)]
