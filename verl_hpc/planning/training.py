"""Bytes of one Megatron role on one rank: model states and activations.

Model states (Megatron-LM docs/.../dist_optimizer.md; `theoretical_memory_usage.py`):
- weights in the model dtype (2 bytes bf16, 4 bytes fp32), in DDP's contiguous param buffer;
- main grads in fp32 (`grad_reduce_in_fp32`, what the engine sets): 4 bytes, never sharded;
- Adam: exp_avg + exp_avg_sq in fp32 (8 bytes) plus, for bf16/fp16, an fp32 master copy
  (4 bytes); the distributed optimizer shards these over DP.
  => bf16: 6 + 12/DP bytes per parameter with the distributed optimizer, 18 without.

Activations per transformer layer, per micro-batch of s tokens x b sequences (Korthikanti et al.
2022, arXiv 2205.05198, section 4 and Table 2), written as elements x activation bytes so that the
same formula serves fp32 CPU runs, SwiGLU MLPs and grouped-query attention. With tensor parallel t:
- sequence parallel on: everything / t;
- off: the norm inputs, the QKV and fc1 inputs (and dropout masks) are replicated, the rest / t;
- selective recompute (Megatron's default module core_attn): the s^2 attention terms are dropped;
- full recompute: only each recompute unit's input (s*b*h, / t with SP) stays, plus one unit's
  activations rebuilt during its backward (uniform), or the first N layers recomputed (block).
Pipeline 1F1B keeps min(m, p) micro-batches in flight on the first stage; the interleaved schedule
multiplies by (1 + (p - 1) / (p * v)) (Megatron's `theoretical_memory_usage.py`).
The attention kernel decides the s^2 term: "flash" (TE / flash-attn / torch SDPA: only a
log-sum-exp row per head, fp32) or "unfused" (softmax probabilities [b, a, s, s] kept).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from verl_hpc.models.config_mapping import ModelArch
from verl_hpc.planning.output_layer import CHUNK_TOKEN_BYTES, chunk_working_bytes  # noqa: F401 (re-exported)
from verl_hpc.planning.model_shape import StageParams


@dataclasses.dataclass(frozen=True)
class Precision:
    param_bytes: int  # model dtype
    act_bytes: int  # activations
    master_copy: bool  # fp32 main params kept by the optimizer (bf16/fp16 training)

    @classmethod
    def of(cls, dtype: str) -> "Precision":
        half = dtype in ("bfloat16", "float16")
        return cls(2 if half else 4, 2 if half else 4, half)


def model_state_bytes(params: StageParams, prec: Precision, *, trainable: bool, dp: int,
                      distributed_optimizer: bool, adapter: int = 0, edp: Optional[int] = None) -> Dict[str, float]:
    """weights / grads / optimizer bytes of a role on one rank. `adapter`: LoRA's trainable
    elements on this rank (lora.rank > 0): then the base is frozen (its weights only, outside
    DDP's buffers) and the fp32 adapter alone has a gradient and Adam's two moments (an fp32
    parameter needs no master copy), sharded by the distributed optimizer. An MoE model's routed
    experts (`params.expert_params`) are sharded over the expert data-parallel size `edp`
    (dp * tp / (ep * etp); None = dp), the rest over dp."""
    n = params.total
    out = {"weights": float(n * prec.param_bytes), "grads": 0.0, "optimizer": 0.0}
    if not trainable:
        return out
    if adapter:
        out["weights"] += float(adapter * 4)
        out["grads"] = float(adapter * 4)
        out["optimizer"] = float(adapter * 8 / (dp if distributed_optimizer else 1))
        return out
    # Megatron aligns every parameter's start in its buffers to 64 elements (distributed optimizer)
    padded = n + (32 * params.num_tensors if distributed_optimizer else 0)
    out["weights"] = float(padded * prec.param_bytes)
    out["grads"] = float(padded * 4)
    opt_per_param = 8 + (4 if prec.master_copy else 0)
    experts = params.expert_params
    edp = dp if edp is None else max(1, edp)
    out["optimizer"] = float(((padded - experts) / (dp if distributed_optimizer else 1)
                              + experts / (edp if distributed_optimizer else 1)) * opt_per_param)
    return out


# the recompute granularities activation_bytes models (parallel.recompute_granularity's choices,
# checked at load; a test keeps them the same names)
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class ActivationSetup:
    tp: int
    sequence_parallel: bool
    recompute: str  # none | selective | full
    recompute_method: str  # uniform | block
    recompute_num_layers: int
    attention: str = "flash"  # flash | unfused
    dropout: bool = False  # RL fine-tuning runs without dropout (the engine sets 0.0)
    gated_mlp: bool = True  # SwiGLU (Llama, Qwen2); False: GPT's GeLU MLP (the paper's model)
    # what the layer's code saves for backward (measured; docs/memory.md):
    #   paper: the paper's accounting (GPT, LayerNorm, separate Q/K/V) - the published figures
    #   te:    Transformer Engine layers (GPU): norms fused into the next linear
    #   local: Megatron's local spec (CPU): unfused RMSNorm (keeps its normalised copy too),
    #          SwiGLU keeps 5 x ffn, RoPE's cos/sin per layer
    impl: str = "te"


def mlp_width(arch: ModelArch) -> int:
    """The MLP intermediate width a token's activations occupy: ffn for a dense layer; for an MoE
    layer top_k routed experts of F each, plus the shared expert. A model with dense first layers
    (DeepSeek-V3) is counted at the wider of the two, for every layer (an upper bound; DeepSeek-V3's
    are equal: 8 x 2048 + 2048 = 18432)."""
    moe = arch.moe
    if moe is None:
        return arch.ffn_hidden_size
    routed = moe.top_k * moe.expert_ffn + moe.shared_ffn
    return max(routed, arch.ffn_hidden_size) if moe.first_dense else routed


def moe_dispatch_bytes(arch: ModelArch, s: int, b: int, e: int) -> float:
    """What an MoE layer's alltoall dispatcher and router keep per micro-batch, beyond the expert
    MLPs: the router's fp32 logits and probabilities [s*b, E], and each token's top_k copies before
    and after the expert all-to-all, on the way there and back (4 x s*b*k*h). 0 for a dense layer."""
    moe = arch.moe
    if moe is None:
        return 0.0
    return 2 * s * b * moe.num_experts * 4 + 4 * s * b * moe.top_k * arch.hidden_size * e


def mla_latent_bytes(arch: ModelArch, tokens: int, e: int) -> float:
    """Latent attention's compressed tensors a layer keeps per micro-batch, whole on every TP rank
    (the down projections' outputs are gathered): the q latent and its norm's output, the kv latent
    (kv_lora_rank) and its norm's output, the rope key (qk_rope_head_dim): the compressed KV of
    kv_lora_rank + qk_rope_head_dim per token, and its normalised copy."""
    m = arch.mla
    q = 2 * (m.q_lora_rank or 0)
    return float(tokens * (q + 2 * m.kv_lora_rank + m.qk_rope_head_dim) * e)


def mla_head_elements(arch: ModelArch) -> int:
    """Per token, the per-head tensors latent attention keeps (split over TP): the q up-projection's
    output and Q after RoPE (nope + rope each), kv_b's output (nope + v), K after RoPE, V (a
    contiguous copy) and the attention output (v each)."""
    m, a = arch.mla, arch.num_attention_heads
    return a * (3 * m.qk_head_dim + m.qk_nope_head_dim + 3 * m.v_head_dim)


def layer_activation_bytes(arch: ModelArch, s: int, b: int, act_bytes: int, st: ActivationSetup) -> float:
    """Saved activation bytes of one transformer layer for one micro-batch (no recompute)."""
    if st.impl != "paper":
        return _implemented_layer_bytes(arch, s, b, act_bytes, st) + moe_dispatch_bytes(arch, s, b, act_bytes)
    h, f, a, t = arch.hidden_size, mlp_width(arch), arch.num_attention_heads, st.tp
    hq, hkv = a * arch.head_dim, arch.num_query_groups * arch.head_dim
    sb = s * b
    e = act_bytes
    # replicated over TP unless sequence parallel: norm inputs, QKV input, fc1 input (+ masks)
    rep = 4 * sb * h * e + (2 * sb * h if st.dropout else 0)
    # split over TP: Q, K (after RoPE), V, the attention output (proj input); SwiGLU keeps fc1's
    # two halves, silu(gate) and the product (fc2 input): 4 x s*b*ffn; GeLU its input and output
    split = sb * (hq + hkv + hkv + hq) * e + (4 if st.gated_mlp else 2) * sb * f * e
    if arch.mla is not None:
        rep += mla_latent_bytes(arch, sb, e)
        split = sb * mla_head_elements(arch) * e + (4 if st.gated_mlp else 2) * sb * f * e
    if st.attention == "unfused":
        quad = a * s * s * b * e + (a * s * s * b * (1 + e) if st.dropout else 0)
    else:
        quad = a * s * b * 4  # log-sum-exp per query row, fp32
    if st.recompute == "selective":
        quad = 0.0
    rep_div = t if st.sequence_parallel else 1
    return rep / rep_div + (split + quad) / t


def _implemented_layer_bytes(arch: ModelArch, s: int, b: int, e: int, st: ActivationSetup) -> float:
    """What Megatron's layer code keeps, tensor by tensor (the same terms as the paper, counted
    the way the kernels hold them):
    - each norm keeps its input and its normalised output (fp32 rsqrt per row besides); the local
      spec's unfused RMSNorm keeps one more copy (the product before the weight);
    - Q and K after RoPE are new tensors; V is a view of the fused QKV output, which therefore
      stays alive whole; the attention output (proj input); flash attention's fp32 log-sum-exp;
    - SwiGLU: fc1's output (2 ffn) and the product (fc2 input); the local spec also keeps silu(gate)
      and the gate's sum (5 ffn in all). An MoE layer's experts: the same per token and routed expert
      (mlp_width), its dispatcher apart (moe_dispatch_bytes)."""
    h, f, a, t = arch.hidden_size, mlp_width(arch), arch.num_attention_heads, st.tp
    hq, hkv, d = a * arch.head_dim, arch.num_query_groups * arch.head_dim, arch.head_dim
    sb = s * b
    local = st.impl == "local"
    norm = 2 * sb * h * e + sb * 4  # input + normalised output, rsqrt
    rep = 2 * norm + (2 * sb * h * e if local else 0)  # local: + the linear inputs' copies
    split = sb * (3 * hq + 3 * hkv) * e + (5 if local else 3) * sb * f * e
    if arch.mla is not None:
        rep += mla_latent_bytes(arch, sb, e)
        split = sb * mla_head_elements(arch) * e + (5 if local else 3) * sb * f * e
        d = arch.mla.qk_rope_head_dim
    quad = 0.0 if st.recompute == "selective" else a * s * b * 4
    rope = 4 * s * d * 4 if local else 0.0  # cos/sin of Q and K, fp32, per layer
    return rep / (t if st.sequence_parallel else 1) + (split + quad) / t + rope


def final_norm_bytes(arch: ModelArch, s: int, b: int, e: int, st: ActivationSetup) -> float:
    """The last stage's final norm: its input and normalised output, and the rsqrt per row (the
    output layer's own input is counted with the logits)."""
    if st.impl == "paper":
        return 0.0
    return (2 * s * b * arch.hidden_size * e + s * b * 4) / (st.tp if st.sequence_parallel else 1)


def layer_input_bytes(arch: ModelArch, s: int, b: int, act_bytes: int, st: ActivationSetup) -> float:
    return s * b * arch.hidden_size * act_bytes / (st.tp if st.sequence_parallel else 1)


def stage_activation_bytes(arch: ModelArch, layers: int, s: int, b: int, act_bytes: int,
                           st: ActivationSetup, last_stage: bool = False) -> Dict[str, float]:
    """Saved bytes of one micro-batch over `layers` layers (+ the final norm on the last stage):
    {"saved", "recompute_working"}."""
    per_layer = layer_activation_bytes(arch, s, b, act_bytes, st)
    tail = final_norm_bytes(arch, s, b, act_bytes, st) if last_stage else 0.0
    if st.recompute != "full":
        return {"saved": layers * per_layer + tail, "recompute_working": 0.0}
    n = max(1, min(st.recompute_num_layers, layers))
    inp = layer_input_bytes(arch, s, b, act_bytes, st)
    if st.recompute_method == "block":  # the first n layers recomputed, the rest kept whole
        return {"saved": inp + (layers - n) * per_layer + tail, "recompute_working": n * per_layer}
    units = -(-layers // n)
    return {"saved": units * inp + tail, "recompute_working": n * per_layer}


def cp_tokens(s: int, cp: int) -> int:
    """Tokens of an s-token row on one context-parallel rank: the engine pads the row to a multiple
    of 2 * cp and each rank holds two of its 2 * cp chunks (engines/megatron/context_parallel.py).
    Every activation and logit term is linear in a rank's tokens (flash attention's log-sum-exp
    is per query), so the rank's activations are those of an s / cp row."""
    return s if cp <= 1 else 2 * -(-s // (2 * cp))


def in_flight_factor(pp: int, vpp: int, microbatches: int) -> float:
    """Micro-batches of a stage's layers whose activations the first stage holds at once."""
    if pp <= 1:
        return 1.0
    if vpp and vpp > 1:
        return pp * (1 + (pp - 1) / (pp * vpp))
    return float(min(microbatches, pp))


def logits_bytes(arch: ModelArch, tokens: int, tp: int, act_bytes: int, head: str,
                 padded_vocab: int, chunk: int = 0) -> float:
    """The output layer's [tokens, V/t] logits plus the vocab-parallel cross-entropy's fp32
    working copies (softmax / log-softmax over the TP slice); a value head keeps [tokens, 1].
    chunk: planning/output_layer.py output_chunk's answer for this micro-batch (0: the whole
    logits); > 0: the logits of one chunk of tokens at a time (chunk_working_bytes), the output
    layer's input and the scored positions' copy of it, and a few fp32 numbers per token (max,
    log Z, entropy, the outputs)."""
    inp = tokens * arch.hidden_size * act_bytes  # the output layer's input, kept for backward
    if head == "value":
        return float(inp + tokens * 4)
    v = padded_vocab / tp
    if chunk > 0:
        return 2 * inp + CHUNK_TOKEN_BYTES * tokens + chunk_working_bytes(min(chunk, tokens), v, act_bytes)
    return inp + tokens * v * act_bytes + 2 * tokens * v * 4
