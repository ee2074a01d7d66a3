"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): their config.json -> `MoEArch`,
the Megatron-Core MoE settings that compute the same thing, and the per-expert weight rules.

What each family computes (transformers 5.19), and the Megatron setting that matches it:

    family     router                                           experts      shared expert       attention
    mixtral    softmax over all, top-k, renormalised            w1/w3/w2     none                Mistral's
    qwen2_moe  softmax over all, top-k (renormalised only if     gate/up/down sigmoid-gated MLP    Qwen2's (QKV bias)
               norm_topk_prob)
    qwen3_moe  as qwen2_moe (norm_topk_prob true in released     gate/up/down none                per-head RMSNorm of
               checkpoints)                                                                       q and k before RoPE

Megatron's default router (top-k of the logits, softmax over those k) equals "softmax, top-k,
renormalise"; `moe_router_pre_softmax=True` (softmax over all experts, then top-k) equals the
unrenormalised variant. Megatron's `moe_shared_expert_gate` is Qwen2-MoE's sigmoid gate
(`shared_expert_gate`, a [1, hidden] linear). Qwen3's q/k norms are Megatron's `qk_layernorm`.

Routing is dropless by default (`model.moe_capacity_factor: null`), as in transformers and vLLM:
then training and inference see the same experts for the same router output. The experts run as
Megatron's `SequentialMLP` (one MLP per local expert; grouped GEMMs need Transformer Engine or the
grouped_gemm package, which the CPU build has neither of) behind the `alltoall` token dispatcher,
whose all-to-all runs on gloo as on NCCL.

Expert parallelism: expert e of a layer lives on EP rank e // (E / ep) as its local expert
e % (E / ep); `expert_offset` gives a rank's first global expert. The weight rules below read only
this rank's experts (and, under expert tensor parallelism, only its slice of each).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Dict, Iterator, Optional, Tuple

from verl_hpc.config.errors import ConfigError
# HF architecture -> family (the table lives in the config layer, for the engine choice)
from verl_hpc.config.hf_model import MOE_ARCHITECTURES

# transformers' defaults for fields a config.json may leave out
MOE_DEFAULTS = {"mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32),
                "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768),
                "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768)}
# transformers' Qwen2MoeConfig default of shared_expert_intermediate_size
QWEN2_MOE_SHARED_DEFAULT = 5632
# the expert-parallel local name of an expert's parameter in a Megatron MoE layer
LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class MoEArch:
    """The mixture-of-experts part of a decoder, in Megatron's terms."""

    num_experts: int
    top_k: int
    expert_ffn: int  # each routed expert's intermediate size
    renormalize: bool  # top-k probabilities divided by their sum (Mixtral; norm_topk_prob)
    shared_ffn: int = 0  # the shared expert's intermediate size; 0 = none
    shared_gate: bool = False  # sigmoid gate on the shared expert's output (Qwen2-MoE)
    router_aux_loss_coef: float = 0.0  # config.json's router_aux_loss_coef (the job may override)
    # DeepSeek-V3 (models/deepseek.py): sigmoid scores with a per-expert bias for the choice,
    # grouped (node-limited) top-k, scaled weights, dense first layers
    score_function: str = "softmax"
    expert_bias: bool = False
    scaling: float = 1.0  # routed_scaling_factor
    num_groups: Optional[int] = None  # n_group, where grouped routing limits the choice
    group_topk: Optional[int] = None  # topk_group
    first_dense: int = 0  # first_k_dense_replace: layers before the first MoE layer are dense

    @property
    def active_experts_per_token(self) -> int:
        return self.top_k


def _positive(cfg, key, src, default=None, why: str = "") -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{src}: {key}={value!r}: expected a positive integer{why}")
    return value


def _number(cfg, key, src, default: float = 0.0) -> float:
    """A finite JSON number >= 0 (null: `default`); a string or bool is refused by name, before the
    ranks: float() of it would fail there, or pass a string to transformers."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{src}: {key}={value!r}: expected a number >= 0 (or null)")
    return float(value)


def flag(cfg, key, src, default: bool) -> bool:
    """A JSON true/false (null or absent: `default`): bool() of the string "false" would be True."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{src}: {key}={value!r}: expected true or false")
    return value


def _expert_count(cfg, src) -> Tuple[str, int]:
    """(field, routed experts): Mixtral's num_local_experts, Qwen's num_experts or DeepSeek's
    n_routed_experts. transformers 5 writes num_local_experts for Qwen3-MoE too (its alias of
    num_experts); a config.json with two that disagree is refused, not read one way here and
    another way by a loader."""
    keys = [k for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if cfg.get(k) is not None] or ["num_experts"]
    counts = [_positive(cfg, k, src) for k in keys]
    if len(set(counts)) > 1:
        raise ConfigError(f"{src}: {keys[0]}={counts[0]} and {keys[1]}={counts[1]} disagree; valid: one "
                          "of them, or both equal (the number of routed experts the weights hold)")
    return keys[0], counts[0]


def parse_moe(cfg: Dict[str, Any], family: str, src: str) -> MoEArch:
    """The MoE fields of a config.json of `family`; variants this mapping does not compute are
    refused by field name, and a value of the wrong type names its field."""
    experts_key, experts = _expert_count(cfg, src)
    top_k = _positive(cfg, "num_experts_per_tok", src)
    if top_k > experts:
        raise ConfigError(f"{src}: num_experts_per_tok={top_k} is more than {experts_key}={experts}")
    jitter = cfg.get("router_jitter_noise")
    if jitter is not None and (isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or jitter != 0):
        raise ConfigError(f"{src}: router_jitter_noise={jitter!r} is not implemented; valid: 0 or null (no noise "
                          "on the router logits)")
    aux = _number(cfg, "router_aux_loss_coef", src)
    if family == "deepseek_v3":
        from verl_hpc.models.deepseek import check_router

        ds = check_router(cfg, src, experts, top_k)
        return MoEArch(experts, top_k, _positive(cfg, "moe_intermediate_size", src), renormalize=True,
                       shared_ffn=ds["shared_ffn"], router_aux_loss_coef=aux, score_function="sigmoid",
                       expert_bias=True, scaling=ds["scaling"], num_groups=ds["num_groups"],
                       group_topk=ds["group_topk"], first_dense=ds["first_dense"])
    if family == "mixtral":
        return MoEArch(experts, top_k, _positive(cfg, "intermediate_size", src), renormalize=True,
                       router_aux_loss_coef=aux)
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1 or isinstance(step, bool):
        raise ConfigError(f"{src}: decoder_sparse_step={step!r} is not supported; only 1 (every layer "
                          "is a mixture of experts)")
    if cfg.get("mlp_only_layers"):
        raise ConfigError(f"{src}: mlp_only_layers={cfg['mlp_only_layers']!r} is not supported; only [] "
                          "(no dense layers between the MoE layers)")
    # Qwen2-MoE always has the gated shared expert (transformers builds it whatever the size, 5632
    # when absent): a size of 0 is no model transformers or vLLM can load
    shared = (_positive(cfg, "shared_expert_intermediate_size", src, QWEN2_MOE_SHARED_DEFAULT,
                        " (a Qwen2-MoE layer always has its shared expert)") if family == "qwen2_moe" else 0)
    return MoEArch(experts, top_k, _positive(cfg, "moe_intermediate_size", src),
                   renormalize=flag(cfg, "norm_topk_prob", src, False), shared_ffn=shared,
                   shared_gate=shared > 0, router_aux_loss_coef=aux)


def check_family_fields(cfg: Dict[str, Any], family: str, src: str) -> None:
    """Attention variants of the MoE families that the dense mapping would not catch."""
    if family == "mixtral" and cfg.get("sliding_window") is not None:
        raise ConfigError(f"{src}: sliding_window={cfg['sliding_window']} is not implemented; only "
                          "null (full attention)")
    if family in ("qwen2_moe", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise ConfigError(f"{src}: use_sliding_window=true is not implemented; only false")
    if family == "qwen3_moe" and cfg.get("attention_bias"):
        raise ConfigError(f"{src}: attention_bias=true is not supported; only false")
    if family == "mixtral" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConfigError(f"{src}: attention_bias/mlp_bias=true is not supported; only false")


def transformer_overrides(moe: MoEArch, ep: int, etp: int, *, aux_loss_coef: Optional[float] = None,
                          z_loss_coef: float = 0.0, capacity_factor: Optional[float] = None,
                          routing_replay: str = "off", bias_update_rate: float = 1e-3,
                          num_layers: int = 0) -> Dict[str, Any]:
    """Megatron `TransformerConfig` fields of the MoE layers at expert parallel `ep` and expert
    tensor parallel `etp`. aux_loss_coef None: config.json's router_aux_loss_coef. routing_replay
    other than "off": the routers get Megatron's replay hook (engines/megatron/route_replay.py).
    bias_update_rate: the expert bias's step per optimizer step (sigmoid routers only);
    num_layers: the model's, for the dense-first layer pattern."""
    aux = moe.router_aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    kw: Dict[str, Any] = dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.expert_ffn,
        moe_router_pre_softmax=not moe.renormalize, moe_router_score_function="softmax",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z_loss_coef or None,
        # the router in fp32 whatever the model's dtype: HF's routers take their softmax in fp32 too
        moe_router_dtype="fp32", moe_permute_fusion=False,
        moe_enable_routing_replay=routing_replay != "off")
    if moe.score_function == "sigmoid":  # DeepSeek-V3 (models/deepseek.py)
        kw.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                  moe_router_enable_expert_bias=moe.expert_bias,
                  moe_router_bias_update_rate=bias_update_rate,
                  moe_router_topk_scaling_factor=moe.scaling if moe.scaling != 1.0 else None,
                  moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk,
                  moe_layer_freq=[0] * moe.first_dense + [1] * (num_layers - moe.first_dense))
        if not aux:  # the bias balances the load (DeepSeek-V3's auxiliary-loss-free balancing)
            kw.update(moe_router_load_balancing_type="none")
    if capacity_factor is not None:
        kw.update(moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=False,
                  moe_token_drop_policy="probs")
    if moe.shared_ffn:
        kw.update(moe_shared_expert_intermediate_size=moe.shared_ffn,
                  moe_shared_expert_gate=moe.shared_gate, moe_shared_expert_overlap=False)
    return kw


def use_torch_router_gemm() -> None:
    """megatron-core 0.16.1's router GEMM tests `te_general_gemm is not None`, a name its module
    binds only when Transformer Engine imports: without TE the router fails with a NameError
    (on CPU, and on a GPU node without TE). Binding it to None selects Megatron's own torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def count_real_tokens_for_expert_bias() -> None:
    """megatron-core 0.16.1's `TopKRouter._apply_expert_bias` adds `routing_map & ~padding_mask` to
    the token counts behind the expert-bias update, with routing_map [tokens, experts] and the
    mask flattened to [tokens]: it cannot broadcast, so a padding mask fails every training
    forward. The engine passes one (padding and dummy rows must not count towards an expert's
    load, or the bias would chase where the pad token routes); this replacement masks by token,
    as the upstream code means to. Idempotent; only the sigmoid routers with a bias use it."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "verl_hpc", False):
        return

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias.verl_hpc = True
    TopKRouter._apply_expert_bias = _apply_expert_bias


def expert_offset(moe: Optional[MoEArch], ep_rank: int, ep: int) -> int:
    """The global index of expert-parallel rank `ep_rank`'s first routed expert (0 for a dense model)."""
    return ep_rank * (moe.num_experts // ep) if moe is not None else 0


def split_local_expert(suffix: str):
    """'mlp.experts.local_experts.{j}.rest' -> (j, rest), else None."""
    m = LOCAL_EXPERT.match(suffix)
    return (int(m.group(1)), m.group(2)) if m else None


def hf_expert_names(family: str) -> Dict[str, str]:
    """The HF names of routed expert e's three matrices ({i} = layer, {e} = expert)."""
    if family == "mixtral":
        base = "model.layers.{i}.block_sparse_moe.experts.{e}."
        return {"gate": base + "w1.weight", "up": base + "w3.weight", "down": base + "w2.weight"}
    base = "model.layers.{i}.mlp.experts.{e}."
    return {"gate": base + "gate_proj.weight", "up": base + "up_proj.weight", "down": base + "down_proj.weight"}


def hf_shared_expert_prefix(family: str) -> str:
    """The HF module of the shared expert(s) ({i} = layer): Qwen2-MoE's one, DeepSeek's several
    (one fused MLP in the checkpoint)."""
    return "model.layers.{i}.mlp.shared_experts." if family == "deepseek_v3" else "model.layers.{i}.mlp.shared_expert."


def hf_router_name(family: str) -> str:
    return ("model.layers.{i}.block_sparse_moe.gate.weight" if family == "mixtral"
            else "model.layers.{i}.mlp.gate.weight")


_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def _family(model) -> Optional[str]:
    """The MoE family of a transformers model, also once FSDP wraps it (fully_shard makes a
    subclass of the model's class: `FSDPMixtralForCausalLM`)."""
    return next((MOE_ARCHITECTURES[c.__name__] for c in type(model).__mro__ if c.__name__ in MOE_ARCHITECTURES),
                None)


def fused_experts(model) -> bool:
    """Whether `model` (transformers) keeps an MoE family's experts fused in memory, under other
    names than its checkpoint's (checkpoint_views, checkpoint_tensors)."""
    return _family(model) is not None


def checkpoint_tensors(model, name: str, tensor) -> Iterator[Tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs that hold the model's parameter `name` (`tensor`: its
    full value): a fused expert tensor as one tensor per expert and matrix, Mixtral's router under
    `block_sparse_moe`; any other parameter as it is. What a rollout loads and a folder stores."""
    family = _family(model)
    m = _FUSED.match(name) if family else None
    if m is None:
        yield name, tensor
        return
    layer, what = int(m.group(1)), m.group(2)
    if what == "gate.weight":
        yield hf_router_name(family).format(i=layer), tensor
        return
    names = hf_expert_names(family)
    ffn = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        if what == "experts.down_proj":
            yield names["down"].format(i=layer, e=e), tensor[e]
        else:
            yield names["gate"].format(i=layer, e=e), tensor[e, :ffn]
            yield names["up"].format(i=layer, e=e), tensor[e, ffn:]


def checkpoint_views(model) -> Dict[str, Any]:
    """{checkpoint name: writable view} for the experts and routers of a transformers MoE model,
    whose in-memory layout differs from its checkpoint's: transformers 5 fuses a layer's experts
    (`mlp.experts.gate_up_proj` [E, 2F, H] = [gate; up] per expert, `mlp.experts.down_proj`
    [E, H, F]) and converts on load, and names Mixtral's `block_sparse_moe` `mlp`. Copying a
    checkpoint-named tensor into its view updates the model as loading that checkpoint would
    (HFRollout's weight updates). Empty for a dense model."""
    if not fused_experts(model):
        return {}
    return {ckpt: view for name, param in model.named_parameters() if _FUSED.match(name)
            for ckpt, view in checkpoint_tensors(model, name, param)}
