"""What a training engine is built with: `EngineOptions` (one role's engine, model, precision,
batching, optimizer section, parallel and memory switches), read from the sections by `for_role`.
Both engines take the same options: `engine` says which one (megatron | fsdp, chosen per role by
verl_hpc.config.sections.fsdp.choose_engine); `fsdp` is the fsdp section, read by the FSDP engine
only, `kernels` and the recompute fields by the Megatron engine only.

Every field is required: the values, their defaults and their checks are declared once, in the
config sections, and `for_role` is the one place that reads them; the trainer hands it the job's
sections (verl_hpc/trainer/roles.py: engine_options). Code without a job config
(tests, benchmarks, the GPU check) starts from `default_options(model_path)` - the options of the
default config - and replaces what it varies. `check_options` keeps only what the config cannot
know: the role wiring, and this machine's GPU and Transformer Engine.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from verl_hpc.config import float16
from verl_hpc.config.errors import ConfigError
from verl_hpc.models.gpt import transformer_engine_available
from verl_hpc.runtime.device import has_gpu

if TYPE_CHECKING:  # the Megatron engine's switches; imported where read (no cycle through its package)
    from verl_hpc.engines.megatron.kernels import KernelSwitches

HEADS = ("lm", "value")
ROLES = ("actor", "critic", "ref", "reward", "prm", "teacher")
VALUE_HEAD_SEED = 1234  # a value head made fresh (no score weights in the folder) starts from this seed


def torch_dtype(name: str) -> torch.dtype:
    """model.dtype as a torch dtype (its valid names are the section's choices)."""
    return getattr(torch, name)


@dataclasses.dataclass
class EngineOptions:
    model_path: str
    engine: str  # megatron | fsdp (auto is resolved per role before an engine is built)
    head: str  # lm: log-probs/entropy | value: per-token values / sequence scores
    dtype: str
    trainable: bool  # False: reference / reward model (no grads, no optimizer)
    optim: Any  # verl_hpc.config.schema.OptimConfig; required when trainable
    total_steps: int  # trainer steps, for the LR decay
    micro_batch_size: int  # sequences per micro-batch when max_tokens_per_microbatch is 0
    max_tokens_per_microbatch: int  # dynamic batching budget (padded tokens); 0 = off
    use_distributed_optimizer: bool
    sequence_parallel: bool  # GPU / TE spec only
    fp8: bool
    fp8_recipe: str
    kernels: KernelSwitches  # None fields = auto
    temperature: float  # log-probs of logits / temperature (rollout.temperature)
    # lm heads: tokens per output-layer chunk (model.logits_chunk_tokens; None = auto, 0 = the whole
    # logits; config.sections.model.logits_chunk_size resolves it for the vocabulary slice)
    logits_chunk_tokens: Optional[int]
    loss_norm_len: Optional[float]  # seq-mean-token-sum-norm constant; None = batch's T
    value_head_seed: int
    sdpa_attention: bool  # local spec only: core attention through torch SDPA (sdpa.py)
    # auto: pack the responses to one prompt into one model row where the cost model says it pays
    # (prefix.py) | on: wherever a micro-batch has two responses to a prompt | off
    share_prompts: str
    # activation recompute (parallel.recompute_*): none | selective (core attention) | full
    recompute_granularity: str
    recompute_method: str  # full: uniform | block
    recompute_num_layers: int
    # host offload while idle (<role>.*_offload; offload.py)
    param_offload: bool
    grad_offload: bool
    optimizer_offload: bool
    # LoRA (the actor's only): the job's lora section, or None for full-parameter training;
    # lora_seed starts the adapters' A factors (trainer.seed)
    lora: Any
    lora_seed: int
    # mixture-of-experts models (model.moe_*): aux_loss_coef (None: config.json's), z_loss_coef,
    # capacity_factor (None: dropless), routing_replay (the actor's: off | rollout | old); ignored by
    # dense models
    moe_options: Dict[str, Any]
    # the FSDP engine's section (verl_hpc.config.sections.fsdp.FsdpConfig), and whether
    # transformers may run code shipped with the model (model.trust_remote_code)
    fsdp: Any
    trust_remote_code: bool
    # model.disable_dropout: zero the folder's dropout rates (verl_hpc/models/dropout.py)
    disable_dropout: bool
    # a vision-language model (FSDP engine): train its vision tower and projector too (vision.train_vision_tower)
    train_vision_tower: bool

    @classmethod
    def for_role(cls, role: str, *, model, parallel, actor, ref, critic, prm, reward, lora,
                 temperature: float, lora_seed: int, total_steps: int, fp8: Optional[bool] = None,
                 loss_norm_len: Optional[float] = None, fsdp=None, vision=None, teacher=None) -> "EngineOptions":
        """The options of `role` (actor, critic, ref, reward, prm, teacher) from the job's sections: model,
        parallel, the roles' own (actor, ref, critic, prm, reward: its reward_model) and lora; and
        temperature: rollout.temperature (the lm heads' log-probs), lora_seed: trainer.seed (the
        adapters' A factors), total_steps: the trainer's steps (the LR decay). fp8: None = model.fp8.
        fsdp, vision: the fsdp and vision sections (None: their defaults); teacher: the teacher section
        (role teacher only). `engine` is parallel.engine as written; the
        builder resolves auto for the role's folder (verl_hpc/trainer/roles.py)."""
        if role not in ROLES:
            raise ValueError(f"engine role {role!r}; valid: {', '.join(ROLES)}")
        par = parallel
        from verl_hpc.engines.megatron.kernels import KernelSwitches

        if fsdp is None:
            from verl_hpc.config.sections.fsdp import FsdpConfig

            fsdp = FsdpConfig()
        if vision is None:
            from verl_hpc.config.sections.vision import VisionConfig

            vision = VisionConfig()
        common = dict(engine=parallel.engine, fsdp=fsdp, trust_remote_code=model.trust_remote_code,
                      disable_dropout=model.disable_dropout,
                      train_vision_tower=vision.train_vision_tower,
                      dtype=model.dtype, use_distributed_optimizer=par.use_distributed_optimizer,
                      sequence_parallel=par.sequence_parallel,
                      fp8=model.fp8 if fp8 is None else fp8, fp8_recipe=model.fp8_recipe,
                      kernels=KernelSwitches.from_config(model, par),
                      total_steps=total_steps, loss_norm_len=loss_norm_len,
                      recompute_granularity=par.recompute_granularity,
                      recompute_method=par.recompute_method,
                      recompute_num_layers=par.recompute_num_layers,
                      value_head_seed=VALUE_HEAD_SEED, sdpa_attention=True, lora_seed=lora_seed,
                      temperature=temperature,  # read by lm heads only
                      logits_chunk_tokens=model.logits_chunk_tokens,
                      moe_options=dict(aux_loss_coef=model.moe_aux_loss_coef,
                                       z_loss_coef=model.moe_z_loss_coef,
                                       capacity_factor=model.moe_capacity_factor,
                                       bias_update_rate=model.moe_router_bias_update_rate))
        if role == "actor":  # routing replay is the policy's (model.moe_routing_replay)
            common["moe_options"] = dict(common["moe_options"], routing_replay=model.moe_routing_replay)
        if role in ("actor", "ref"):
            a = actor
            return cls(model_path=model.path, head="lm", trainable=role == "actor",
                       lora=lora if role == "actor" and lora.enabled else None,
                       share_prompts=a.share_prompts,
                       **_offload(a if role == "actor" else ref),
                       optim=a.optim if role == "actor" else None, micro_batch_size=a.micro_batch_size,
                       max_tokens_per_microbatch=a.max_tokens_per_microbatch, **common)
        if role == "prm":  # PRIME's implicit PRM: a causal LM like the policy; frozen with prm.update = none
            p = prm
            trainable = p.update != "none"
            return cls(model_path=p.model_path, head="lm", trainable=trainable, lora=None,
                       share_prompts=actor.share_prompts, **_offload(p),
                       optim=p.optim if trainable else None, micro_batch_size=p.micro_batch_size,
                       max_tokens_per_microbatch=p.max_tokens_per_microbatch, **common)
        if role == "teacher":  # on-policy distillation: a frozen causal LM of its own folder, batched as the actor
            if teacher is None:
                raise ConfigError("a teacher role needs the teacher section (teacher.model_path)")
            # teacher.model_path; the builder puts in each folder of teacher.by_data_source
            return cls(model_path=teacher.model_path, head="lm", trainable=False, lora=None,
                       share_prompts=actor.share_prompts, **_offload(teacher), optim=None,
                       micro_batch_size=actor.micro_batch_size,
                       max_tokens_per_microbatch=actor.max_tokens_per_microbatch, **common)
        # a value head never packs prompts (engine.py); "off" says so without asking the cost model
        common["share_prompts"] = "off"
        if role == "critic":
            c = critic
            return cls(model_path=c.model_path, head="value", trainable=True, optim=c.optim, lora=None,
                       **_offload(c),
                       micro_batch_size=c.micro_batch_size,
                       max_tokens_per_microbatch=c.max_tokens_per_microbatch, **common)
        rm = reward.reward_model
        if not rm.path:
            raise ConfigError("reward.reward_model.path: empty; a reward-model role needs a model folder")
        return cls(model_path=rm.path, head="value", trainable=False, optim=None, lora=None,
                   **_offload(rm),
                   micro_batch_size=actor.micro_batch_size,
                   max_tokens_per_microbatch=actor.max_tokens_per_microbatch, **common)


def _offload(role_cfg) -> Dict[str, bool]:
    """<role>.param_offload / grad_offload / optimizer_offload (the reference has weights only)."""
    return {k: bool(getattr(role_cfg, k, False))
            for k in ("param_offload", "grad_offload", "optimizer_offload")}


@functools.lru_cache(maxsize=1)
def _default_job():
    from verl_hpc.config import load_config  # lazily: building an engine needs no config package

    return load_config(None)


def default_options(model_path: str, **changes) -> EngineOptions:
    """The actor's options under the default config, for `model_path`, with `changes` replaced:
    for code that builds an engine without a job config (tests, benchmarks, the GPU check)."""
    job = _default_job()
    actor = EngineOptions.for_role(
        "actor", model=job.model, parallel=job.parallel, actor=job.actor, ref=job.ref, critic=job.critic,
        prm=job.prm, reward=job.reward, lora=job.lora, temperature=job.rollout.temperature,
        lora_seed=job.trainer.seed, total_steps=job.trainer.total_steps, fsdp=job.fsdp, vision=job.vision)
    return dataclasses.replace(actor, model_path=model_path, **changes)


def check_options(o: EngineOptions) -> None:
    """What the config's checks cannot know: how the options were wired, and this machine."""
    if o.head not in HEADS:
        raise ValueError(f"engine head: {o.head!r}; valid: {', '.join(HEADS)}")
    if o.lora is not None and not (o.trainable and o.head == "lm"):
        raise ValueError("LoRA adapters are for the trained policy (a trainable lm head); the "
                         "reference is the actor with its adapters off")
    if o.trainable and o.optim is None:
        raise ValueError("a trainable engine needs its optim section (actor.optim / critic.optim / prm.optim)")
    # the config refuses these for a CPU job (slurm.gpus_per_node = 0); whether this node has the
    # GPU and Transformer Engine is known only here
    if o.sequence_parallel and not (has_gpu() and transformer_engine_available()):
        raise ConfigError("parallel.sequence_parallel=true needs the Transformer Engine layer spec "
                          "(a CUDA GPU and transformer_engine); Megatron's local spec (torch norm) "
                          "does not support it. Install the 'gpu' extra or set it false.")
    if o.fp8:
        from verl_hpc.models.gpt import check_fp8_supported

        check_fp8_supported(o.fp8_recipe)
    check_float16_here(o.dtype)


def check_float16_here(dtype: str, field: str = "model.dtype = float16 on a machine without a GPU",
                       valid: str = "model.dtype=float32 (or bfloat16)") -> None:
    """model.dtype = float16 on a machine without a GPU: the engines run it on torch's CPU
    float16 kernels (matmul, SDPA, the loss scaler's fused check-and-unscale), which torch 2.13 has
    (the fp16 engine tests run on them). Refused, one line, where this torch lacks one of them
    (verl_hpc.config.float16); on GPUs nothing to check."""
    if dtype != "float16" or has_gpu():
        return
    problem = float16.cpu_float16_problem(field, valid)
    if problem:
        raise ConfigError(problem)
