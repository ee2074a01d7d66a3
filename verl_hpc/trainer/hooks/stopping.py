"""`trainer.stop_at`: ending an RL run early on purpose, the same way on every rank.

    rule = StopRule.from_config(cfg.trainer.stop_at, ctx)
    rule.start()                                      # the wall-time budget counts from here
    why = rule.check(step, metrics, step_seconds)     # None, or the plain reason to stop now

Two rules, either or both:
- a validation metric reaches a value (`metric`, `value`, `mode`): validation runs on every rank
  on the same global batch, so every rank reads the same number and decides alike;
- a wall-time budget (`wall_time_s`): the run stops after the last step that ends within it, i.e.
  when the time spent plus one more step (the last step's time) would pass the budget. Clocks of
  different ranks differ, so rank 0 decides and broadcasts (one tiny collective per step, only
  while a budget is set).
The trainer then checkpoints and returns normally (exit 0); this is not preemption: no requeue.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Mapping, Optional

from verl_hpc.trainer.hooks.base import CONTINUE, Stop

log = logging.getLogger(__name__)


class StopRule:
    def __init__(self, metric: str, value: Optional[float], mode: str, wall_time_s: float,
                 rank: int = 0, clock=time.monotonic):
        self.metric, self.value, self.mode = metric, value, mode
        self.wall_time_s, self.rank, self._clock = float(wall_time_s), rank, clock
        self._t0 = clock()

    @classmethod
    def from_config(cls, stop_at, ctx) -> "StopRule":
        return cls(stop_at.metric, stop_at.value, stop_at.mode, stop_at.wall_time_s, rank=ctx.rank)

    def __bool__(self) -> bool:
        return bool(self.metric) or self.wall_time_s > 0

    def start(self) -> None:
        self._t0 = self._clock()

    def check(self, step: int, metrics: Mapping[str, float], step_seconds: float) -> Optional[str]:
        """The reason to stop after `step`, or None. Collective when a wall-time budget is set."""
        if self.metric and self.metric in metrics:
            v = float(metrics[self.metric])
            hit = v >= self.value if self.mode == "max" else v <= self.value
            if hit and math.isfinite(v):
                op = ">=" if self.mode == "max" else "<="
                return f"{self.metric} = {v:.4g} {op} {self.value:g} (trainer.stop_at.metric)"
        if self.wall_time_s > 0:
            spent = self._clock() - self._t0
            over = _rank0_decides(spent + max(step_seconds, 0.0) > self.wall_time_s)
            if over:
                return (f"wall-time budget of {self.wall_time_s:g} s (trainer.stop_at.wall_time_s): "
                        f"{spent:.0f} s spent, another step of ~{step_seconds:.1f} s would pass it")
        return None


def _rank0_decides(flag: bool) -> bool:
    """Rank 0's flag on every rank (no-op without a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    from verl_hpc.runtime.device import collective_device

    t = torch.tensor([int(flag)], dtype=torch.int32, device=collective_device())
    dist.broadcast(t, src=0)
    return bool(t.item())


class StopHook:
    """trainer.stop_at after the step is logged and saved: a planned end checkpoints the step and
    finishes normally (exit 0, no requeue). Not asked at the last step: the run ends there anyway."""
    stage = None

    def __init__(self, rule: StopRule, checkpointer, rank: int, job: str):  # job: the log line's prefix
        self.rule, self.checkpointer, self.rank, self.job = rule, checkpointer, rank, job

    def __call__(self, step, metrics, run):
        if not self.rule or run.last(step):
            return CONTINUE
        why = self.rule.check(step, metrics, metrics["timing_s/step"])
        if not why:
            return CONTINUE
        if self.rank == 0:
            log.info("%s: stopping after step %d of %d: %s; saving a checkpoint",
                     self.job, step, run.total_steps, why)
        self.checkpointer.maybe_save(step, force=True)
        return Stop("stop_at", why)
