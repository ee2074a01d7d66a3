"""Megatron model parallelism over the rank runtime's process group, plus its CPU help.

    mp = init_model_parallel(tp=2, pp=2, seed=cfg.trainer.seed)   # after runtime.bootstrap()

`cpu_compat.apply()` runs inside `init_model_parallel` when there is no GPU.
"""
from verl_hpc.parallel.megatron_init import (
    ModelParallel,
    check_layout,
    current,
    destroy_model_parallel,
    init_from_config,
    init_model_parallel,
    seed_model_parallel,
)

__all__ = ["ModelParallel", "check_layout", "current", "destroy_model_parallel",
           "init_from_config", "init_model_parallel", "seed_model_parallel"]
