"""Colocated placement (placement.mode = colocated): generation and training on the same ranks
(the Placement interface: verl_hpc/trainer/placement/__init__.py)."""
from __future__ import annotations

import contextlib
from typing import Callable, Dict


class Colocated:
    """Generation and training on the same ranks."""

    builds_rollout = True  # build_roles builds the rollout engine on these ranks
    source = None  # StepSampler generates here

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx

    def run_rank(self, train: Callable[[], dict]) -> dict:
        return train()

    def attach(self, roles, steps_done: Callable[[], int]) -> None:
        """Nothing to replace: roles.rollout is the local engine."""

    def loader(self, make_loader: Callable[[], object]):
        return make_loader() if self.ctx.rank == 0 else None  # rank 0 samples and broadcasts

    def weights(self, actor, roles, make_sync):
        from verl_hpc.rollout.recovery import EngineRecovery
        from verl_hpc.trainer.stages.rollout_weights import RolloutWeights

        r = self.cfg.rollout  # a failed engine is rebuilt and resynced (rollout/recovery.py)
        weights = RolloutWeights(actor, roles.rollout, make_sync(),
                                 EngineRecovery(r.max_engine_restarts, r.max_engine_restarts_per_step))
        roles.verify = weights.check_generated  # LoRA adapter sync: the generation used the update
        return weights

    def checkpoint_state(self, loader):
        return loader

    def session(self, roles):
        return contextlib.nullcontext()

    def start(self, step: int) -> None:
        pass

    def timed_metrics(self, metrics: Dict[str, float]) -> None:
        pass

    def summary(self) -> Dict:
        return {}
