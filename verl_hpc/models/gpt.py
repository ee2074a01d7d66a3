"""Build this rank's Megatron `GPTModel` stage for an HF architecture.

Layer spec: the local (pure PyTorch) spec on CPU, where Transformer Engine cannot be installed;
the Transformer Engine spec on GPU when TE is importable (required for `fp8`). Both give the same
parameters under different names, which verl_hpc.models.weights understands.

Padded vocabulary: Megatron pads the vocabulary so that TP ranks hold equal slices
(`config_mapping.padded_vocab_size`). The padded rows are zero and never trained, but their logits
would still be 0, i.e. a real probability. A forward hook on the output layer sets them to -inf
in every output of the model, so they can be neither sampled nor scored: vocab-parallel logits
keep their shape (equal shards) with -inf in the padded columns, and `full_vocab_logits` returns
exactly the real vocabulary.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.config_mapping import (
    DEFAULT_VOCAB_DIVISOR,
    ModelArch,
    padded_vocab_size,
    transformer_config,
)
from verl_hpc.models.moe import count_real_tokens_for_expert_bias, use_torch_router_gemm
from verl_hpc.runtime.device import compute_device, has_gpu

log = logging.getLogger(__name__)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401  (GPU images only; never imported on CPU paths)
    except Exception:  # ImportError, or a broken CUDA install raising OSError
        return False
    return True


# the recipes build_gpt_model hands to Megatron (its Fp8Recipe, less custom); model.fp8_recipe's
# choices are the same names (checked at load; a test keeps them equal)
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


def check_fp8_supported(recipe: str) -> None:
    """The documented errors for model.fp8=true where it cannot run (before any model is built)."""
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"model.fp8_recipe: {recipe!r}; valid: {', '.join(FP8_RECIPES)}")
    _check_fp8_runs_here()


def token_alignment(fp8: bool, fp8_recipe: str) -> int:
    """Tokens a micro-batch's sequence length must be a multiple of for the recipe's GEMMs: TE's
    quantizers refuse other token counts (MXFP8 scales blocks of 32 elements, the per-tensor recipes
    need 16). Megatron's own rule (fp8_utils.get_fp8_align_size), so the two cannot drift; 1
    without FP8. The engine pads every micro-batch, the dummy one included, to this times the TP
    size under sequence parallelism (each rank holds 1/tp of the sequence)."""
    if not fp8:
        return 1
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    return get_fp8_align_size(Fp8Recipe(fp8_recipe))


def _check_fp8_runs_here() -> None:
    if not has_gpu():
        raise ConfigError("model.fp8=true needs a CUDA GPU (Transformer Engine FP8); this rank "
                          "has none. Set model.fp8=false for CPU runs.")
    if not transformer_engine_available():
        raise ConfigError("model.fp8=true needs transformer_engine, which is not importable here; "
                          "install the 'gpu' extra (transformer-engine[pytorch]) or set "
                          "model.fp8=false")


def layer_spec(use_te: Optional[bool] = None, fp8: bool = False, arch: Optional[ModelArch] = None):
    """The decoder layer spec: TE on GPU when available (required for fp8), local otherwise. For
    an MoE `arch`: its experts as SequentialMLP (models/moe.py says why not grouped GEMMs), and
    Qwen3's q/k norms."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if fp8:
        _check_fp8_runs_here()
    if use_te is None:
        use_te = has_gpu() and transformer_engine_available()
    experts = arch.moe.num_experts if arch is not None and arch.moe is not None else None
    qk = bool(arch is not None and arch.qk_norm)
    if experts:
        use_torch_router_gemm()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                                qk_layernorm=qk)
    return specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk,
                                          normalization="RMSNorm")


def decoder_spec(config, arch: ModelArch, use_te: Optional[bool] = None, fp8: bool = False,
                 vp_stage: Optional[int] = None):
    """The spec GPTModel builds its decoder from: one layer spec for every layer (layer_spec), or,
    for DeepSeek-V3, Megatron's block spec, which gives each layer its own (multi-latent attention;
    dense layers before the first MoE layer, from config.moe_layer_freq) and keeps this stage's."""
    if arch.mla is None:
        return layer_spec(use_te, fp8, arch)
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if fp8:
        _check_fp8_runs_here()
    if use_te is None:
        use_te = has_gpu() and transformer_engine_available()
    use_torch_router_gemm()
    count_real_tokens_for_expert_bias()
    spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                            vp_stage=vp_stage)
    from verl_hpc.models.mla_attention import with_mla_core_attention, with_split_latent_down_projections

    if use_te:
        return with_split_latent_down_projections(spec)
    return with_mla_core_attention(spec, transformer_engine_available())  # the local DotProductAttention cannot build MLA's


def _rope_kwargs(arch: ModelArch) -> dict:
    # M-RoPE (a vision-language model, models/vlm.py): Megatron's MultimodalRotaryEmbedding, which takes
    # [3, b, s] positions and config.mrope_section
    kind = "mrope" if arch.vision is not None else "rope"
    kw = dict(position_embedding_type=kind, rotary_percent=1.0, rotary_base=arch.rope_theta)
    if arch.rope_scaling and arch.rope_scaling["rope_type"] == "linear":
        # HF divides inv_freq by the factor; Megatron divides positions by it: the same angles.
        kw["seq_len_interpolation_factor"] = arch.rope_scaling["factor"]
    return kw


def _apply_llama3_scaling(model, arch: ModelArch) -> None:
    """Megatron's GPTModel forwards only `factor` for llama3 scaling (its other three parameters
    default to Llama 3.1's values); recompute inv_freq with all four from config.json."""
    rope = model.rotary_pos_emb
    s = arch.rope_scaling
    dim = arch.head_dim
    base = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope.inv_freq = rope._apply_scaling(
        base, factor=s["factor"], low_freq_factor=s["low_freq_factor"],
        high_freq_factor=s["high_freq_factor"],
        original_max_position_embeddings=s["original_max_position_embeddings"],
    ).to(rope.inv_freq.device)


def _mask_padded_vocab(model, arch: ModelArch, tp_rank: int, tp: int) -> None:
    padded, real = model.vocab_size, arch.vocab_size
    per_rank = padded // tp
    # the chunked scoring (engines/megatron/outputs.py) slices the padded rows off instead
    model.output_layer.real_columns = max(0, min(per_rank, real - tp_rank * per_rank))
    if padded == real:
        return

    def hook(module, args, output):
        if getattr(module, "returns_hidden", False):  # its output is the hidden states, not logits
            return output
        logits, bias = output
        width = logits.shape[-1]
        start = 0 if width == padded else tp_rank * per_rank  # gathered or this rank's slice
        first_pad = real - start
        if first_pad >= width:
            return output  # this rank's slice has no padded columns
        cols = torch.arange(width, device=logits.device) >= max(first_pad, 0)
        return logits.masked_fill(cols, float("-inf")), bias

    model.output_layer.register_forward_hook(hook)


def select_output_positions(output_layer) -> None:
    """Let the caller run the output layer on chosen positions only: while
    `output_layer.selected_positions` holds a `[n, T]` index tensor, the layer's input `[s, b, h]`
    is cut to `[T, n, h]` (row i's hidden states at positions[i, :]) before the projection, so its
    result (and Megatron's loss, given `[n, T]` labels) is `[T, n, ...]`. With
    `output_layer.selected_rows` also set (`[n]`), output row i is taken from input row
    selected_rows[i] (packed prompts, engines/prefix.py); else rows map one to one.
    Unset (None): untouched. The RL engines score response tokens only: the vocabulary projection
    of prompt positions is work whose result is never read. Not for sequence-parallel input
    (`[s/tp, b, h]`: each rank holds other positions)."""
    output_layer.selected_positions = None
    output_layer.selected_rows = None

    def pick(module, args, kwargs):
        positions = module.selected_positions
        if positions is None:
            return None
        hidden = args[0]
        rows = module.selected_rows
        if rows is None:
            rows = torch.arange(hidden.shape[1], device=hidden.device)
        return (hidden[positions.t(), rows], *args[1:]), kwargs

    output_layer.register_forward_pre_hook(pick, with_kwargs=True)


def per_row_positions(model) -> None:
    """Let the caller give every row its own rotary positions: while
    `model.rotary_pos_emb.row_positions` holds a `[b, s]` index tensor, the rotary embedding
    Megatron computes for positions 0..s-1 (`[s, 1, 1, d]`) is re-indexed to `[s, b, 1, d]`
    (row b's token i at angle row_positions[b, i]); the unfused RoPE broadcasts it over heads.
    GPTModel's forward ignores position_ids for RoPE, so packed rows (engines/prefix.py)
    need this. Unset (None): untouched. Not with fused RoPE kernels, which take `[s, 1, 1, d]`."""
    rope = model.rotary_pos_emb
    rope.row_positions = None

    def reindex(module, args, output):
        positions = module.row_positions
        if positions is None:
            return None
        return output[:, 0][positions.t()]

    rope.register_forward_hook(reindex)


def _mark_tensor_parallel(model) -> None:
    """Give every TP-split weight Megatron's `tensor_model_parallel` / `partition_dim` attributes.

    megatron-core 0.16.1 sets them on weights only inside its random initialisers, which
    `init_weights=False` skips. Without them Megatron's gradient-norm and optimizer code treat a
    split weight as a replica (counted on TP rank 0 only), and export would not gather it.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def build_gpt_model(arch: ModelArch, *, dtype: torch.dtype = torch.float32,
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    parallel_output: bool = True, use_te: Optional[bool] = None, fp8: bool = False,
                    fp8_recipe: Optional[str] = None,
                    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISOR, vp_stage: Optional[int] = None,
                    **config_overrides):
    """This rank's `GPTModel` for `arch` under the initialised Megatron model parallelism.

    pre/post_process default to this rank's pipeline stage (first stage embeds, last stage has
    the output layer). With virtual pipeline stages, build one chunk per `vp_stage`.
    Weights are not initialised: load them with `weights.load_hf_weights`.
    `parallel_output=True` keeps logits vocab-parallel (what training needs).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if not has_gpu() and dtype != torch.float32:
        log.warning("model dtype %s on CPU: Megatron's CPU paths are verified in float32 only", dtype)
    config = gpt_transformer_config(arch, tp, pp, dtype=dtype, fp8=fp8, fp8_recipe=fp8_recipe,
                                    vp_stage=vp_stage, **config_overrides)
    model_class, extra = GPTModel, {}
    if arch.vision is not None:  # the vision tower on the first stage (models/vlm.py)
        from verl_hpc.models.vlm import VisionGPTModel

        model_class, extra = VisionGPTModel, dict(vision=arch.vision)
    model = model_class(
        config=config, transformer_layer_spec=decoder_spec(config, arch, use_te, fp8, vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_word_embeddings, vp_stage=vp_stage,
        **_rope_kwargs(arch), **extra)
    _mark_tensor_parallel(model)
    if arch.rope_scaling and arch.rope_scaling["rope_type"] == "llama3":
        _apply_llama3_scaling(model, arch)
    if post_process:
        _mask_padded_vocab(model, arch, ps.get_tensor_model_parallel_rank(), tp)
    model.verl_arch = arch  # the mapping reads the real vocabulary and family from here
    # use_cpu_initialization=False places Megatron's own parameters on the current GPU, but not what
    # torch builds itself (the torch-norm fallback without apex): move the whole model, as
    # Megatron-LM's get_model does
    model.to(compute_device())
    return model


def gpt_transformer_config(arch: ModelArch, tp: int, pp: int, *, dtype: torch.dtype = torch.float32,
                           fp8: bool = False, fp8_recipe: Optional[str] = None,
                           vp_stage: Optional[int] = None, **config_overrides):
    """The TransformerConfig build_gpt_model gives GPTModel (no model built: testable anywhere).
    With fp8, `fp8_recipe` (model.fp8_recipe) is required."""
    from megatron.core import parallel_state as ps

    if fp8 and fp8_recipe is None:
        raise ValueError("fp8=True needs fp8_recipe (the job's model.fp8_recipe)")
    if fp8:  # E4M3 forward, E5M2 gradients: TE's usual recipe for training
        config_overrides.setdefault("fp8", "hybrid")
        config_overrides.setdefault("fp8_recipe", fp8_recipe)
    # context parallelism: Megatron's TE attention and rotary table split by it (engines/megatron/context_parallel.py)
    config_overrides.setdefault("context_parallel_size", ps.get_context_parallel_world_size())
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp:  # Megatron's layer offsets per virtual stage read it from the config
        if vp_stage is None:
            raise ValueError(f"virtual pipeline size {vpp}: build one chunk per vp_stage in "
                             f"range({vpp}) (build_gpt_model(arch, vp_stage=i))")
        if arch.num_layers % (pp * vpp):
            raise ConfigError(f"parallel.pp={pp} x parallel.vpp={vpp} does not divide "
                              f"num_hidden_layers={arch.num_layers} of {arch.source}")
        config_overrides.setdefault("virtual_pipeline_model_parallel_size", vpp)
    return transformer_config(arch, tp, pp, dtype=dtype, ep=ps.get_expert_model_parallel_world_size(),
                              etp=ps.get_expert_tensor_parallel_world_size(), **config_overrides)


def full_vocab_logits(logits: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """Vocab-parallel logits `[..., padded/tp]` -> `[..., vocab_size]` on every TP rank.

    Differentiable (Megatron's gather; its backward splits). For inspection and tests: losses
    and entropy should stay vocab-parallel (verl_hpc.algorithms.entropy).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., : arch.vocab_size]
