"""The model's shape for the planner, and the parameter count each rank holds.

Shapes come from the model folder's config.json through `verl_hpc.models.config_mapping` (the
project's one reader), or, where this machine cannot see the folder (a login node planning for a
cluster path, `--skip-model-check`), from `KNOWN`: a few published architectures, matched by the
folder's name. Counts follow Megatron-Core's GPT layout exactly (what `build_gpt_model` builds):
per layer, QKV [(q + 2 kv heads) * head_dim, h] and the output projection split over TP, SwiGLU's
fc1 [2 ffn, h] and fc2 [h, ffn] split over TP, two RMSNorm weights [h] replicated; the vocabulary
padded to a multiple of 128 * TP; embedding on the first stage, final norm and output layer on the
last (a tied output layer with PP > 1 keeps its own copy on the last stage, as Megatron does).

Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE): attention as above (plus Qwen3's two
[head_dim] q/k norms), the router [E, h] replicated, E / ep routed experts per rank with fc1
[2 F, h] and fc2 [h, F] split over the expert TP (etp), and Qwen2-MoE's shared expert (split over
TP like a dense MLP) with its [1, h] gate.

DeepSeek-V3 (models/deepseek.py): multi-head latent attention's projections (q_a [q_lora, h] and
q_b [a * (nope + rope), q_lora], or q [a * (nope + rope), h]; kv_a [kv_lora + rope, h]; kv_b
[a * (nope + v), kv_lora]; o [h, a * v]) split over TP, the two latent norms replicated; the router's
per-expert bias [E] (an fp32 buffer, no gradient, counted with the weights); the shared experts as
one shared MLP; the first `first_k_dense_replace` layers dense (a stage holds what its own layers
are).

A role the FSDP engine trains (`role_engine`: parallel.engine, or auto's rule) may be any decoder
transformers builds; its shape is read leniently (`fsdp_arch`: the numbers memory depends on, from
config.json or a multimodal model's text_config), since the Megatron mapping refuses what it does
not map.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Optional

from verl_hpc.config.errors import ConfigError, raise_if_any
from verl_hpc.config.hf_model import language_model_config, read_hf_config
from verl_hpc.config.validate import model_rule_problems
from verl_hpc.models.config_mapping import (REQUIRED, ModelArch, load_arch, model_shape, padded_vocab_size,
                                           parse_hf_config)
from verl_hpc.models.deepseek import MLAArch
from verl_hpc.models.moe import MoEArch


def _llama(name, vocab, hidden, ffn, layers, heads, kv, tied=False, max_pos=8192) -> ModelArch:
    return ModelArch(family="llama", architecture="LlamaForCausalLM", vocab_size=vocab,
                     hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_attention_heads=heads, num_query_groups=kv, head_dim=hidden // heads,
                     rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                     tie_word_embeddings=tied, qkv_bias=False, max_position_embeddings=max_pos,
                     source=f"known architecture {name}")


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

# Published config.json values (meta-llama/*, Qwen/* on the Hugging Face hub).
KNOWN: Dict[str, ModelArch] = {
    "llama-3-70b": _llama("llama-3-70b", 128256, 8192, 28672, 80, 64, 8),
    # Llama 3.1 (and 3.3) 70B: the same shape, 131072 positions through llama3 RoPE scaling
    "llama-3.1-70b": dataclasses.replace(_llama("llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, max_pos=131072),
                                         rope_scaling=_LLAMA31_ROPE),
    "llama-3-8b": _llama("llama-3-8b", 128256, 4096, 14336, 32, 32, 8),
    "llama-3.1-8b": dataclasses.replace(_llama("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, max_pos=131072),
                                        rope_scaling=_LLAMA31_ROPE),
    "llama-3.2-1b": _llama("llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, tied=True),
    "qwen2.5-7b": dataclasses.replace(_llama("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4),
                                      family="qwen2", architecture="Qwen2ForCausalLM",
                                      qkv_bias=True, head_dim=128),
    # 128 experts of FFN 768, 8 per token (3.3B of 30.5B parameters active), q/k norms
    "qwen3-30b-a3b": dataclasses.replace(_llama("qwen3-30b-a3b", 151936, 2048, 768, 48, 32, 4, max_pos=40960),
                                         family="qwen3_moe", architecture="Qwen3MoeForCausalLM", head_dim=128,
                                         rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                                         moe=MoEArch(num_experts=128, top_k=8, expert_ffn=768, renormalize=True,
                                                     router_aux_loss_coef=0.001)),
    # DeepSeek-V3 (and V3.1 / R1, the same shapes; Kimi-K2 differs): 671B parameters, 37B active;
    # 3 dense layers then 58 MoE layers of 256 experts (8 per token from 4 of 8 groups) + 1 shared
    "deepseek-v3": ModelArch(
        family="deepseek_v3", architecture="DeepseekV3ForCausalLM", vocab_size=129280, hidden_size=7168,
        ffn_hidden_size=18432, num_layers=61, num_attention_heads=128, num_query_groups=128, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=False,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096.0,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=163840, source="known architecture deepseek-v3",
        mla=MLAArch(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEArch(num_experts=256, top_k=8, expert_ffn=2048, renormalize=True, shared_ffn=2048,
                    score_function="sigmoid", expert_bias=True, scaling=2.5, num_groups=8, group_topk=4,
                    first_dense=3)),
}


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower())


def known_arch(path_or_name: str) -> Optional[ModelArch]:
    """A KNOWN architecture whose name appears in the folder name (Meta-Llama-3-70B-Instruct ->
    llama-3-70b), the longest match first; None when nothing matches."""
    name = _normalise(Path(str(path_or_name)).name or str(path_or_name))
    for key in sorted(KNOWN, key=len, reverse=True):
        if key in name:
            return KNOWN[key]
    return None


def model_arch(path: str, *, allow_known: bool = True, field: str = "model.path") -> ModelArch:
    """The architecture at `path` (config.json), else a KNOWN one by name when allowed."""
    if path and Path(path, "config.json").is_file():
        if field == "reward.reward_model.path":  # a *ForSequenceClassification scorer: its causal LM's shape
            from verl_hpc.models.config_mapping import load_hf_config, parse_hf_config

            data = load_hf_config(path)
            archs = data.get("architectures") or []
            if len(archs) == 1 and archs[0].endswith("ForSequenceClassification"):
                data = dict(data, architectures=[archs[0][: -len("ForSequenceClassification")] + "ForCausalLM"])
            return parse_hf_config(data, source=str(Path(path) / "config.json"))
        return load_arch(path)
    arch = known_arch(path) if allow_known else None
    if arch is None:
        raise ConfigError(f"{field}: {path!r} has no config.json here and its name matches no known "
                          f"architecture ({', '.join(KNOWN)}); plan where the model folder is")
    return arch


def role_engine(cfg, path: str, field: str = "model.path") -> str:
    """megatron | fsdp for the role whose model folder is `path`: parallel.engine's rule
    (config/sections/fsdp.py choose_engine, which reads config.json). Where the folder is not
    visible here (a login node planning for cluster paths) auto decides from the layout alone:
    the known table's architectures are all mapped into Megatron, so TP/PP/EP > 1 means Megatron."""
    from verl_hpc.config.sections.fsdp import choose_engine

    par = cfg.parallel
    if par.engine != "auto" or (path and Path(path, "config.json").is_file()):
        return choose_engine(par.engine, path, par, field)
    return "megatron" if max(par.tp, par.pp, par.ep) > 1 else "fsdp"


def _count(data: Dict, key: str, src: str, default: Optional[int] = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{src}: {key}={value!r}: expected a positive integer")
    return value


def fsdp_arch(path: str, *, allow_known: bool = True, field: str = "model.path") -> ModelArch:
    """The shape of a model the FSDP engine trains: the Megatron mapping's where it maps the
    folder, else the numbers memory needs read from any decoder's config.json (the language
    model's, under text_config, for a multimodal one); else KNOWN by name."""
    if not (path and Path(path, "config.json").is_file()):
        return model_arch(path, allow_known=allow_known, field=field)
    data = read_hf_config(path, field)
    src = str(Path(path) / "config.json")
    try:
        return parse_hf_config(data, source=src)
    except ConfigError:  # not mapped, or a feature Megatron's mapping lacks: transformers has it
        pass
    lm = language_model_config(data)
    if "intermediate_size" not in lm and "hidden_size" in lm:  # GPT-2 (n_inner null), BLOOM: transformers'
        lm["intermediate_size"] = 4 * int(lm["hidden_size"])  # modelling code makes the MLP 4 x hidden
    missing = [k for k in REQUIRED if k not in lm]
    if missing:
        raise ConfigError(f"{field}: {src} has no {', '.join(missing)}: the memory plan needs the "
                          "decoder's sizes")
    heads, hidden = _count(lm, "num_attention_heads", src), _count(lm, "hidden_size", src)
    experts = lm.get("num_local_experts") or lm.get("num_experts") or 0
    moe = None
    if experts:
        moe = MoEArch(num_experts=_count(lm, "num_local_experts" if "num_local_experts" in lm else "num_experts", src),
                      top_k=_count(lm, "num_experts_per_tok", src, 1), renormalize=False,
                      expert_ffn=_count(lm, "moe_intermediate_size", src, lm["intermediate_size"]),
                      shared_ffn=int(lm.get("shared_expert_intermediate_size") or 0))
    archs = data.get("architectures") or [lm.get("model_type") or data.get("model_type") or "unknown"]
    return ModelArch(
        family=str(lm.get("model_type") or data.get("model_type") or "unknown"), architecture=str(archs[0]),
        vocab_size=_count(lm, "vocab_size", src), hidden_size=hidden,
        ffn_hidden_size=moe.expert_ffn if moe else _count(lm, "intermediate_size", src),
        num_layers=_count(lm, "num_hidden_layers", src), num_attention_heads=heads,
        num_query_groups=_count(lm, "num_key_value_heads", src, heads),
        head_dim=int(lm.get("head_dim") or hidden // heads),
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=bool(lm.get("tie_word_embeddings", data.get("tie_word_embeddings", False))),
        qkv_bias=bool(lm.get("attention_bias", False)),
        max_position_embeddings=int(lm.get("max_position_embeddings") or 0),
        source=src, moe=moe, qk_norm=False)


def job_arch(cfg, allow_known: bool = True) -> ModelArch:
    """The actor's architecture (`model_arch`), refused with the job's rules that depend on it (the
    same rules `submit` applies to config.json, config/validate.py: a layout the model cannot split
    gets no plan), whether it came from config.json or from KNOWN."""
    if role_engine(cfg, cfg.model.path) == "fsdp":
        arch = fsdp_arch(cfg.model.path, allow_known=allow_known)
    else:
        arch = model_arch(cfg.model.path, allow_known=allow_known)
    raise_if_any(model_rule_problems(cfg, model_shape(arch), "model.path"))
    return arch


@dataclasses.dataclass(frozen=True)
class StageParams:
    """Parameters (elements) of one rank of one pipeline stage, by kind."""

    layers: int  # transformer layers on this rank (all its virtual chunks)
    layer_params: int
    embedding: int
    output: int  # output layer (vocab projection or value head) + final norm
    num_tensors: int  # parameter tensors (Megatron pads each one's start in its buffers)
    expert_params: int = 0  # of layer_params: routed experts (sharded over expert data parallel)

    @property
    def total(self) -> int:
        return self.layer_params + self.embedding + self.output


def is_dense_layer(arch: ModelArch, layer: Optional[int]) -> bool:
    """Layer `layer` has a dense MLP: a dense model, or one of DeepSeek-V3's first layers (None: an
    MoE model's MoE layer)."""
    return arch.moe is None or (layer is not None and layer < arch.moe.first_dense)


def stage_layers(arch: ModelArch, pp: int, stage: int) -> range:
    """The global layer indices of pipeline stage `stage` (equal blocks; with virtual stages the
    chunks interleave, and the count per rank is the same)."""
    per = arch.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def layer_params(arch: ModelArch, tp: int, ep: int = 1, etp: Optional[int] = None,
                 layer: Optional[int] = None) -> int:
    return sum(layer_tensor_sizes(arch, tp, ep, etp, layer))


def expert_layer_params(arch: ModelArch, ep: int = 1, etp: int = 1, layer: Optional[int] = None) -> int:
    """The routed experts' elements of one layer on one rank (what the expert data-parallel group,
    not the data-parallel group, shards in the distributed optimizer); 0 for a dense layer."""
    moe = arch.moe
    if is_dense_layer(arch, layer):
        return 0
    return (moe.num_experts // ep) * 3 * moe.expert_ffn * arch.hidden_size // etp


def _mla_sizes(mla: MLAArch, a: int, h: int, tp: int) -> List[int]:
    """Latent attention's tensors on one TP rank (the q/kv projections, the latent norms, o_proj)."""
    q_out = a * mla.qk_head_dim
    q = ([q_out * h // tp] if mla.q_lora_rank is None
         else [mla.q_lora_rank * h // tp, mla.q_lora_rank, q_out * mla.q_lora_rank // tp])
    return q + [mla.kv_cache_per_token * h // tp, mla.kv_lora_rank,
                a * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank // tp, h * a * mla.v_head_dim // tp]


def layer_tensor_sizes(arch: ModelArch, tp: int, ep: int = 1, etp: Optional[int] = None,
                       layer: Optional[int] = None) -> List[int]:
    """Elements of each parameter tensor of one decoder layer on one rank (the layout above).
    `layer`: its global index, where the model's layers differ (DeepSeek-V3's dense first layers);
    None: an MoE model's MoE layer."""
    d, nq, nkv, h, f = arch.head_dim, arch.num_attention_heads, arch.num_query_groups, \
        arch.hidden_size, arch.ffn_hidden_size
    if arch.mla is not None:
        out = _mla_sizes(arch.mla, nq, h, tp) + [h, h]
    else:
        qkv_out = (nq + 2 * nkv) * d
        out = [qkv_out * h // tp, nq * d * h // tp, h, h]  # QKV, proj, the two norms (replicated)
        if arch.qkv_bias:
            out.append(qkv_out // tp)
    moe = arch.moe
    if is_dense_layer(arch, layer):
        return out + [2 * f * h // tp, f * h // tp]
    etp = tp if etp is None else etp
    if arch.qk_norm:
        out += [d, d]
    out.append(moe.num_experts * h)  # the router, replicated
    if moe.expert_bias:
        out.append(moe.num_experts)  # its per-expert bias (a buffer)
    out += [2 * moe.expert_ffn * h // etp, moe.expert_ffn * h // etp] * (moe.num_experts // ep)
    if moe.shared_ffn:
        out += [2 * moe.shared_ffn * h // tp, moe.shared_ffn * h // tp] + ([h] if moe.shared_gate else [])
    return out


def lora_layer_params(arch: ModelArch, rank: int, targets, tp: int) -> int:
    """Adapter elements of one decoder layer on one TP rank (models/lora.py's split): a
    column-parallel target (linear_qkv, linear_fc1) holds A [r, in] whole and B [r, out / tp]; a
    row-parallel one (linear_proj, linear_fc2) A [r, in / tp] and B [out, r] whole."""
    d, nq, nkv, h, f = arch.head_dim, arch.num_attention_heads, arch.num_query_groups, \
        arch.hidden_size, arch.ffn_hidden_size
    per_target = {"linear_qkv": rank * h + rank * (nq + 2 * nkv) * d // tp,
                  "linear_proj": rank * nq * d // tp + rank * h,
                  "linear_fc1": rank * h + rank * 2 * f // tp,
                  "linear_fc2": rank * f // tp + rank * h}
    return sum(per_target[t] for t in targets)


def stage_params(arch: ModelArch, tp: int, pp: int, stage: int, head: str = "lm", ep: int = 1,
                 etp: Optional[int] = None) -> StageParams:
    """What a rank of pipeline stage `stage` (0 = first) holds. head: lm | value (critic, RM).
    ep / etp: expert (tensor) parallel sizes of an MoE model (etp None = tp)."""
    h = arch.hidden_size
    layers = arch.num_layers // pp
    vocab = padded_vocab_size(arch.vocab_size, tp)
    first, last = stage == 0, stage == pp - 1
    embedding = vocab * h // tp if first else 0
    output = 0
    if last:
        if head == "value":
            output = h  # ValueHead: [1, h], replicated
        elif not arch.tie_word_embeddings or pp > 1:
            output = vocab * h // tp
        output += h  # final norm
    mine = stage_layers(arch, pp, stage)
    per_layer = [layer_tensor_sizes(arch, tp, ep, etp, i) for i in mine]
    tensors = sum(len(p) for p in per_layer) + int(first) + 2 * int(last)
    experts = sum(expert_layer_params(arch, ep, tp if etp is None else etp, i) for i in mine)
    return StageParams(layers, sum(sum(p) for p in per_layer), embedding, output, tensors, experts)


def total_params(arch: ModelArch) -> int:
    """Unsharded parameter count (real vocabulary, as in the HF checkpoint)."""
    h = arch.hidden_size
    emb = arch.vocab_size * h
    return (sum(layer_params(arch, 1, layer=i) for i in range(arch.num_layers))
            + emb * (1 if arch.tie_word_embeddings else 2) + h)


def stage_tensor_sizes(arch: ModelArch, tp: int, pp: int, stage: int, head: str = "lm", ep: int = 1,
                       etp: Optional[int] = None) -> List[int]:
    """Elements of each parameter tensor a rank of `stage` holds (the same layout as stage_params):
    what a per-tensor allocation (pinned host copies, vLLM's weights) is made of."""
    h = arch.hidden_size
    sp = stage_params(arch, tp, pp, stage, head, ep, etp)
    out = [n for i in stage_layers(arch, pp, stage) for n in layer_tensor_sizes(arch, tp, ep, etp, i)]
    if sp.embedding:
        out.append(sp.embedding)
    if sp.output:
        out += [sp.output - h, h] if sp.output > h else [h]  # output layer / value head, final norm
    return [n for n in out if n > 0]
