"""The rollback guard (`trainer.rollback`): when a watched metric collapses, go back to an earlier
checkpoint instead of training on from a broken policy.

    guard = RollbackGuard(cfg, ctx)
    hook = RollbackHook(guard, checkpointer, cfg, ctx, roles, loader=...)
    verdict = hook(step, metrics, run)   # rank 0's rules, broadcast: Rewind(to_step) on a trip

On a trip (rules: trainer/hooks/rollback_rules.py): log it and send `tracker.event("rollback")` (the
Prometheus rollback counter and tracking.alert_webhook); give up with a RollbackError (a non-zero
exit naming the metric) when trainer.rollback.max_rollbacks rollbacks were already made; else load
the newest checkpoint at or before `step - rollback_steps` (engines, RNGs, data position, KL
controller, task weights: the run is where it was then), optionally
  - scale the LR: the actor's and critic's schedules are multiplied by lr_scale ** rollbacks, kept
    in the checkpoint so a resumed run has the same LR;
  - skip the data: the sampler moves on to where it was at the tripping step, so the prompts of the
    undone steps are not trained on again;
then drop the undone steps' rows from the metrics file and remove their checkpoints (a step is
saved once: the steps are run again) and point `latest` at the checkpoint loaded. The load runs as
a save does, with the rollout engine asleep and the engines' parameters and optimizer states
resident (no gradient buffers); it leaves the rollout's weights stale, so the next generation
syncs the loaded weights (trainer/stages/rollout_weights.py). The guard's own state (rollbacks made, best
values, LR factor) is not rolled back.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from verl_hpc.checkpoint.publish import (LATEST, STEP_DIR, atomic_write_text, list_checkpoints, new_token,
                                         remove_checkpoint)
from verl_hpc.errors import VerlHpcError
from verl_hpc.runtime.objects import broadcast_object
from verl_hpc.trainer.hooks.base import CONTINUE, Rewind
from verl_hpc.trainer.hooks.rollback_rules import RollbackRules, Trip

log = logging.getLogger(__name__)


class RollbackError(VerlHpcError, RuntimeError):
    """trainer.rollback could not recover: no checkpoint to go back to, or too many rollbacks."""

    exit_code, kind = 18, "rollback"


class RollbackGuard:
    def __init__(self, cfg, ctx):
        self.rb, self.ctx = cfg.trainer.rollback, ctx
        self.rules = RollbackRules.from_config(self.rb)
        self.count = 0
        self.lr_factor = 1.0
        self.history: List[Dict] = []  # one entry per rollback: at, to, metric, rule, value

    def __bool__(self) -> bool:
        return bool(self.rb.enable)

    def decide(self, step: int, metrics: Mapping[str, float]) -> Optional[Trip]:
        """Rank 0's verdict on every rank (its metrics are the ones logged)."""
        trip = self.rules.check(step, metrics) if self.ctx.rank == 0 else None
        return broadcast_object(trip)

    def target(self, step: int, root: Path) -> Path:
        """The newest checkpoint at or before step - rollback_steps."""
        limit = step - self.rb.rollback_steps
        found = [p for p in list_checkpoints(root) if int(STEP_DIR.match(p.name).group(1)) <= limit]
        if not found:
            raise RollbackError(f"rollback guard: no checkpoint at or before step {limit} under {root} "
                                f"(trainer.rollback.rollback_steps={self.rb.rollback_steps}); nothing to roll back to")
        return max(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))

    def metrics(self) -> Dict[str, float]:
        return {"train/rollbacks": float(self.count), "train/lr_factor": self.lr_factor}

    def state_dict(self) -> Dict:
        return {"count": self.count, "lr_factor": self.lr_factor, "history": list(self.history),
                "rules": self.rules.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        self.count, self.lr_factor = int(state["count"]), float(state["lr_factor"])
        self.history = list(state.get("history", []))
        self.rules.load_state_dict(state["rules"])


def set_lr_factor(engine, optim_cfg, factor: float) -> None:
    """The engine's LR schedule at `factor` x the configured one (absolute, so applying it twice or
    after a load gives the same LR). Megatron's scheduler reads max_lr/min_lr from each param group
    when the group has them, so both the scheduler's and the groups' are set; step(0) applies it now."""
    sched = getattr(engine, "scheduler", None)
    if sched is None:
        return
    sched.max_lr, sched.min_lr = optim_cfg.lr * factor, optim_cfg.min_lr * factor
    for group in engine.optimizer.param_groups:
        base = group.setdefault("verl_hpc_base_lr", (group.get("max_lr", optim_cfg.lr),
                                                     group.get("min_lr", optim_cfg.min_lr)))
        group["max_lr"], group["min_lr"] = base[0] * factor, base[1] * factor
    sched.step(increment=0)


def apply_lr_factor(roles, cfg, factor: float) -> None:
    """The actor's and critic's LR schedules at `factor` x their configured ones."""
    for name in ("actor", "critic"):
        role = getattr(roles, name, None)
        if role is not None and getattr(role, "engine", None) is not None:
            set_lr_factor(role.engine, getattr(cfg, name).optim, factor)


def _drop_later_checkpoints(root: Path, step: int, keep: Path) -> List[str]:
    """Rank 0: remove the checkpoints of steps after `step`, point `latest` at `keep`."""
    token = new_token()
    gone = []
    for p in list_checkpoints(root):
        if int(STEP_DIR.match(p.name).group(1)) > step:
            remove_checkpoint(p, token)
            gone.append(p.name)
    atomic_write_text(root / LATEST, keep.name + "\n", token)
    return gone


class RollbackHook:
    """After the step's validation and task weights, before it is logged: a trip rewinds the run
    to an earlier checkpoint (the tripping step is neither logged nor saved); else the guard's
    counters join the step's metrics. Given what a rollback touches, not the trainer (the
    checkpointer puts the rollout to sleep for the load and marks its weights stale after it)."""
    stage = "rollback"

    def __init__(self, guard: RollbackGuard, checkpointer, cfg, ctx, roles, *, loader=None, task_weights=None):
        self.guard, self.ckpt, self.cfg, self.ctx, self.roles = guard, checkpointer, cfg, ctx, roles
        self.loader, self.task_weights = loader, task_weights

    def __call__(self, step, metrics, run):
        trip = self.guard.decide(step, metrics)
        if trip is None:
            metrics.update(self.guard.metrics())
            return CONTINUE
        to_step = self.roll_back(run.tracker, step, trip)
        run.summary["rollbacks"] = self.guard.history
        del run.summary.setdefault("history", [])[max(to_step - run.start, 0):]
        return Rewind(to_step)

    def roll_back(self, tracker, step: int, trip: Trip) -> int:
        """Undo the steps after the target checkpoint (see the module's docstring); returns its step.
        Collective: every rank calls it with the same trip."""
        guard, ckpt, ctx, rb, loader = self.guard, self.ckpt, self.ctx, self.cfg.trainer.rollback, self.loader
        log.warning("rollback guard: %s", trip.message)
        if guard.count >= rb.max_rollbacks:
            raise RollbackError(f"rollback guard: {trip.message}; giving up after {guard.count} rollback(s) "
                                f"(trainer.rollback.max_rollbacks={rb.max_rollbacks})")
        ckpt.close()  # an async save in flight is committed before we look for checkpoints
        path = guard.target(step, ckpt.root)
        to_step = int(STEP_DIR.match(path.name).group(1))
        guard.count += 1
        guard.history.append({"at": step, "to": to_step, "metric": trip.metric, "rule": trip.rule,
                              "value": trip.value})
        tracker.event("rollback", step, metric=trip.metric, rule=trip.rule, value=trip.value,
                      reference=trip.reference, to_step=to_step, rollbacks=guard.count, reason=trip.message)
        position = loader.state_dict() if rb.skip_data and loader is not None else None
        own = guard.state_dict()  # the guard's own state is not rolled back (the checkpoint holds an older one)
        ckpt.load(path)  # rollout asleep, params + optimizer resident; its weights stale afterwards
        guard.load_state_dict(own)
        if position is not None:  # the data of steps to_step+1..step is not trained on again
            loader.load_state_dict(position)
        if self.task_weights is not None and loader is not None:
            loader.set_task_weights(self.task_weights.weights)
        if rb.lr_scale != 1.0:
            guard.lr_factor *= rb.lr_scale
        apply_lr_factor(self.roles, self.cfg, guard.lr_factor)
        guard.rules.forget_after(to_step)
        tracker.truncate_from(to_step + 1)
        if ctx.rank == 0:
            gone = _drop_later_checkpoints(ckpt.root, to_step, path)
            log.warning("rollback guard: rollback %d of at most %d: step %d -> %s (removed %s), lr x%g%s",
                        guard.count, rb.max_rollbacks, step, path, ", ".join(gone) or "nothing", guard.lr_factor,
                        ", skipping the data of the undone steps" if position is not None else "")
        broadcast_object(None)  # a barrier: no rank saves before rank 0 has cleared the undone steps
        ckpt.last_saved = to_step
        return to_step
