"""`--suggest`: layouts that fit with headroom, ranked by a rough step-time estimate.

Searched, for the same GPUs, on both training engines (the table names each layout's):
- Megatron: training tp (within a node) x pp x vpp, recompute none/selective/full;
- FSDP: the shard size (every divisor of the training ranks; below them HSDP replicas), and
  activation checkpointing off/on;
each with offload of the idle roles off/on and the micro-batch token budget (x0.5, x1, x2). A
model the Megatron mapping does not cover gets FSDP layouts only. The step time is
  compute: (rollout 2*P*R at the decode MFU) + (forward passes 2*P*T and updates 6*P*T, 8*P*T with
           full recompute, at the training MFU, the update stretched by the pipeline bubble
           (p - 1) / (m * v)), over all GPUs;
  comms:   tensor-parallel all-reduces (4 per layer per token pass, ring 2(t-1)/t) over NVLink,
           the distributed optimizer's reduce-scatter + all-gather over the inter-node links,
           the weight sync, and host<->GPU copies of offloaded states (twice per role per step).
P = parameters, T = tokens per step, R = generated tokens. An FSDP layout has no TP traffic; its
shard group all-gathers the weights in the compute dtype for every micro-batch's forward (and again
for its backward, with reshard_after_forward) and reduce-scatters the fp32 gradients of every
micro-batch (over NVLink when the shard group fits in a node), and HSDP all-reduces each shard's
gradients across the replicas once per micro-batch (inter-node). Every constant is printed with the
ranking.
A ranking aid, not a prediction: it orders layouts the way their costs scale.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from typing import Dict, List, Optional

from verl_hpc.config.errors import ConfigError
from verl_hpc.planning import hardware
from verl_hpc.planning.fsdp import compute_bytes, replicas, shard_size
from verl_hpc.config.sections.fsdp import MEGATRON
from verl_hpc.planning.model_shape import fsdp_arch, model_arch, role_engine, total_params
from verl_hpc.planning.phases import microbatch_shape, plan_job
from verl_hpc.planning.report import MARGIN, gib
from verl_hpc.planning.training import RECOMPUTE_GRANULARITIES

ROLES_WITH_OFFLOAD = (("actor", ("param_offload", "grad_offload", "optimizer_offload")),
                      ("critic", ("param_offload", "grad_offload", "optimizer_offload")),
                      ("ref", ("param_offload",)),
                      ("prm", ("param_offload", "grad_offload", "optimizer_offload")))


@dataclasses.dataclass
class Candidate:
    tp: int
    pp: int
    vpp: Optional[int]
    recompute: str  # Megatron: none | selective | full; FSDP: none | full (activation checkpointing)
    offload: bool
    token_budget: int
    peak: float
    headroom: float
    step_seconds: float
    engine: str = MEGATRON
    shard: int = 0  # FSDP: fsdp.shard_size (0 = every training rank)
    job_engine: str = MEGATRON  # the config's parallel.engine (the overrides name another one)
    job_offloads: bool = False  # the config offloads some idle role (the overrides switch it off)
    teacher: bool = False  # the job has a distillation teacher: its param_offload is switched with the others

    def overrides(self) -> str:
        o = [] if self.engine == self.job_engine else [f"parallel.engine={self.engine}"]
        if self.engine == "fsdp":
            o += ["parallel.tp=1", "parallel.pp=1", "parallel.vpp=null", "parallel.sequence_parallel=false",
                  f"fsdp.shard_size={self.shard}",
                  f"fsdp.activation_checkpointing={'true' if self.recompute == 'full' else 'false'}"]
        else:
            o += [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                  f"parallel.vpp={self.vpp if self.vpp else 'null'}",
                  f"parallel.recompute_granularity={self.recompute}"]
        o += [f"actor.max_tokens_per_microbatch={self.token_budget}",
             f"critic.max_tokens_per_microbatch={self.token_budget}",
             f"prm.max_tokens_per_microbatch={self.token_budget}"]
        if self.offload or self.job_offloads:  # stated where the job's config says otherwise
            o += [f"{r}.{f}={'true' if self.offload else 'false'}" for r, fs in _offload_roles(self.teacher)
                  for f in fs]
        return " ".join(o)


def _offload_roles(teacher: bool):
    """The roles whose offload switches a candidate sets: the teacher's only where the job has one."""
    return ROLES_WITH_OFFLOAD + ((("teacher", ("param_offload",)),) if teacher else ())


def _has_teacher(cfg) -> bool:
    return cfg.trainer.job == "rl" and bool(cfg.teacher.enable)


def _apply(cfg, tp, pp, vpp, recompute, offload, budget, engine=MEGATRON, shard=0):
    c = copy.deepcopy(cfg)
    c.parallel.engine = engine
    c.parallel.tp, c.parallel.pp, c.parallel.vpp = tp, pp, vpp
    c.parallel.sequence_parallel = tp > 1 and cfg.parallel.sequence_parallel
    if engine == "fsdp":
        c.parallel.recompute_granularity = "none"
        c.fsdp.shard_size, c.fsdp.activation_checkpointing = shard, recompute == "full"
    else:
        c.parallel.recompute_granularity = recompute
    c.parallel.recompute_method, c.parallel.recompute_num_layers = "uniform", 1
    c.actor.max_tokens_per_microbatch = c.critic.max_tokens_per_microbatch = c.prm.max_tokens_per_microbatch = budget
    for role, fields in _offload_roles(_has_teacher(cfg)):
        for f in fields:
            setattr(getattr(c, role), f, offload)
    return c


def step_time_parts(cfg, gpu: hardware.GPUType) -> Dict[str, float]:
    """Seconds of one step by part (the module's model): rollout on the rollout ranks; forwards,
    updates, tp_comms (all proportional to the step's tokens), dp_comms and offload on the training
    ranks; weight_sync between them. The two groups are the whole world unless placement is split,
    so that benchmarks/bench_async.py can time each group of a split job on its own GPUs."""
    fsdp = role_engine(cfg, cfg.model.path) == "fsdp"
    arch = fsdp_arch(cfg.model.path) if fsdp else model_arch(cfg.model.path)
    p_total = total_params(arch)
    tp, pp, dp = cfg.parallel.tp, cfg.parallel.pp, max(1, cfg.dp)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    rows = cfg.data.train_batch_size * cfg.rollout.n
    tokens, generated = rows * seq, rows * cfg.data.max_response_length
    train_flops = gpu.bf16_tflops * 1e12 * cfg.train_world_size
    rollout_flops = gpu.bf16_tflops * 1e12 * cfg.rollout_world_size
    prm = cfg.trainer.job == "rl" and bool(cfg.prm.enable)
    prm_trains = prm and cfg.prm.update != "none"
    roles = 1 + int(bool(cfg.critic.enable)) + int(prm_trains)  # trained roles
    # forwards: old log-probs, reference, values; the PRM's before its update and, with
    # prm.update = before, again after it
    forwards = (1 + int(bool(cfg.ref.enable)) + int(bool(cfg.critic.enable))
                + int(prm) + int(prm_trains and cfg.prm.update == "before"))
    # on-policy distillation: each teacher's forward over its rows, every row once (its own size)
    teacher_params = (sum(total_params(model_arch(f, field="teacher.model_path"))
                          for f in dict.fromkeys(cfg.teacher.folders().values()))
                      if cfg.trainer.job == "rl" and cfg.teacher.enable else 0)
    recompute = cfg.fsdp.activation_checkpointing if fsdp else cfg.parallel.recompute_granularity == "full"
    train_factor = 8 if recompute else 6
    _, _, m = microbatch_shape(cfg.actor, cfg)
    bubble = 1 + (pp - 1) / (m * (cfg.parallel.vpp or 1)) if pp > 1 else 1.0
    e = 2 if cfg.model.dtype != "float32" else 4
    tp_link = gpu.nvlink_gbps if tp <= max(1, cfg.slurm.gpus_per_node) else hardware.INTER_NODE_GBPS
    passes = forwards + roles * 3
    tp_bytes = 0.0 if tp == 1 else (4 * 2 * (tp - 1) / tp * (tokens / dp) * arch.hidden_size * e
                                    * arch.num_layers / pp / 2 * passes)
    per_rank = p_total / (tp * pp)
    dp_bytes = 0.0 if dp == 1 else roles * 2 * (dp - 1) / dp * per_rank * (4 + e)
    sync_bytes = p_total * e / max(1, cfg.rollout.tp)
    offload_bytes = 0.0
    if cfg.actor.param_offload:
        offload_bytes = 2 * roles * per_rank * (e + 4 + 12 / dp) + 2 * per_rank * e
    if fsdp:  # ZeRO-3 traffic per micro-batch instead of TP and DDP's (module docstring)
        _, b, _ = microbatch_shape(cfg.actor, cfg)
        per_pass = -(-rows // (dp * b))  # micro-batches of one pass over the step's rows, per rank
        tp_bytes, dp_bytes, offload_bytes = _fsdp_comm_bytes(cfg, p_total, forwards,
                                                             roles * cfg.actor.ppo_epochs, per_pass)
        tp_link = gpu.nvlink_gbps if shard_size(cfg) <= max(1, cfg.slurm.gpus_per_node) else hardware.INTER_NODE_GBPS
    return {
        "rollout": 2 * p_total * generated / (rollout_flops * hardware.ASSUMED_DECODE_MFU),
        "forwards": (forwards * p_total + teacher_params) * 2 * tokens / (train_flops * hardware.ASSUMED_TRAIN_MFU),
        "updates": roles * train_factor * p_total * tokens * bubble / (train_flops * hardware.ASSUMED_TRAIN_MFU),
        "tp_comms": tp_bytes / (tp_link * 1e9),
        "dp_comms": dp_bytes / (hardware.INTER_NODE_GBPS * 1e9),
        "weight_sync": sync_bytes / (hardware.INTER_NODE_GBPS * 1e9),
        "offload": offload_bytes / (hardware.PCIE_GBPS * 1e9),
    }


def _fsdp_comm_bytes(cfg, p_total: int, forwards: int, updates: int, m: int):
    """(shard-group bytes, replicate-group bytes, offload bytes) one rank moves per step on the
    FSDP engine, m micro-batches per pass over the step's rows: all-gathers of the compute-dtype
    weights per micro-batch forward (twice in an update with reshard_after_forward), reduce-scatters
    of the fp32 gradients, HSDP's all-reduce; `updates` passes that train."""
    roles = updates
    s, r, c = shard_size(cfg), replicas(cfg), compute_bytes(cfg)
    gathers = 2 if cfg.fsdp.reshard_after_forward else 1
    ring = (s - 1) / s
    shard_bytes = ring * p_total * (c * m * (forwards + roles * gathers) + 4 * m * roles)
    replicate_bytes = 2 * (r - 1) / r * p_total / s * 4 * m * roles if r > 1 else 0.0
    offload = 0.0
    if cfg.actor.param_offload:  # weights and Adam's shards out and back, twice per trained role
        offload = 2 * roles * p_total / s * 12 + 2 * p_total / s * 4
    return shard_bytes, replicate_bytes, offload


def step_seconds(cfg, gpu: hardware.GPUType) -> float:
    """The parts run one after the other: a colocated step."""
    return sum(step_time_parts(cfg, gpu).values())


def _divisors(n: int, cap: int) -> List[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def plan_or_refusal(c, *, gpu_memory_gb=None, node_memory_gb=None):
    """(plan, None) for a candidate config, or (None, the ConfigError) where a rule refuses it (a
    layout the model cannot split, a sequence beyond the model's positions): how --suggest and
    --longest judge a candidate."""
    try:
        return plan_job(c, gpu_memory_gb=gpu_memory_gb, node_memory_gb=node_memory_gb), None
    except ConfigError as err:
        return None, err


def suggest(cfg, *, gpu_memory_gb=None, node_memory_gb=None, margin: float = MARGIN,
            time_limit_s: float = 8.0) -> List[Candidate]:
    gpu = hardware.gpu_type(cfg.slurm.gpu_type) or hardware.GPUS["h100-80gb"]
    # the layouts tile the training ranks (all of them unless placement.mode = split)
    world, per_node = cfg.train_world_size, max(1, cfg.slurm.gpus_per_node or cfg.slurm.tasks_per_node)
    base = cfg.actor.max_tokens_per_microbatch or (cfg.actor.micro_batch_size * (
        cfg.data.max_prompt_length + cfg.data.max_response_length))
    layouts = []  # (engine, tp, pp, vpp, recompute, shard); each engine's search gets half the time
    for shard in sorted(_divisors(world, world), reverse=True):
        layouts += [("fsdp", 1, 1, None, rc, 0 if shard == world else shard) for rc in ("none", "full")]
    try:
        arch = model_arch(cfg.model.path)  # the Megatron mapping's shape: none, no Megatron layouts
    except ConfigError:
        arch = None
    tps = [t for t in _divisors(per_node, per_node) if arch and arch.num_attention_heads % t == 0
           and arch.num_query_groups % t == 0 and arch.ffn_hidden_size % t == 0]
    for tp, pp in itertools.product(tps, _divisors(arch.num_layers, 16) if arch else []):
        if world % (tp * pp) == 0:
            vpps = [None] + [v for v in (2, 4, 5) if pp > 1 and arch.num_layers % (pp * v) == 0][:1]
            layouts += [("megatron", tp, pp, vpp, rc, 0)
                        for vpp, rc in itertools.product(vpps, RECOMPUTE_GRANULARITIES)]
    out: List[Candidate] = []
    spent = {"fsdp": 0.0, "megatron": 0.0}
    job_offloads = any(getattr(getattr(cfg, r), f) for r, fs in _offload_roles(_has_teacher(cfg)) for f in fs)
    for engine, tp, pp, vpp, rc, shard in layouts:
        for off, scale in itertools.product((False, True), (0.5, 1, 2)):
            if spent[engine] > time_limit_s / 2:
                break
            t0 = time.monotonic()
            budget = int(base * scale)
            c = _apply(cfg, tp, pp, vpp, rc, off, budget, engine, shard)
            plan, _ = plan_or_refusal(c, gpu_memory_gb=gpu_memory_gb, node_memory_gb=node_memory_gb)
            h = plan.headroom() if plan is not None else None
            if h is not None and h >= margin:
                out.append(Candidate(tp, pp, vpp, rc, off, budget, plan.checked_peak(), h,
                                     step_seconds(c, gpu), engine, shard, cfg.parallel.engine,
                                     job_offloads, _has_teacher(cfg)))
            spent[engine] += time.monotonic() - t0
    return sorted(out, key=lambda c: c.step_seconds)


def print_suggestions(cands: List[Candidate], top: int = 8) -> None:
    print("assumptions for the step time: " + "; ".join(
        f"{k} = {v}" for k, v in hardware.time_assumptions().items()))
    if not cands:
        print(f"--suggest: no searched layout fits with {MARGIN:.0%} headroom")
        return
    print(f"--suggest: {len(cands)} layouts fit with >= {MARGIN:.0%} headroom; fastest first "
          f"(estimated seconds per step, relative to the first):")
    best = cands[0].step_seconds
    shown = cands[:top]
    # each engine's fastest layout is shown, below the others when it is not among them
    shown += [next(c for c in cands if c.engine == e) for e in ("megatron", "fsdp")
              if any(c.engine == e for c in cands) and not any(c.engine == e for c in shown)]
    for c in shown:
        print(f"  x{c.step_seconds / best:4.2f}  {c.engine:<8}  peak {gib(c.peak):>6} GiB  headroom {c.headroom:4.0%}  "
              f"{c.overrides()}")
