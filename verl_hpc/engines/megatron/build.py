"""Building a Megatron engine's model: the GPT chunks of this rank's (virtual) pipeline stages
with their HF weights and, for critics and reward models, a value head; and the DDP wrappers of a
trainable engine; and the two choices made once on the built model: which output layers compute
response positions only, and whether micro-batches may pack the responses to one prompt.

    chunks, heads = build_chunks(options, dtype, sequence_parallel, perf)
    ddp_chunks = wrap_ddp(chunks, perf, options.use_distributed_optimizer)
    output_layers = output_position_layers(options, ddp_chunks, chunks, sequence_parallel)
    sharing, rotary = prompt_sharing(options, ddp_chunks, chunks, sequence_parallel=sequence_parallel,
                                     vpp=vpp, rope_fusion=chunks[0].config.apply_rope_fusion)

Megatron's model-parallel state must be initialised (verl_hpc.parallel.init_model_parallel).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.megatron.kernels import PerfOptions, kernel_report, norms_in_compute_dtype
from verl_hpc.engines.options import EngineOptions
from verl_hpc.engines.prefix import CostModel, PromptSharing
from verl_hpc.engines.megatron.value_head import attach_value_head, causal_lm_config, head_detached
from verl_hpc.models import build_gpt_model, load_arch, load_hf_config, load_hf_weights, parse_hf_config
from verl_hpc.models.gpt import transformer_engine_available
from verl_hpc.runtime.device import has_gpu

log = logging.getLogger(__name__)


def recompute_overrides(o: EngineOptions) -> Dict[str, Any]:
    """Megatron TransformerConfig fields for the recompute options (none: Megatron's default)."""
    if o.recompute_granularity == "selective":  # Megatron's default module list: ["core_attn"]
        return dict(recompute_granularity="selective")
    if o.recompute_granularity == "full":
        return dict(recompute_granularity="full", recompute_method=o.recompute_method,
                    recompute_num_layers=o.recompute_num_layers)
    return {}


def engine_arch(o: EngineOptions):
    """The model's architecture; a value head's model has no tied output layer to share."""
    path = o.model_path
    if o.head == "lm":
        return load_arch(path)

    arch = parse_hf_config(causal_lm_config(load_hf_config(path)), source=f"{path}/config.json")
    return dataclasses.replace(arch, tie_word_embeddings=False)  # the head replaces lm_head


def build_chunks(o: EngineOptions, dtype: torch.dtype, sequence_parallel: bool,
                 perf: PerfOptions) -> Tuple[List[Any], List[Optional[Any]]]:
    """(one GPT model per virtual stage of this rank, its value head or None), weights loaded."""
    from megatron.core import parallel_state as ps

    arch = engine_arch(o)
    if arch.vision is not None:
        # M-RoPE turns each row by its own positions ([s, b, 1, d]); the fused RoPE kernels take one
        # table for every row ([s, 1, 1, d]). Here, so that the kernel report says so too.
        perf = dataclasses.replace(perf, apply_rope_fusion=False)
    pp = ps.get_pipeline_model_parallel_world_size()
    overrides = dict(calculate_per_token_loss=True, sequence_parallel=sequence_parallel,
                     moe_options=o.moe_options,
                     **perf.transformer_overrides(), **recompute_overrides(o))
    if dtype != torch.bfloat16:  # Megatron's fused cross-entropy hands back a bf16 gradient (kernels.py)
        overrides.pop("cross_entropy_loss_fusion", None)
        overrides.pop("cross_entropy_fusion_impl", None)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp and pp == 2:
        # At pp=2 the previous and next stage are the same rank: the interleaved schedule's
        # batched isend/irecv of activations and gradients then match in the wrong order
        # (seen with gloo: silently swapped, wrong loss and gradients). Unbatched p2p orders
        # sends and receives by rank parity and is correct.
        overrides.update(batch_p2p_comm=False)
    if pp > 1 and not vpp:  # micro-batches differ in shape: stages exchange shapes first
        # (the dense model has no experts; Megatron refuses its default MoE dispatcher here)
        overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    stages = list(range(vpp)) if vpp else [None]
    chunks = [build_gpt_model(arch, dtype=dtype, fp8=o.fp8, fp8_recipe=o.fp8_recipe,
                              vp_stage=v, **overrides)
              for v in stages]
    norms_in_compute_dtype(chunks, dtype)  # torch's norms without apex: fp32 weights otherwise (kernels.py)
    heads = [None] * len(chunks)
    with contextlib.ExitStack() as stack:
        if o.head == "value":
            for i, gpt in enumerate(chunks):
                if gpt.post_process:
                    heads[i] = attach_value_head(gpt, o.model_path, seed=o.value_head_seed,
                                                 sequence_parallel=sequence_parallel)
                    stack.enter_context(head_detached(gpt))
        load_hf_weights(chunks, o.model_path)
    if o.sdpa_attention:
        from verl_hpc.engines.megatron.sdpa import use_sdpa_core_attention

        use_sdpa_core_attention(chunks)  # a no-op for Transformer Engine layers
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 and ps.is_pipeline_first_stage():
        log.info("Megatron kernels: %s", "; ".join(f"{k}: {v}" for k, v in kernel_report(chunks, perf).items()))
    return chunks, heads


def wrap_ddp(gpt_chunks: List[Any], perf: PerfOptions, use_distributed_optimizer: bool) -> List[Any]:
    """Megatron's DistributedDataParallel around each chunk (fp32 grad buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=perf.overlap_grad_reduce,
        overlap_param_gather=perf.overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False)  # guarded_step reports non-finite steps instead
    chunks = [DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt,
                                      disable_bucketing=i > 0)
              for i, gpt in enumerate(gpt_chunks)]
    if perf.overlap_grad_reduce:
        # Megatron's schedules run every micro-batch but the last under no_sync, so that a
        # bucket is reduced once per step, after its last gradient (as Megatron-LM sets it up).
        no_sync = [c.no_sync for c in chunks]
        gpt_chunks[0].config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return chunks


def check_context_parallel(cp: int) -> None:
    """Megatron-Core runs context-parallel attention in Transformer Engine only (its local
    DotProductAttention asserts context_parallel_size == 1; the rotary table's CP split moves to
    CUDA): refuse here, before any weight is built, rather than deep in the first layer."""
    if cp > 1 and not (has_gpu() and transformer_engine_available()):
        missing = "Transformer Engine is not installed" if has_gpu() else "this node has no CUDA GPU"
        raise ConfigError(f"parallel.cp = {cp} needs Transformer Engine's attention (TEDotProductAttention) on "
                          f"a CUDA GPU, and {missing}; install the 'gpu' extra or set parallel.cp=1")


def output_position_layers(o: EngineOptions, chunks: List[Any], gpt_chunks: List[Any],
                           sequence_parallel: bool, cp: int = 1) -> Dict[int, Any]:
    """{id(chunk): output layer} of the chunks whose vocabulary projection runs on response
    positions only (lm head; not with sequence parallelism, whose output-layer input is split
    over positions, nor FP8, whose GEMMs want row counts in multiples of 16). Prompt
    positions' logits are never read (benchmarks/bench_vs_trl.py --sizes tiny, 1 rank: update
    stage 0.218 -> 0.186 s). Not under context parallelism either: the response positions index
    the whole sequence, and each CP rank holds two chunks of it."""
    from verl_hpc.models.gpt import select_output_positions

    if o.head != "lm" or sequence_parallel or o.fp8 or cp > 1:
        return {}
    chosen = {}
    for chunk, gpt in zip(chunks, gpt_chunks):
        if gpt.post_process:
            select_output_positions(gpt.output_layer)
            chosen[id(chunk)] = gpt.output_layer
    return chosen


def prompt_sharing(o: EngineOptions, chunks: List[Any], gpt_chunks: List[Any], *, sequence_parallel: bool,
                   vpp: int, rope_fusion: bool, cp: int = 1) -> Tuple[Optional[PromptSharing], Dict[int, Any]]:
    """(the per-micro-batch packing decision, {id(chunk): rotary embedding}) when micro-batches
    may pack the responses to one prompt into one row (prefix.py), else (None, {}).
    The conditions depend on the options and the layer spec only, so every pipeline stage
    decides alike: an lm head with output-position selection, no virtual pipeline (fixed
    shapes), unfused RoPE, and core attention through SDPA (which takes the mask)."""
    from verl_hpc.engines.megatron.sdpa import SdpaCoreAttention
    from verl_hpc.models.gpt import per_row_positions

    if o.share_prompts == "off":
        return None, {}
    layers = gpt_chunks[0].decoder.layers
    why_not = ("context parallelism splits each row over the CP ranks" if cp > 1
               else "the head is not a language-model head" if o.head != "lm"
               else "sequence parallelism or FP8 is on" if sequence_parallel or o.fp8
               else "multi-head latent attention (DeepSeek-V3) has no packed-prompt attention"
               if getattr(gpt_chunks[0].config, "multi_latent_attention", False)
               else "virtual pipeline stages need fixed shapes" if vpp
               else "RoPE fusion takes one position per column" if rope_fusion
               else "core attention is not torch SDPA (Transformer Engine spec or "
                    "sdpa_attention=False)" if not layers or not isinstance(
                        layers[0].self_attention.core_attention, SdpaCoreAttention)
               else "")
    if why_not:
        if o.share_prompts == "on":
            raise ConfigError(f"actor.share_prompts=on: cannot pack prompts here: {why_not}; "
                              "valid: auto (packs where possible) or off")
        if o.head == "lm":
            log.info("shared prompts off: %s (one sequence per row)", why_not)
        return None, {}
    log.info("shared prompts %s: micro-batches pack the responses to one prompt into one row%s",
             o.share_prompts, "" if o.share_prompts == "on" else " where the cost model predicts "
             ">= 10% less work (actor/packed_microbatches counts them)")
    rotary = {}
    for chunk, gpt in zip(chunks, gpt_chunks):
        if gpt.position_embedding_type == "mrope":  # M-RoPE takes [3, b, s] positions, one per row already
            continue
        per_row_positions(gpt)
        rotary[id(chunk)] = gpt.rotary_pos_emb
    return PromptSharing(CostModel.for_config(gpt_chunks[0].config),
                         force=o.share_prompts == "on"), rotary
