"""HF <-> Megatron tensor rules for Llama-style decoders (Llama, Qwen2, Mistral, and the mixture-of-
experts Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): the tables of which rule each Megatron parameter
follows (a decoder layer's, latent attention's, a routed expert's, the model's own), and their lookup
(`rule_for`, `layer_rules`, `model_rules`, `expected_hf_tensors`). The rule classes themselves (what
a rule does with a tensor: load, to_hf, hf_entries, pieces; the Megatron layouts they follow) are in
verl_hpc.models.weight_rule_classes; their names are importable from here too, as before the split.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from verl_hpc.models.config_mapping import ModelArch
from verl_hpc.models.moe import split_local_expert
from verl_hpc.models.weight_rule_classes import (  # noqa: F401 - the rule classes, under their old module too
    LAYER,
    QKV,
    Copy,
    GateUp,
    HFTensors,
    Layout,
    Piece,
    Rows,
    Split,
    Vocab,
)

# Megatron parameter name within a decoder layer -> rule. Local spec names, plus the Transformer
# Engine spec's names for the norms it fuses into the following linear layer.
LAYER_RULES: Dict[str, object] = {
    "input_layernorm.weight": Copy(LAYER + "input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_weight": Copy(LAYER + "input_layernorm.weight"),
    "self_attention.linear_qkv.weight": QKV("weight"),
    "self_attention.linear_qkv.bias": QKV("bias"),
    "self_attention.linear_proj.weight": Split(LAYER + "self_attn.o_proj.weight", "proj"),
    "pre_mlp_layernorm.weight": Copy(LAYER + "post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_weight": Copy(LAYER + "post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": GateUp(),
    "mlp.linear_fc2.weight": Split(LAYER + "mlp.down_proj.weight", "ffn"),
    # mixture-of-experts layers (models/moe.py)
    "self_attention.q_layernorm.weight": Copy(LAYER + "self_attn.q_norm.weight", shape=("head",)),
    "self_attention.k_layernorm.weight": Copy(LAYER + "self_attn.k_norm.weight", shape=("head",)),
    "mlp.router.weight": Copy("{router}", shape=("experts", "hidden")),
    "mlp.shared_experts.linear_fc1.weight": GateUp(hf=("{shared}gate_proj.weight", "{shared}up_proj.weight"),
                                                   ffn="shared_ffn"),
    "mlp.shared_experts.linear_fc2.weight": Split("{shared}down_proj.weight", "shared_ffn"),
    "mlp.shared_experts.gate_weight": Copy(LAYER + "mlp.shared_expert_gate.weight", shape=("one", "hidden")),
}
# multi-head latent attention (DeepSeek-V3): replaces the q/k/v rules and Qwen3's q/k norms; the
# Transformer Engine spec fuses the latent norms into the up projections (layer_norm_weight). The
# router's per-expert bias is a buffer of Megatron's router (trained by its own rule, not Adam).
MLA_RULES: Dict[str, object] = {
    "self_attention.linear_q_proj.weight": Rows(LAYER + "self_attn.q_proj.weight", "q_proj", "hidden"),
    "self_attention.linear_q_down_proj.weight": Rows(LAYER + "self_attn.q_a_proj.weight", "q_lora", "hidden"),
    "self_attention.q_layernorm.weight": Copy(LAYER + "self_attn.q_a_layernorm.weight", shape=("q_lora",)),
    "self_attention.linear_q_up_proj.layer_norm_weight": Copy(LAYER + "self_attn.q_a_layernorm.weight",
                                                              shape=("q_lora",)),
    "self_attention.linear_q_up_proj.weight": Rows(LAYER + "self_attn.q_b_proj.weight", "q_proj", "q_lora"),
    "self_attention.linear_kv_down_proj.weight": Rows(LAYER + "self_attn.kv_a_proj_with_mqa.weight", "kv_a",
                                                      "hidden"),
    "self_attention.kv_layernorm.weight": Copy(LAYER + "self_attn.kv_a_layernorm.weight", shape=("kv_lora",)),
    "self_attention.linear_kv_up_proj.layer_norm_weight": Copy(LAYER + "self_attn.kv_a_layernorm.weight",
                                                               shape=("kv_lora",)),
    "self_attention.linear_kv_up_proj.weight": Rows(LAYER + "self_attn.kv_b_proj.weight", "kv_b", "kv_lora"),
    "mlp.router.expert_bias": Copy(LAYER + "mlp.gate.e_score_correction_bias", shape=("experts",)),
}
# a routed expert's parameters (after `mlp.experts.local_experts.{j}.`); rule_for binds the expert
EXPERT_RULES: Dict[str, object] = {
    "linear_fc1.weight": GateUp(hf=("{expert:gate}", "{expert:up}"), ffn="expert_ffn", group="etp"),
    "linear_fc2.weight": Split("{expert:down}", "expert_ffn", group="etp"),
}


def _all_rules(arch: ModelArch) -> Dict[str, object]:
    """The layer rules of `arch`'s attention: q/k/v (LAYER_RULES), or latent attention's."""
    if arch.mla is None:
        return LAYER_RULES
    return {**{n: r for n, r in LAYER_RULES.items() if not n.startswith("self_attention.")
               or n in ("self_attention.linear_proj.weight",)}, **MLA_RULES}


def layer_rules(arch: ModelArch) -> Dict[str, object]:
    """The layer rules a model of `arch` has parameters for (the TE spec's fused-norm names kept).
    With dense first layers (DeepSeek-V3) both the dense MLP's and the MoE layer's: a layer's
    Megatron parameters say which it is."""
    return {n: r for n, r in _all_rules(arch).items()
            if _layer_rule_applies(n, arch) or n.endswith("layer_norm_weight")
            or (arch.moe is not None and arch.moe.first_dense and _layer_rule_applies(n, arch, 0))}


def _layer_rule_applies(name: str, arch: ModelArch, layer: Optional[int] = None) -> bool:
    """Which layer rules a checkpoint of `arch` holds (the TE spec's fused-norm names aside), at
    `layer` (None: a MoE layer, where the model has them)."""
    dense = arch.moe is None or (layer is not None and layer < arch.moe.first_dense)
    if arch.mla is not None and name in MLA_RULES:
        if name.startswith("self_attention.linear_q_proj"):
            return arch.mla.q_lora_rank is None
        if "q_down" in name or "q_up" in name or "q_layernorm" in name:
            return arch.mla.q_lora_rank is not None and "layer_norm_weight" not in name
        if name.startswith("mlp.router"):
            return not dense and arch.moe.expert_bias
        return "layer_norm_weight" not in name
    if name.endswith(".bias"):
        return arch.qkv_bias  # the QKV bias: Qwen2 and Qwen2-MoE
    if "layernorm.weight" in name and name.startswith("self_attention.") and "linear_qkv" not in name:
        return arch.qk_norm
    if name.startswith("mlp.linear_fc"):
        return dense
    if name.startswith("mlp.router"):
        return not dense
    if name.startswith("mlp.shared_experts."):
        return not dense and bool(arch.moe.shared_ffn) and (name != "mlp.shared_experts.gate_weight"
                                                            or arch.moe.shared_gate)
    return True


def model_rules(arch: ModelArch) -> Dict[str, object]:
    """Megatron parameter names outside the decoder layers -> rule."""
    lm_head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    return {"embedding.word_embeddings.weight": Vocab("model.embed_tokens.weight"),
            "decoder.final_layernorm.weight": Copy("model.norm.weight"),
            "output_layer.weight": Vocab(lm_head)}


def rule_for(name: str, arch: ModelArch, layer_numbers: Dict[int, int], expert_offset: int = 0):
    """(rule, global layer or None) for a Megatron parameter name of this stage.

    `layer_numbers` maps the stage-local index j of `decoder.layers.{j}` to the global layer
    index (Megatron's 1-based `layer_number` minus one), which carries the pipeline offset.
    `expert_offset`: the global index of this rank's first routed expert (Layout.expert_offset);
    a routed expert's rule comes bound to its global index.
    """
    if name.startswith("decoder.layers."):
        local, _, suffix = name[len("decoder.layers."):].partition(".")
        rules = layer_rules(arch)
        if suffix in rules:
            return rules[suffix], layer_numbers[int(local)]
        expert = split_local_expert(suffix)
        if expert is not None and expert[1] in EXPERT_RULES and arch.moe is not None:
            rule = dataclasses.replace(EXPERT_RULES[expert[1]], expert=expert_offset + expert[0])
            return rule, layer_numbers[int(local)]
    elif name in model_rules(arch):
        return model_rules(arch)[name], None
    raise KeyError(f"no HF mapping for Megatron parameter {name!r} ({arch.family}); "
                   f"verl_hpc.models.weight_rules covers the Llama/Qwen2/Mistral layer layout "
                   f", the Mixtral/Qwen2-MoE/Qwen3-MoE experts and DeepSeek-V3's latent attention")


def expected_hf_tensors(arch: ModelArch, output_layer: bool = True) -> Dict[str, Tuple[int, ...]]:
    """{HF name: shape} of every tensor a checkpoint of `arch` holds, from the rules above (no model
    is built: a login node checks a checkpoint against its config.json with this).
    output_layer=False: a value model's backbone, whose head replaces lm_head."""
    rules = dict(model_rules(arch))
    if not output_layer:
        del rules["output_layer.weight"]
    out: Dict[str, Tuple[int, ...]] = {}
    for rule in rules.values():
        out.update(rule.hf_entries(arch, None))
    for i in range(arch.num_layers):
        for name, rule in _all_rules(arch).items():
            if _layer_rule_applies(name, arch, i):
                out.update(rule.hf_entries(arch, i))
        dense = arch.moe is None or i < arch.moe.first_dense
        for e in range(0 if dense else arch.moe.num_experts):
            for rule in EXPERT_RULES.values():
                out.update(dataclasses.replace(rule, expert=e).hf_entries(arch, i))
    return out
