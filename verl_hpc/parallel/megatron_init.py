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
    cpu_patches: Tuple[cpu_compat.PatchRecord, ...]  # what cpu_compat replaced (empty on GPU)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_layout(world_size: int, tp: int, pp: int, cp: int = 1, vpp: Optional[int] = None) -> int:
    """The data-parallel size, or an error naming the fields when the layout cannot tile the world
    (the same rules the config validation applied before submission)."""
    return Layout(world_size, tp, pp, cp, vpp).require()


def current() -> ModelParallel:
    from megatron.core import parallel_state as ps

    return ModelParallel(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
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
                        seed: int = 1, timeout_minutes: int = 30) -> ModelParallel:
    """Create Megatron's groups over the existing default group, seed, apply CPU help.

    Re-initialising with the same sizes is a no-op; with other sizes, call
    `destroy_model_parallel()` first.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel needs torch.distributed: call "
                           "verl_hpc.runtime.bootstrap() first")
    check_layout(dist.get_world_size(), tp, pp, cp, vpp)
    if ps.model_parallel_is_initialized():
        have = current()
        if (have.tp, have.pp, have.cp, have.vpp) != (tp, pp, cp, vpp):
            raise RuntimeError(f"Megatron model parallel already initialised with tp={have.tp} "
                               f"pp={have.pp} cp={have.cp} vpp={have.vpp}; destroy it first")
        return have
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        # Megatron's extra gloo groups stay on (its default): get_megatron_optimizer expects them
        # unless told use_gloo_process_groups=False.
        distributed_timeout_minutes=timeout_minutes)
    if not has_gpu():
        cpu_compat.apply()  # before seeding: seeding fills the (CPU) RNG tracker it installs
    seed_model_parallel(seed)
    mp = current()
    log.info("megatron model parallel: tp=%d pp=%d dp=%d cp=%d (this rank tp %d, pp %d, dp %d)%s",
             mp.tp, mp.pp, mp.dp, mp.cp, mp.tp_rank, mp.pp_rank, mp.dp_rank,
             f", {len(mp.cpu_patches)} CPU replacements" if mp.cpu_patches else "")
    return mp


def init_from_config(parallel_cfg, seed: int = 1) -> ModelParallel:
    """`init_model_parallel` from the job config's `parallel` section."""
    return init_model_parallel(parallel_cfg.tp, parallel_cfg.pp, vpp=parallel_cfg.vpp, seed=seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
