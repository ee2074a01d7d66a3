"""Hugging Face config.json -> the facts Megatron needs (`ModelArch`) -> `TransformerConfig`.

Supported: decoder-only Llama, Qwen2 and Mistral checkpoints, i.e. RMSNorm, SwiGLU MLP, RoPE
(default, linear or llama3 scaling), grouped-query attention, tied or untied embeddings, and
Qwen2's QKV bias; and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE (models/moe.py:
routed experts, Qwen2-MoE's gated shared expert, Qwen3's q/k norms) and DeepSeek-V3
(models/deepseek.py: multi-head latent attention, the biased sigmoid router, dense first layers);
and Qwen2.5-VL's language model with M-RoPE (models/vlm_arch.py; its vision tower is transformers'
own module, models/vlm.py). Anything else is refused with an error that names the config.json field and
what would be accepted: a model that loads but computes something else is worse than no model.

config.json is read as plain JSON (not through transformers) so that errors can name the exact
field, and both the transformers 4 spelling (`rope_theta`, `rope_scaling`) and the 5 spelling
(`rope_parameters`) are understood.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Dict, Optional

# torch is imported inside transformer_config only: the memory planner (verl_hpc.planning) reads
# config.json through this module on login nodes that have no torch.
from verl_hpc.config.errors import ConfigError, raise_if_any
from verl_hpc.config.hf_model import MEGATRON_ARCHITECTURES, ModelShape, is_vision_language, read_hf_config
from verl_hpc.config.layout import Layout
from verl_hpc.models.deepseek import (
    DEFAULTS as DEEPSEEK_DEFAULTS,
    MLAArch,
    is_yarn,
    mla_overrides,
    parse_mla,
    parse_yarn,
    rope_fields,
)
from verl_hpc.models.vlm_arch import VisionArch, is_mapped_vlm, parse_vision, refusal
from verl_hpc.models.moe import (
    MOE_ARCHITECTURES,
    MOE_DEFAULTS,
    MoEArch,
    check_family_fields,
    flag,
    parse_moe,
    transformer_overrides,
)

ARCHITECTURES = MEGATRON_ARCHITECTURES
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
# transformers' own defaults for fields a config.json may leave out
_DEFAULTS = {"llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048),
             "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768),
             "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=131072),
             **MOE_DEFAULTS, "deepseek_v3": DEEPSEEK_DEFAULTS}
_DEFAULTS["qwen2_5_vl"] = _DEFAULTS["qwen2"]  # Qwen2.5-VL's language model is Qwen2's (models/vlm_arch.py)
ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_VOCAB_DIVISOR = 128  # Megatron-LM's make_vocab_size_divisible_by default


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """A validated decoder-only architecture, in Megatron's terms."""

    family: str  # llama | qwen2 | mistral | mixtral | qwen2_moe | qwen3_moe | deepseek_v3 | qwen2_5_vl
    architecture: str  # the HF class name, e.g. LlamaForCausalLM
    vocab_size: int  # real vocabulary (config.json); Megatron pads it, see padded_vocab_size
    hidden_size: int
    ffn_hidden_size: int  # the dense MLP's (DeepSeek's first layers), else each routed expert's
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # num_key_value_heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]  # None, or {"rope_type": "linear"|"llama3"|"yarn" (DeepSeek-V3), ...}
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    source: str = "config.json"  # where it came from, for messages
    moe: Optional[MoEArch] = None  # the routed experts; None for a dense model
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3)
    mla: Optional[MLAArch] = None  # multi-head latent attention (DeepSeek-V3); None: q/k/v heads
    vision: Optional[VisionArch] = None  # a vision-language model's tower and M-RoPE (models/vlm_arch.py)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Vocabulary rounded up so every TP rank holds an equal, aligned slice (Megatron-LM rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def load_hf_config(model_path, field: str = "model.path") -> Dict[str, Any]:
    """config.json of a model folder as a dict (the project's one reader, in verl_hpc.config)."""
    return read_hf_config(model_path, field)


def _family(cfg: Dict[str, Any], src: str) -> tuple[str, str]:
    if is_vision_language(cfg) and not is_mapped_vlm(cfg):
        raise ConfigError(refusal(cfg, src))
    archs = cfg.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ConfigError(f"{src}: architectures={archs!r}: expected one architecture")
        if archs[0] not in ARCHITECTURES:
            raise ConfigError(f"{src}: architectures={archs!r} is not mapped into Megatron; mapped: "
                              f"{', '.join(ARCHITECTURES)}. The FSDP engine trains any transformers model: "
                              "set parallel.engine=fsdp (or auto)")
        return ARCHITECTURES[archs[0]], archs[0]
    by_type = {v: k for k, v in ARCHITECTURES.items()}
    if cfg.get("model_type") in by_type:
        return cfg["model_type"], by_type[cfg["model_type"]]
    raise ConfigError(f"{src}: needs 'architectures' (one of {', '.join(ARCHITECTURES)}) or a "
                      f"supported 'model_type'; got model_type={cfg.get('model_type')!r}")


def _rope(cfg: Dict[str, Any], family: str, src: str) -> tuple[float, Optional[Dict[str, Any]]]:
    """(theta, scaling) from rope_parameters (transformers 5) or rope_theta/rope_scaling (4)."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{src}: {field}={params!r}: expected an object (rope_type, factor, ...) or null")
    params = dict(params)
    theta = _positive_number(params.pop("rope_theta", cfg.get("rope_theta")), "rope_theta", src,
                             _DEFAULTS[family]["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{src}: {field}.rope_type={rope_type!r} is not implemented; "
                          f"supported: {', '.join(ROPE_TYPES)}")
    partial = _positive_number(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor")),
                               "partial_rotary_factor", src, 1.0)
    if partial != 1.0:
        raise ConfigError(f"{src}: partial_rotary_factor={partial} is not supported; only 1.0 "
                          f"(rotary over the whole head)")
    if rope_type == "default":
        return theta, None
    need = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if k not in params]
    if missing:
        raise ConfigError(f"{src}: {field} of type {rope_type!r} needs {', '.join(missing)}")
    return theta, {"rope_type": rope_type,
                   **{k: _positive_number(params[k], f"{field}.{k}", src) for k in need}}


def _positive_number(value, key: str, src: str, default: Optional[float] = None) -> float:
    """A finite JSON number > 0 (null or absent: `default`, where there is one). A string or a bool
    is refused by name here, on the login node: float() of it on a rank raised a bare ValueError,
    or turned true into 1.0."""
    if value is None and default is not None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{src}: {key}={value!r}: expected a number > 0")
    return float(value)


def _int_field(cfg, key, src, default=None) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{src}: {key}={value!r}: expected a positive integer")
    return value


def parse_hf_config(cfg: Dict[str, Any], source: str = "config.json") -> ModelArch:
    """Validate a config.json dict and return the architecture in Megatron's terms."""
    src = source
    family, arch_name = _family(cfg, src)
    vision = None
    if is_vision_language(cfg):  # the language model's fields, the tower and M-RoPE apart
        cfg, vision = parse_vision(cfg, src)
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"{src}: missing required field(s) {', '.join(missing)} "
                          f"(a {arch_name} config.json has them all)")
    heads = _int_field(cfg, "num_attention_heads", src)
    hidden = _int_field(cfg, "hidden_size", src)
    groups = _int_field(cfg, "num_key_value_heads", src, heads)
    if heads % groups:
        raise ConfigError(f"{src}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={groups}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{src}: hidden_size={hidden} is not a multiple of num_attention_heads="
                          f"{heads} and no head_dim is given")
    head_dim = _int_field(cfg, "head_dim", src, hidden // heads)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{src}: hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
    check_family_fields(cfg, family, src)
    if family in ("llama", "mistral"):
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(f"{src}: {key}=true is not supported; only false")
    if family == "mistral" and cfg.get("sliding_window") is not None:
        raise ConfigError(f"{src}: sliding_window={cfg['sliding_window']} is not implemented; only "
                          f"null (full attention)")
    if family in ("qwen2", "qwen2_5_vl") and cfg.get("use_sliding_window"):
        raise ConfigError(f"{src}: use_sliding_window=true is not implemented; only false")
    if cfg.get("quantization_config"):
        raise ConfigError(f"{src}: quantization_config is set; quantized checkpoints are not "
                          f"supported, use the unquantized model")
    mla = parse_mla(cfg, src) if family == "deepseek_v3" else None
    if mla is not None and is_yarn(cfg):  # DeepSeek-V3's released rope scaling (Megatron's YaRN)
        theta = _positive_number(rope_fields(cfg)[1].get("rope_theta", cfg.get("rope_theta")), "rope_theta", src,
                                 _DEFAULTS[family]["rope_theta"])
        scaling = parse_yarn(cfg, src)
    else:
        theta, scaling = _rope(cfg, family, src)
    defaults = _DEFAULTS[family]
    if mla is not None and scaling is not None and scaling["rope_type"] != "yarn":
        raise ConfigError(f"{src}: rope scaling of type {scaling['rope_type']!r} is not built for DeepSeek-V3; "
                          "valid: yarn or none")
    moe = parse_moe(cfg, family, src) if family in MOE_ARCHITECTURES.values() else None
    qkv_bias = family in ("qwen2", "qwen2_5_vl") or (family == "qwen2_moe" and flag(cfg, "qkv_bias", src, True))
    return ModelArch(
        family=family, architecture=arch_name,
        vocab_size=_int_field(cfg, "vocab_size", src), hidden_size=hidden,
        ffn_hidden_size=(_int_field(cfg, "intermediate_size", src) if mla or not moe else moe.expert_ffn),
        num_layers=_int_field(cfg, "num_hidden_layers", src),
        num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
        rms_norm_eps=_positive_number(cfg.get("rms_norm_eps"), "rms_norm_eps", src, defaults["rms_norm_eps"]),
        rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", src, False),
        qkv_bias=qkv_bias, moe=moe, qk_norm=family == "qwen3_moe", mla=mla, vision=vision,
        max_position_embeddings=_int_field(cfg, "max_position_embeddings", src,
                                           defaults["max_position_embeddings"]),
        source=src)


def load_arch(model_path) -> ModelArch:
    """`parse_hf_config(load_hf_config(model_path))`."""
    return parse_hf_config(load_hf_config(model_path), source=str(Path(model_path) / "config.json"))


def model_shape(arch: ModelArch) -> ModelShape:
    """The numbers the layout rules need, from a parsed architecture."""
    moe = arch.moe
    return ModelShape(arch.num_attention_heads, arch.num_query_groups, arch.num_layers, arch.vocab_size,
                      arch.max_position_embeddings, arch.ffn_hidden_size if not moe or moe.first_dense else 0,
                      f"({arch.source})",
                      arch.head_dim, experts=moe.num_experts if moe else 0,
                      expert_ffn=moe.expert_ffn if moe else 0, shared_ffn=moe.shared_ffn if moe else 0,
                      router=moe.score_function if moe else "softmax")


def check_parallel(arch: ModelArch, tp: int, pp: int, vpp: Optional[int] = None, ep: int = 1,
                   etp: Optional[int] = None) -> None:
    """Errors naming both the parallel field and the model field when the layout cannot split."""
    lay = Layout(tp * pp * ep, tp, pp, vpp=vpp, ep=ep, etp=etp)
    problems = lay.model_problems(model_shape(arch))
    if arch.mla is not None:  # latent attention's down projections are split over TP by rows too
        m = arch.mla
        problems += [f"parallel.tp = {tp} does not divide {what} = {n} of {arch.source}; valid: a tp that does"
                     for what, n in (("q_lora_rank", m.q_lora_rank or 0),
                                     ("kv_lora_rank + qk_rope_head_dim", m.kv_cache_per_token)) if n % tp]
    raise_if_any(problems)


def transformer_config(arch: ModelArch, tp: int = 1, pp: int = 1, *,
                       dtype=None, init_weights: bool = False,
                       use_cpu_initialization: Optional[bool] = None, ep: int = 1,
                       etp: Optional[int] = None, moe_options: Optional[Dict[str, Any]] = None,
                       **overrides):
    """Megatron `TransformerConfig` for `arch` at this layout.

    init_weights=False skips Megatron's random initialisation: weights come from the checkpoint,
    and Megatron's CPU initialisation would build each full matrix on every rank first.
    `overrides` are passed through (e.g. recompute settings from the engine). For an MoE model,
    `ep`/`etp` are the expert (tensor) parallel sizes (etp None: tp, Megatron's default) and
    `moe_options` the job's aux_loss_coef / z_loss_coef / capacity_factor.
    """
    import torch  # local: the planner imports this module on login nodes without torch

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from verl_hpc.runtime.device import has_gpu  # runtime imports torch

    etp = tp if etp is None else etp
    check_parallel(arch, tp, pp, ep=ep, etp=etp)
    dtype = torch.float32 if dtype is None else dtype
    kwargs = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,  # RL fine-tuning runs without dropout
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        perform_initialization=init_weights,
        use_cpu_initialization=(not has_gpu()) if use_cpu_initialization is None
        else use_cpu_initialization,
        # the fused kernels need CUDA/apex; the unfused paths are exact and run everywhere
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        qk_layernorm=arch.qk_norm)
    if arch.moe is not None:
        kwargs.update(transformer_overrides(arch.moe, ep, etp, num_layers=arch.num_layers, **(moe_options or {})))
    if arch.vision is not None:  # M-RoPE: Megatron's MultimodalRotaryEmbedding turns each section by its axis
        kwargs.update(mrope_section=list(arch.vision.mrope_section))
    kwargs.update(overrides)
    if arch.mla is not None:
        kwargs.update(mla_overrides(arch.mla, arch.rope_theta, arch.rope_scaling))
        # Megatron's fused MLA RoPE is YaRN only; the unfused path is exact
        kwargs.update(apply_rope_fusion=False)
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)
