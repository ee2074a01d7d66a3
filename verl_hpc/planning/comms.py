"""NCCL communicators one rank holds on a GPU job, and their device bytes.

Why count them: the bootstrap passes `device_id` to `init_process_group`, so torch creates every
NCCL group's communicator when the group is made (eager init, by `ncclCommSplit` of the world's),
not at its first collective. Megatron makes a fixed set of groups whatever the model needs, and
vLLM (in-process, `external_launcher`) makes its own over the same default group; each one this
rank belongs to holds device memory until the process ends (vLLM's sleep does not release NCCL
buffers either: they live outside its allocator pool).

The list below mirrors megatron-core 0.16.1's `parallel_state.initialize_model_parallel` with this
project's call (parallel.cp, one distributed-optimizer instance, no all-gather group; a dense
model has ep = 1 and expert TP = TP); tests/unit/planning/test_plan_phases.py runs Megatron's own
function with a recording `new_group` and checks the sizes. Gloo twins hold host memory only (not counted).

A communicator is "in use" when the RL step runs collectives on it (then NCCL connects its channel
buffers: hardware.NCCL_COMM_BYTES); the others stay as created (hardware.NCCL_IDLE_COMM_BYTES).
Point-to-point sends of the pipeline schedule reuse the PP group's communicator under eager init
(no extra pair communicators). vLLM's own communicators are made during its start-up, and its
memory profile may count them inside `gpu_memory_utilization`: the startup and rollout rows may
then count them twice (an upper bound); in every other row they are outside vLLM's (released)
budget.
"""
from __future__ import annotations

import dataclasses
from typing import List

from verl_hpc.planning import hardware


@dataclasses.dataclass(frozen=True)
class Communicator:
    name: str
    size: int  # ranks in the group
    in_use: bool  # the step runs collectives on it

    @property
    def device_bytes(self) -> float:
        if self.size < 2:  # a 1-rank group moves nothing: no channels, no peers
            return 0.0
        return float(hardware.NCCL_COMM_BYTES if self.in_use else hardware.NCCL_IDLE_COMM_BYTES)


def megatron_groups(world: int, tp: int, pp: int, *, distributed_optimizer: bool,
                    tied_embeddings: bool, ep: int = 1, etp: int = 0, moe: bool = False,
                    cp: int = 1) -> List[Communicator]:
    """Megatron's NCCL groups of a first- or last-stage rank. Context parallelism (cp > 1) runs
    the attention's ring exchange over cp and the per-token results' gather there, and DDP's
    gradients over dp x cp. A mixture-of-experts model
    (`moe`) also uses its expert groups: the dispatcher's all-to-all over ep and its token-count
    gather over tp_ep (expert TP x EP), the experts' TP layers over expert_tp, and their gradients
    and optimizer gathers over expert_dp. etp 0: tp."""
    dp = world // (tp * cp * pp)
    etp = etp or tp
    edp = max(1, tp * cp * dp // (ep * etp))
    c = Communicator
    return [
        c("dp_cp", dp * cp, True),  # DDP's gradient reduce-scatter, the distributed optimizer's gathers
        c("dp", dp, False),
        c("cp", cp, cp > 1),
        c("mp", tp * pp, not distributed_optimizer),  # grad-norm reduction without the dist. optimizer
        c("tp", tp, True),  # tensor-parallel layers, the weight sync's gather
        c("pp", pp, True),  # the pipeline schedule's sends, the weight sync's broadcast
        c("embedding", 2 if pp > 1 else 1, tied_embeddings),  # first + last stage: tied grads
        c("position_embedding", 1, False),
        c("tp_dp_cp", tp * dp * cp, False),
        c("tp_dp", tp * dp, False),
        c("tp_cp", tp * cp, False),
        c("ep", ep, moe),
        c("expert_tp", etp, moe),
        c("tp_ep", etp * ep, moe),
        c("tp_ep_pp", etp * ep * pp, False),
        c("expert_dp", edp, moe),
        c("intra_dist_opt", world, distributed_optimizer),  # grad-norm reduction with it
    ]


def vllm_groups(world: int, rollout_tp: int) -> List[Communicator]:
    """vLLM 0.32's NCCL groups of one rank (dense model, external_launcher, no vLLM DP/PP): its
    world group (a device group, no device communicator), the TP group's torch device group, and
    the TP group's PyNccl communicator that runs its all-reduces and gathers."""
    return [Communicator("vllm_world", world, False),
            Communicator("vllm_tp", rollout_tp, False),
            Communicator("vllm_tp_pynccl", rollout_tp, True)]


def fsdp_groups(cfg, engines) -> List[Communicator]:
    """The FSDP engine's groups of one rank: each FSDP role builds its own DeviceMesh. Plain FSDP
    (one mesh dimension over every rank) runs on the default group; HSDP's (replicate, shard) mesh
    makes a shard group (all-gathers, reduce-scatters) and a replicate group (the trained roles'
    gradient all-reduce) per role."""
    from verl_hpc.planning.fsdp import replicas, shard_size

    shard, reps = shard_size(cfg), replicas(cfg)
    if reps == 1:
        return []
    out = []
    for name, (engine, trained) in engines.items():
        if engine == "fsdp":
            out += [Communicator(f"{name}_fsdp_shard", shard, True),
                    Communicator(f"{name}_fsdp_replicate", reps, trained)]
    return out


def job_communicators(cfg, tied_embeddings: bool, group: str = "colocated", moe: bool = False,
                      engines=None) -> List[Communicator]:
    """Every NCCL communicator a rank of this job holds (empty for a CPU job: gloo only).

    group (placement.mode = split): "training" or "rollout". Each group's ranks have a default
    group of their own (Megatron's groups are carved out of the training ranks', vLLM's world is
    the rollout ranks'), and the weights reach the rollout ranks over a group of every rollout rank
    and the first training rank; the training rank counted is that one, the heaviest.
    engines: role -> (megatron | fsdp, trains) (None: every role on Megatron); Megatron's groups
    are made only when a role runs on Megatron, the FSDP roles' meshes add theirs (fsdp_groups)."""
    if cfg.slurm.gpus_per_node <= 0:
        return []
    par = cfg.parallel
    world = {"training": cfg.train_world_size, "rollout": cfg.rollout_world_size}.get(group, cfg.world_size)
    tied = tied_embeddings and par.pp > 1
    out = [Communicator("world", world, True)]  # the trainer's broadcasts and reductions
    megatron = engines is None or any(e == "megatron" for e, _ in engines.values())
    if group != "rollout" and engines:
        out += fsdp_groups(cfg, engines)
    if group != "rollout" and megatron:
        out += megatron_groups(world, par.tp, par.pp, distributed_optimizer=par.use_distributed_optimizer,
                               tied_embeddings=tied, ep=par.ep, etp=par.etp or 0, moe=moe, cp=par.cp)
    if group != "training" and cfg.trainer.job == "rl" and cfg.rollout.engine != "hf":  # auto: vLLM on a GPU
        out += vllm_groups(world, cfg.rollout.tp)
    if group != "colocated":
        out.append(Communicator("weights", cfg.rollout_world_size + 1, True))
    return out


def nccl_bytes(comms: List[Communicator]) -> float:
    return sum(c.device_bytes for c in comms)


def describe(comms: List[Communicator]) -> str:
    used = [c for c in comms if c.size > 1 and c.in_use]
    idle = [c for c in comms if c.size > 1 and not c.in_use]
    return (f"NCCL communicators per rank: {len(used)} in use ({', '.join(c.name for c in used)}), "
            f"{len(idle)} created and idle")
