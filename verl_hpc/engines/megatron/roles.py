"""`build_role(role, options, ...)`: a role of the RL step (verl_hpc/engines/roles.py) on a
`MegatronEngine`, initialising Megatron's model parallelism first if nobody has."""
from __future__ import annotations

import torch.distributed as dist

from verl_hpc.engines.megatron.engine import MegatronEngine
from verl_hpc.engines.options import EngineOptions
from verl_hpc.engines.roles import wrap_role
from verl_hpc.parallel import init_from_config


def build_role(role: str, options: EngineOptions, *, parallel, seed: int, timeout_s: float,
               role_cfg=None, n: int = 1):
    """The role object for `role` in {actor, critic, ref, reward, prm} on an engine built with
    `options`; initialises Megatron model parallelism from the parallel section if nobody has yet
    (collective: call on every rank), seeded with `seed` (trainer.seed) and its groups bounded by
    `timeout_s` (trainer.collective_timeout_s). The rank runtime (verl_hpc.runtime.bootstrap) must
    exist: the engine lives on its default process group. role_cfg: a trained role's section
    (actor, critic, prm: its mini-batches and epochs); n: rollout.n."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("build_engine needs the rank runtime: call verl_hpc.runtime.bootstrap()")
    if not ps.model_parallel_is_initialized():
        init_from_config(parallel, seed=seed, timeout_s=timeout_s)
    return wrap_role(role, MegatronEngine(options), role_cfg, n=n)
