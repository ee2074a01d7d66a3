"""What a `MegatronEngine` is made of, set up once when it is created (engine.py's `__init__`):

    wire(engine, options)

in this order, each step needing the ones before it:

1. the checks (Megatron's layout initialised, the options, dropout off, context parallelism's
   attention, the layouts a vision-language model does not run in: vision.py) before any weight is built;
2. the layout this rank sits in (tp, pp, vpp, dp, cp), the kernel switches (kernels.py) and the
   padding every micro-batch gets (FP8's token alignment, sequence and context parallelism);
3. the GPT chunks with their weights and value heads (build.py), then LoRA's adapters (lora.py)
   before DDP, so that DDP and the optimizer see the adapters only;
4. the device contract on the whole model (runtime.device.place_on_device), then which rank
   reports and which names the metrics (a collective);
5. trainable: a vision-language model's tower frozen or trained (vision.train_vision_tower), then
   every chunk in Megatron's DDP, Adam and its LR schedule (optim.py); frozen: no gradients at all;
6. the choices made once on the built model: router statistics (moe_stats.py), response-only and
   chunked output layers (outputs.py), prompt sharing, routing replay (route_replay.py);
7. the offloader (engines/offload.py), which leaves the engine idle from birth: the role's phases
   bring back what they need.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from verl_hpc.engines.megatron import lora as lora_lib
from verl_hpc.engines.megatron import optim as optim_lib
from verl_hpc.engines.megatron import outputs as outputs_lib
from verl_hpc.engines.megatron import vision as vision_lib
from verl_hpc.engines.megatron.build import (build_chunks, check_context_parallel, engine_arch, output_position_layers,
                                             prompt_sharing, wrap_ddp)
from verl_hpc.engines.megatron.moe_stats import RouterStats
from verl_hpc.engines.megatron.route_replay import RouteReplay
from verl_hpc.engines.options import EngineOptions, check_options, torch_dtype
from verl_hpc.models.gpt import token_alignment
from verl_hpc.runtime.device import collective_device, place_on_device

log = logging.getLogger(__name__)


def wire(engine, options: EngineOptions) -> None:
    """Sets `engine`'s layout, model chunks, optimizer and offloader from `options` (steps above)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("MegatronEngine needs Megatron model parallelism: call "
                           "verl_hpc.parallel.init_model_parallel first")
    check_options(options)
    if not options.disable_dropout:  # parallel.engine=auto resolved to Megatron for this role
        from verl_hpc.config.errors import ConfigError
        from verl_hpc.config.sections.model import DROPOUT_ON_MEGATRON

        raise ConfigError(DROPOUT_ON_MEGATRON)
    e = engine
    e.options = o = options
    e.dtype = torch_dtype(o.dtype)
    e.default_outputs = ("log_probs", "entropy") if o.head == "lm" else ("values",)
    e.tp = ps.get_tensor_model_parallel_world_size()
    e.pp = ps.get_pipeline_model_parallel_world_size()
    e.vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    e.dp, e.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    e.cp = ps.get_context_parallel_world_size()
    check_context_parallel(e.cp)  # before any weight is built
    e._cp_group = ps.get_context_parallel_group() if e.cp > 1 else None
    e.sequence_parallel = o.sequence_parallel and e.tp > 1
    e.shard_optimizer = shard_optimizer(o)
    e.perf = o.kernels.resolve(trainable=o.trainable,
                                            use_distributed_optimizer=o.use_distributed_optimizer)
    if not e.shard_optimizer:  # no parameter shards to all-gather
        e.perf = dataclasses.replace(e.perf, overlap_param_gather=False)
    e._params_stale = False  # overlap_param_gather: a step applied, not yet all-gathered
    # context parallelism cuts each sequence into 2 * cp chunks (context_parallel.py), and each
    # rank's S / cp tokens are split again over TP under sequence parallelism
    e.pad_seq_to = (token_alignment(o.fp8, o.fp8_recipe) * (e.tp if e.sequence_parallel else 1)
                    * (2 * e.cp if e.cp > 1 else 1))
    vision_lib.check_layout(engine_arch(o), cp=e.cp, vpp=e.vpp, head=o.head)  # before any weight is built
    e.gpt_chunks, e.heads = build_chunks(o, e.dtype, e.sequence_parallel, e.perf)
    e.vision = e.gpt_chunks[0].verl_arch.vision  # a vision-language model's tower and M-RoPE (models/vlm.py)
    e.lora = lora_lib.adapter_spec(o.lora)
    if e.lora is not None:  # before DDP: it and the optimizer then see the adapters only
        start = None
        if o.lora.init_from:  # read first: its A decide the fused layers' shapes (per_module_a)
            e.lora, start = lora_lib.read_peft_folder(e.lora, o.lora.init_from, e.gpt_chunks[0].verl_arch)
        lora_lib.attach(e.gpt_chunks, e.lora, seed=o.lora_seed, sequence_parallel=e.sequence_parallel, start=start)
    # value heads and adapters are attached after the build: the device contract is checked on
    # the whole model (runtime.device.place_on_device), before DDP allocates its buffers
    e.device = place_on_device(e.gpt_chunks, f"the Megatron engine ({o.model_path})")
    e.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    # one rank per DP replica reports: CP ranks hold the same gathered results (context_parallel.py)
    e.reporting = (e.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_context_parallel_rank() == 0)
    e._key_source = key_source(e.reporting and e.dp_rank == 0)
    e.optimizer = e.scheduler = None
    if e.vision is not None and o.trainable and e.lora is None:
        tower_trainable(e.gpt_chunks, o.train_vision_tower)  # before DDP: it sees what trains
    if o.trainable:
        e.chunks = wrap_ddp(e.gpt_chunks, e.perf, e.shard_optimizer)
        e.optimizer = optim_lib.build_optimizer(e.chunks, o.optim, e.dtype, e.shard_optimizer)
        e.scheduler = optim_lib.build_scheduler(e.optimizer, o.optim, o.total_steps)
    else:
        e.chunks = e.gpt_chunks
        for p in e._parameters():
            p.requires_grad_(False)
    arch = e.gpt_chunks[0].verl_arch
    # a trainable MoE model reports its routers' load per step (moe_stats.py)
    e.router_stats = RouterStats(e.gpt_chunks, arch) if arch.moe is not None and o.trainable else None
    e._output_layers = output_position_layers(o, e.chunks, e.gpt_chunks, e.sequence_parallel, cp=e.cp)
    e._logits_chunk = outputs_lib.logits_chunk(o, e.cp, e.gpt_chunks[0].vocab_size // e.tp)
    e._chunked = outputs_lib.chunked_output_layer(o, e.gpt_chunks, e._logits_chunk)  # hidden states out
    if e._chunked is not None and o.trainable:
        e._chunked.pending = lambda: pending_state_bytes(e.optimizer, o.optimizer_offload)
    e._share_prompts, e._rotary = prompt_sharing(  # the rotary fusion the model was built with (build.py)
        o, e.chunks, e.gpt_chunks, sequence_parallel=e.sequence_parallel, vpp=e.vpp,
        rope_fusion=e.gpt_chunks[0].config.apply_rope_fusion, cp=e.cp)
    # routing replay (model.moe_routing_replay; route_replay.py)
    e.replay_mode = (o.moe_options or {}).get("routing_replay", "off") if arch.moe is not None else "off"
    e.route_replay = RouteReplay(e.gpt_chunks, arch) if e.replay_mode != "off" else None
    e.steps_applied = 0
    e._stepped_since_schedule = False  # scheduler_step advances only after an applied step
    from verl_hpc.engines.offload import Offloader

    e.offloader = Offloader(e, params=o.param_offload, grads=o.grad_offload and o.trainable,
                            optimizer=o.optimizer_offload and o.trainable)
    e.offloader.offload()  # idle from birth: the role's phases bring back what they need


def tower_trainable(gpt_chunks, train: bool) -> None:
    """A vision-language model's tower (first stage) frozen, as vision.train_vision_tower's default
    says (no gradient, no optimizer state, bitwise unchanged), or trained with its gradients averaged
    over the tensor-parallel ranks that hold its replicas (models/vlm.py)."""
    from verl_hpc.models.vlm import mark_tower_gradients

    for gpt in gpt_chunks:
        if getattr(gpt, "visual", None) is None:
            continue
        gpt.visual.requires_grad_(train)
        if train:
            mark_tower_gradients(gpt)


def pending_state_bytes(optimizer, offloaded_when_idle: bool) -> int:
    """The inner torch optimizers' Adam state not yet created (engines/logits.py
    pending_adam_bytes) that later steps hold on the device at the output layer: none while it
    is offloaded outside an update."""
    from verl_hpc.engines.logits import pending_adam_bytes

    if offloaded_when_idle and not torch.is_grad_enabled():
        return 0
    return pending_adam_bytes([getattr(w, "optimizer", None)
                               for w in getattr(optimizer, "chained_optimizers", [optimizer])])


def shard_optimizer(o: EngineOptions) -> bool:
    """Megatron's DistributedOptimizer when `use_distributed_optimizer` and there is more than
    one data-parallel rank to shard over. With one, its shard is everything, and each step
    would only add a reduce-scatter and an all-gather of every parameter onto the same rank,
    two copies of the whole model that gloo makes even at world size 1 (the plain optimizer's
    all-reduce over one rank returns at once). The optimizer state is the same either way,
    and checkpoints hold layout-independent slabs (state.py)."""
    from megatron.core import parallel_state as ps

    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    shard = o.use_distributed_optimizer and dp_cp > 1
    if o.trainable and o.use_distributed_optimizer and not shard and dist.get_rank() == 0:
        log.info("parallel.use_distributed_optimizer: not used at data-parallel size 1 "
                 "(nothing to shard; Megatron's plain optimizer saves two copies of the model a step)")
    return shard


def key_source(names_the_metrics: bool) -> int:
    """Global rank of the reporting rank of DP replica 0 (it names the metrics): every rank
    calls it, the one rank for which `names_the_metrics` holds is the answer."""
    me = dist.get_rank() if names_the_metrics else -1
    t = torch.tensor([me], dtype=torch.long, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
