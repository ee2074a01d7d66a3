"""DeepSeek-V3 (and Kimi-K2, same architecture) from its config.json: multi-head latent attention,
a sigmoid router with a per-expert bias, shared experts, dense first layers and node-limited
(grouped) routing, in Megatron-Core's terms.

What transformers 5.19 computes (`DeepseekV3ForCausalLM`) and the Megatron setting that matches:

    transformers                                      Megatron-Core (MLATransformerConfig)
    q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj  linear_q_proj, or linear_q_down_proj ->
                                                      q_layernorm -> linear_q_up_proj (q_lora_rank)
    kv_a_proj_with_mqa -> [kv_lora | k_rope]          linear_kv_down_proj, same split
    kv_a_layernorm -> kv_b_proj ([k_nope; v] / head)  kv_layernorm -> linear_kv_up_proj
    rope_interleave: rotary pairs (x0, x1), ...       MLA's rotary de-interleaves the same way
    scale qk_head_dim^-0.5                            softmax_scale 1/sqrt(qk_head + rope_head)
    sigmoid, + e_score_correction_bias for the        moe_router_score_function="sigmoid",
    choice only, top-2 sum per group, top            moe_router_enable_expert_bias (expert_bias),
    topk_group groups, top-k, renormalised,           moe_router_num_groups / group_topk
    x routed_scaling_factor                           (top k/group_topk per group: 2 needed),
                                                      moe_router_topk_scaling_factor
    shared_experts (moe_ffn x n_shared_experts)       moe_shared_expert_intermediate_size, no gate
    layers < first_k_dense_replace dense              moe_layer_freq = [0]*k + [1]*(L-k)

The expert bias is not trained by gradient: Megatron counts the tokens each expert received in
training forwards (`local_tokens_per_expert`) and `finalize_model_grads` moves every bias by
`moe_router_bias_update_rate` towards balance (sign of mean - count), once per optimizer step.
The engine calls `finalize_model_grads` every step (engines/megatron/engine.py), so the rule runs;
the rate is `model.moe_router_bias_update_rate`.

YaRN rope scaling (the released checkpoints': factor 40 over 4096 positions, mscale = mscale_all_dim
= 1) is Megatron's `YarnRotaryEmbedding` with the same factor, correction range (rounded, as
transformers' `truncate: true`), cos/sin factor mscale(factor, mscale) / mscale(factor,
mscale_all_dim) and softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(q head).

Refused by name (one line each): `rope_interleave: false`, rope scaling other than YaRN (and
YaRN's `truncate: false` or an explicit `attention_factor`),
`attention_bias: true`, `norm_topk_prob: false` with top_k > 1 (Megatron renormalises),
grouped routing where top_k / topk_group != 2 (transformers sums each group's top 2),
`topk_method` other than `noaux_tc`, `scoring_func` other than `sigmoid`, `rms_norm_eps` other
than 1e-6 (transformers' latent norms use 1e-6 whatever it says), `hidden_act` other than silu.
The multi-token-prediction layers (`num_nextn_predict_layers`) are ignored with a log line:
transformers ignores them too (it drops their weights on load), so rollout and training agree.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Dict, Optional

from verl_hpc.config.errors import ConfigError

log = logging.getLogger(__name__)

FAMILY = "deepseek_v3"
# transformers' DeepseekV3Config defaults for fields a config.json may leave out
DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096)
CONFIG_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                       qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                       first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True)
LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm(q_lora_rank / kv_lora_rank): transformers' default eps


@dataclasses.dataclass(frozen=True)
class MLAArch:
    """Multi-head latent attention sizes (config.json names)."""

    q_lora_rank: Optional[int]  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_per_token(self) -> int:
        """Elements cached per token and layer: the compressed latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _get(cfg, key):
    """config.json's value, or transformers' default when absent or null (not for q_lora_rank,
    whose null means a plain q_proj)."""
    value = cfg.get(key)
    return CONFIG_DEFAULTS.get(key) if value is None else value


def _positive(cfg, key, src) -> int:
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{src}: {key}={value!r}: expected a positive integer")
    return value


def parse_mla(cfg: Dict[str, Any], src: str) -> MLAArch:
    """The attention fields of a DeepSeek-V3 config.json; variants not built are refused by name."""
    if _get(cfg, "rope_interleave") is not True:
        raise ConfigError(f"{src}: rope_interleave={cfg.get('rope_interleave')!r} is not built; valid: true "
                          "(Megatron's latent attention rotates interleaved pairs, as released checkpoints do)")
    if cfg.get("attention_bias"):
        raise ConfigError(f"{src}: attention_bias=true is not built for DeepSeek-V3; valid: false")
    eps = cfg.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps != LATENT_NORM_EPS:
        raise ConfigError(f"{src}: rms_norm_eps={eps!r} is not built for DeepSeek-V3; valid: 1e-6 (transformers' "
                          "latent norms use 1e-6 whatever it says, Megatron's use rms_norm_eps)")
    q_lora = cfg.get("q_lora_rank", CONFIG_DEFAULTS["q_lora_rank"])
    if q_lora is not None:
        q_lora = _positive({"q_lora_rank": q_lora}, "q_lora_rank", src)
    return MLAArch(q_lora, _positive(cfg, "kv_lora_rank", src), _positive(cfg, "qk_nope_head_dim", src),
                   _positive(cfg, "qk_rope_head_dim", src), _positive(cfg, "v_head_dim", src))


def check_router(cfg: Dict[str, Any], src: str, experts: int, top_k: int) -> Dict[str, Any]:
    """The router and layer-pattern fields: {first_dense, shared_ffn, scaling, num_groups, group_topk}."""
    method = cfg.get("topk_method")
    if method is not None and method != "noaux_tc":
        raise ConfigError(f"{src}: topk_method={method!r} is not built; valid: 'noaux_tc' (sigmoid scores plus "
                          "the per-expert bias, DeepSeek-V3's router)")
    scoring = cfg.get("scoring_func")
    if scoring is not None and scoring != "sigmoid":
        raise ConfigError(f"{src}: scoring_func={scoring!r} is not built; valid: 'sigmoid'")
    if top_k > 1 and _get(cfg, "norm_topk_prob") is not True:
        raise ConfigError(f"{src}: norm_topk_prob={cfg.get('norm_topk_prob')!r} is not built; valid: true "
                          "(Megatron's sigmoid router renormalises the top-k weights)")
    groups, topk_group = _positive(cfg, "n_group", src), _positive(cfg, "topk_group", src)
    if experts % groups:
        raise ConfigError(f"{src}: n_group={groups} does not divide n_routed_experts={experts}")
    if topk_group > groups:
        raise ConfigError(f"{src}: topk_group={topk_group} is more than n_group={groups}")
    grouped = topk_group < groups
    if grouped and top_k != 2 * topk_group:
        raise ConfigError(f"{src}: num_experts_per_tok={top_k} with topk_group={topk_group} is not built; valid: "
                          f"num_experts_per_tok = 2 x topk_group (transformers scores a group by its top 2, "
                          f"Megatron by its top num_experts_per_tok / topk_group), or topk_group = n_group")
    first = cfg.get("first_k_dense_replace", CONFIG_DEFAULTS["first_k_dense_replace"])
    layers = cfg.get("num_hidden_layers")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0 or (
            isinstance(layers, int) and first >= layers):
        raise ConfigError(f"{src}: first_k_dense_replace={first!r}: expected an integer >= 0 and below "
                          f"num_hidden_layers={layers} (at least one MoE layer)")
    scaling = cfg.get("routed_scaling_factor", CONFIG_DEFAULTS["routed_scaling_factor"])
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) or scaling <= 0:
        raise ConfigError(f"{src}: routed_scaling_factor={scaling!r}: expected a number > 0")
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0
    if mtp:
        log.info("%s: num_nextn_predict_layers=%s: the multi-token-prediction layers are ignored (not built, "
                 "not loaded, not trained), as transformers ignores them", src, mtp)
    moe_ffn = _positive(cfg, "moe_intermediate_size", src)
    return dict(first_dense=first, shared_ffn=moe_ffn * _positive(cfg, "n_shared_experts", src),
                scaling=float(scaling), num_groups=groups if grouped else None,
                group_topk=topk_group if grouped else None)


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def rope_fields(cfg: Dict[str, Any]) -> tuple:
    """(the field name, its object) of a config.json's rope settings (transformers 5 or 4 spelling)."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    return field, cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def is_yarn(cfg: Dict[str, Any]) -> bool:
    params = rope_fields(cfg)[1]
    return isinstance(params, dict) and params.get("rope_type", params.get("type")) == "yarn"


def parse_yarn(cfg: Dict[str, Any], src: str) -> Dict[str, Any]:
    """DeepSeek-V3's YaRN rope scaling as Megatron's YarnRotaryEmbedding takes it; what transformers
    computes but Megatron does not (an explicit attention_factor, truncate false) is refused."""
    field, params = rope_fields(cfg)
    for key in ("attention_factor",):
        if params.get(key) is not None:
            raise ConfigError(f"{src}: {field}.{key}={params[key]!r} is not built; valid: absent (YaRN's factor "
                              "from mscale / mscale_all_dim)")
    if params.get("truncate", True) is not True:
        raise ConfigError(f"{src}: {field}.truncate={params['truncate']!r} is not built; valid: true (Megatron "
                          "rounds the correction range to whole dimensions)")
    out = {"rope_type": "yarn"}
    defaults = dict(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)
    for key in YARN_KEYS:
        value = params.get(key, defaults.get(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (value == 0 and key in ("factor", "original_max_position_embeddings")):
            raise ConfigError(f"{src}: {field}.{key}={value!r}: expected a number > 0 (YaRN needs factor and "
                              "original_max_position_embeddings)")
        out[key] = float(value)
    return out


def mla_overrides(mla: MLAArch, rope_theta: float, rope_scaling: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The MLATransformerConfig fields (besides TransformerConfig's) of a DeepSeek-V3 model."""
    if rope_scaling is not None:  # YaRN (parse_yarn): Megatron's YarnRotaryEmbedding and its softmax scale
        y = rope_scaling
        rope = dict(rope_type="yarn", rotary_scaling_factor=y["factor"],
                    original_max_position_embeddings=int(y["original_max_position_embeddings"]),
                    beta_fast=y["beta_fast"], beta_slow=y["beta_slow"], mscale=y["mscale"],
                    mscale_all_dim=y["mscale_all_dim"])
    else:  # unscaled RoPE: mscale 1 (the YaRN fields are unused), softmax scale 1/sqrt(q head)
        rope = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
                v_head_dim=mla.v_head_dim, rotary_base=rope_theta, rotary_percent=1.0, **rope,
                qk_layernorm=True,  # the q and kv latent norms
                kv_channels=mla.v_head_dim)
