"""What a Megatron engine is built with: `EngineOptions` (one role's model, precision, batching,
optimizer section, parallel and memory switches) and their checks.

`verl_hpc.engines.megatron.roles.engine_options(role, cfg)` fills them from the job config; tests
and benchmarks build them directly, so `check_options` names a bad value too, and adds what only
the engine can know (this machine's GPU and Transformer Engine).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from verl_hpc.config.schema import choices_of, default_of
from verl_hpc.engines.megatron.kernels import KernelSwitches
from verl_hpc.models.gpt import transformer_engine_available
from verl_hpc.runtime.device import has_gpu

DTYPES = {name: getattr(torch, name) for name in choices_of("model.dtype")}
HEADS = ("lm", "value")
RECOMPUTE = choices_of("parallel.recompute_granularity")
SHARE_PROMPTS = choices_of("actor.share_prompts")


@dataclasses.dataclass
class EngineOptions:
    model_path: str
    head: str = "lm"  # lm: log-probs/entropy | value: per-token values / sequence scores
    dtype: str = default_of("model.dtype")
    trainable: bool = True  # False: reference / reward model (no grads, no optimizer)
    optim: Any = None  # verl_hpc.config.schema.OptimConfig; required when trainable
    total_steps: int = 1  # trainer steps, for the LR decay (trainer.total_steps)
    micro_batch_size: int = default_of("actor.micro_batch_size")  # sequences per micro-batch when max_tokens_per_microbatch is 0
    # dynamic batching budget (padded tokens); 0 = off
    max_tokens_per_microbatch: int = default_of("actor.max_tokens_per_microbatch")
    use_distributed_optimizer: bool = default_of("parallel.use_distributed_optimizer")
    sequence_parallel: bool = default_of("parallel.sequence_parallel")  # GPU / TE spec only
    fp8: bool = default_of("model.fp8")
    fp8_recipe: str = default_of("model.fp8_recipe")
    kernels: KernelSwitches = dataclasses.field(default_factory=KernelSwitches)  # None = auto
    temperature: float = default_of("rollout.temperature")  # log-probs of logits / temperature
    loss_norm_len: Optional[float] = None  # seq-mean-token-sum-norm constant; None = batch's T
    value_head_seed: int = 1234
    sdpa_attention: bool = True  # local spec only: core attention through torch SDPA (sdpa.py)
    # auto: pack the responses to one prompt into one model row where the cost model says it pays
    # (prefix.py) | on: wherever a micro-batch has two responses to a prompt | off
    share_prompts: str = default_of("actor.share_prompts")
    # activation recompute (parallel.recompute_*): none | selective (core attention) | full
    recompute_granularity: str = default_of("parallel.recompute_granularity")
    recompute_method: str = default_of("parallel.recompute_method")  # full: uniform | block
    recompute_num_layers: int = default_of("parallel.recompute_num_layers")
    # host offload while idle (<role>.*_offload; offload.py)
    param_offload: bool = default_of("actor.param_offload")
    grad_offload: bool = default_of("actor.grad_offload")
    optimizer_offload: bool = default_of("actor.optimizer_offload")


def check_options(o: EngineOptions) -> None:
    if o.head not in HEADS:
        raise ValueError(f"engine head: {o.head!r}; valid: {', '.join(HEADS)}")
    if o.dtype not in DTYPES:
        raise ValueError(f"model.dtype: {o.dtype!r}; valid: {', '.join(DTYPES)}")
    if o.trainable and o.optim is None:
        raise ValueError("a trainable engine needs its optim section (actor.optim / critic.optim)")
    if o.micro_batch_size < 1 and o.max_tokens_per_microbatch < 1:
        raise ValueError("micro_batch_size must be >= 1 when max_tokens_per_microbatch is 0; got "
                         f"{o.micro_batch_size}")
    if o.sequence_parallel and not (has_gpu() and transformer_engine_available()):
        raise ValueError("parallel.sequence_parallel=true needs the Transformer Engine layer spec "
                         "(a CUDA GPU and transformer_engine); Megatron's local spec (torch norm) "
                         "does not support it. Install the 'gpu' extra or set it false.")
    if o.fp8:
        from verl_hpc.models.gpt import check_fp8_supported

        check_fp8_supported(o.fp8_recipe)
    if o.recompute_granularity not in RECOMPUTE:
        raise ValueError(f"parallel.recompute_granularity: {o.recompute_granularity!r}; valid: "
                         f"{', '.join(RECOMPUTE)}")
    if o.share_prompts not in SHARE_PROMPTS:
        raise ValueError(f"actor.share_prompts: {o.share_prompts!r}; valid: {', '.join(SHARE_PROMPTS)}")
