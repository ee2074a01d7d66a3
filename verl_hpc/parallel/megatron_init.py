"""Megatron model parallelism on top of the rank runtime's torch.distributed world.

`runtime.bootstrap()` owns the default process group (gloo on CPU, NCCL on GPU); this module
only carves Megatron's tensor/pipeline/data/context groups out of it, seeds Megatron's RNG
streams, and applies the CPU help where there is no GPU. Every rank must call it alike: group
creation is collective.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from verl_hpc.config.layout import Layout
from verl_hpc.parallel import cpu_compat
from verl_hpc.runtime.device import has_gpu

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelParallel:
    """This rank's place in the Megatron layout."""

    tp: int
    pp: int
    dp: int
    cp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    vpp: Optional[int]
    ep: int
    etp: int
    ep_rank: int
    etp_rank: int
    cpu_patches: Tuple[cpu_compat.PatchRecord, ...]  # what cpu_compat replaced (empty on GPU)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_layout(world_size: int, tp: int, pp: int, cp: int = 1, vpp: Optional[int] = None,
                 ep: int = 1, etp: Optional[int] = None) -> int:
    """The data-parallel size, or an error naming the fields when the layout cannot tile the world
    (the same rules the config validation applied before submission)."""
    return Layout(world_size, tp, pp, cp, vpp, ep=ep, etp=etp).require()


def current() -> ModelParallel:
    from megatron.core import parallel_state as ps

    return ModelParallel(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        cpu_patches=cpu_compat.applied())


def seed_model_parallel(seed: int) -> None:
    """Seed Megatron's RNG streams the way Megatron-LM's trainer does.

    The default stream gets `seed + 100 * pp_rank`: equal on the TP ranks of a stage (dropout in
    replicated regions must agree across them) and on DP replicas (identical initialisation).
    Megatron's tracker then derives the tensor-parallel stream (different per TP rank) and the
    expert stream. On CPU the default stream is torch's global CPU generator, so this reseeds it;
    the trainer's private generator from `runtime.bootstrap` is untouched.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    # On CPU cpu_compat has installed a CPU tracker that this call fills (torch.cuda.manual_seed
    # in it is a lazy no-op on a CPU build).
    model_parallel_cuda_manual_seed(stage_seed)


def init_model_parallel(tp: int = 1, pp: int = 1, *, vpp: Optional[int] = None, cp: int = 1,
                        ep: int = 1, etp: Optional[int] = None,
                        seed: int = 1, timeout_minutes: float = 30) -> ModelParallel:
    """Create Megatron's groups over the existing default group, seed, apply CPU help.

    `timeout_minutes` bounds every collective on Megatron's groups (TP, PP, DP, ... and their gloo
    twins); megatron-core 0.16.1 turns it into `timedelta(minutes=...)` for each `new_group`, so a
    fraction of a minute is kept exactly. (0.16.1 leaves it off one group, the expert-data-parallel
    gloo twin, which dense models never use.)

    `ep` / `etp`: expert (tensor) parallel sizes for mixture-of-experts models (etp None = tp);
    Megatron regroups each stage's tp x cp x dp ranks as etp x ep x edp (config/layout.py).

    Re-initialising with the same sizes is a no-op; with other sizes, call
    `destroy_model_parallel()` first.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel needs torch.distributed: call "
                           "verl_hpc.runtime.bootstrap() first")
    etp = tp if etp is None else etp
    check_layout(dist.get_world_size(), tp, pp, cp, vpp, ep, etp)
    if ps.model_parallel_is_initialized():
        have = current()
        if (have.tp, have.pp, have.cp, have.vpp, have.ep, have.etp) != (tp, pp, cp, vpp, ep, etp):
            raise RuntimeError(f"Megatron model parallel already initialised with tp={have.tp} "
                               f"pp={have.pp} cp={have.cp} vpp={have.vpp} ep={have.ep} etp={have.etp}; "
                               "destroy it first")
        return have
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        # Megatron's extra gloo groups stay on (its default): get_megatron_optimizer expects them
        # unless told use_gloo_process_groups=False.
        distributed_timeout_minutes=timeout_minutes)
    if not has_gpu():
        cpu_compat.apply()  # before seeding: seeding fills the (CPU) RNG tracker it installs
    seed_model_parallel(seed)
    mp = current()
    log.info("megatron model parallel: tp=%d pp=%d dp=%d cp=%d ep=%d etp=%d (this rank tp %d, pp %d, "
             "dp %d, ep %d)%s", mp.tp, mp.pp, mp.dp, mp.cp, mp.ep, mp.etp, mp.tp_rank, mp.pp_rank,
             mp.dp_rank, mp.ep_rank,
             f", {len(mp.cpu_patches)} CPU replacements" if mp.cpu_patches else "")
    from verl_hpc.parallel.placement import log_placement

    _name_groups()

    log_placement()  # which nodes each TP/DP group landed on (collective, once per job)
    return mp


def _name_groups() -> None:
    """Names for Megatron's groups in collective errors and counts (runtime/collectives.py).
    Where two names are one group (dp and dp_cp when cp=1), the later, plainer name wins."""
    from megatron.core import parallel_state as ps

    from verl_hpc.runtime.collectives import name_group

    cp1 = ps.get_context_parallel_world_size() == 1  # then DDP's dp_cp group is the DP group
    getters = [("mp", ps.get_model_parallel_group), ("cp", ps.get_context_parallel_group),
               ("dp" if cp1 else "dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
               ("dp_gloo", ps.get_data_parallel_group_gloo), ("pp", ps.get_pipeline_model_parallel_group),
               ("dp", ps.get_data_parallel_group), ("tp", ps.get_tensor_model_parallel_group)]
    if ps.get_expert_model_parallel_world_size() > 1:  # the groups only exist as such for MoE
        getters += [("ep", ps.get_expert_model_parallel_group),
                    ("edp", ps.get_expert_data_parallel_group)]
    for name, get in getters:
        try:
            name_group(get(), name)
        except (AssertionError, RuntimeError, AttributeError):  # not built in this layout
            pass


def init_from_config(parallel_cfg, seed: int = 1, timeout_s: Optional[float] = None) -> ModelParallel:
    """`init_model_parallel` from the job config's `parallel` section; `timeout_s`
    (trainer.collective_timeout_s) bounds Megatron's groups like the default group (None: 30 min,
    Megatron's default)."""
    minutes = 30 if timeout_s is None else timeout_s / 60.0
    return init_model_parallel(parallel_cfg.tp, parallel_cfg.pp, vpp=parallel_cfg.vpp, cp=parallel_cfg.cp,
                               ep=parallel_cfg.ep, etp=parallel_cfg.etp,
                               seed=seed, timeout_minutes=minutes)


def destroy_model_parallel() -> None:
    """Megatron's destroy_model_parallel, and the references to its groups it leaves behind, so that
    the groups really go (each gloo group keeps threads that wake 100 times a second, and its
    store, for as long as anything holds it): megatron-core 0.16 keeps two of its globals
    (`_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` and its gloo twin) and every RotaryEmbedding
    module its forward's cache has seen (the module holds the context-parallel group). Matters
    where one process builds layouts one after another (the tests' in-process jobs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    ps.destroy_model_parallel()
    for name, value in list(vars(ps).items()):
        if name.isupper() and isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
