"""Written with the code of f58ee29 (before the checkpointer took named objects): an RL and a DPO
checkpoint whose trainer_state carries loader, kl_ctrl, guard, task_weights and rollback by name."""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from verl_hpc.algorithms import make_kl_controller
from verl_hpc.checkpoint import ShardedTensor
from verl_hpc.checkpoint.trainer_state import FORMAT, PREFERENCE_FORMAT, TrainerCheckpointer
from verl_hpc.config import load_config
from verl_hpc.data.sampler import EpochSampler
from verl_hpc.engines.base import EngineState
from verl_hpc.trainer.guard import NonFiniteGuard
from verl_hpc.trainer.rollback import RollbackGuard
from verl_hpc.trainer.task_weights import TaskWeightScheduler


class Engine:
    optimizer = object()

    def __init__(self):
        self.w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7

    def state(self):
        return EngineState([ShardedTensor("model/w", self.w)], {"lr_step": 5})


out = Path(sys.argv[1])
ctx = SimpleNamespace(rank=0, world_size=1, generator=torch.Generator().manual_seed(3))
for name, fmt in (("rl_v1", FORMAT), ("dpo_v1", PREFERENCE_FORMAT)):
    cfg = load_config(None, [f"checkpoint.dir={out}/{name}", f"trainer.output_dir={out}/{name}_out",
                             "trainer.total_steps=4", "trainer.rollback.enable=true"])
    sampler = EpochSampler(10, seed=1, fingerprint="fp")
    sampler.next_indices(13)
    if fmt == FORMAT:
        kl = make_kl_controller("adaptive", 0.1, 0.5, 100)
        kl.value = 0.125
        guard = NonFiniteGuard(3)
        guard.in_a_row, guard.total = 1, 2
        tasks = TaskWeightScheduler({"easy": 1.0, "hard": 0.5}, schedule="none", metric="acc", patience=2,
                                    min_delta=0.0, saturation=0.95, decay=0.5, min_weight=0.1)
        rollback = RollbackGuard(cfg, ctx)
        rollback.count, rollback.lr_factor = 1, 0.5
        c = TrainerCheckpointer(cfg, ctx, SimpleNamespace(actor=SimpleNamespace(engine=Engine()), critic=None),
                                loader=sampler, kl_ctrl=kl, guard=guard, task_weights=tasks, rollback=rollback)
    else:
        c = TrainerCheckpointer(cfg, ctx, SimpleNamespace(actor=SimpleNamespace(engine=Engine()), critic=None),
                                loader=sampler, fmt=fmt)
    c.maybe_save(3, force=True)
