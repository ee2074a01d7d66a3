"""Task weights that adapt (`data.task_weights`), and the per-task metrics they watch.

    sched = TaskWeightScheduler.from_config(cfg.data)          # None without data.tasks
    m.update(task_metrics(scores, lengths, extras))             # task/<name>/{reward,acc,response_length,share}
    m.update(sched.observe(step, metrics))                      # task/<name>/weight, every step

schedule=plateau: each task's watched metric (data.task_weights.metric: the training batch's
reward/acc every step, or val_reward/val_acc at each validation) is observed. A task is saturated
after `patience` observations in a row at or above `saturation`, plateaued after `patience`
observations without beating its best by `min_delta`. Either lowers its weight (x `decay`, never
below `min_weight`), at most once per `patience` observations. What it gives up is split evenly
over the laggards: for a saturated task every task below saturation (a task stuck at zero has the
most to learn), for a plateaued one only the tasks below saturation that improved within their
last `patience` observations (giving a stuck task's share to another stuck task would only move
weight back and forth). With nobody to take it, the weights stay. Their sum never changes.

Every rank computes the same weights from the same metrics (rewards are scored on every rank);
rank 0's loader draws with them. The state is plain floats and ints, saved in the checkpoint's
trainer_state and restored on resume, so a resumed run draws exactly what the straight one drew.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, Mapping, Optional, Sequence

import torch

from verl_hpc.data.errors import DataError
from verl_hpc.data.tasks import task_of
from verl_hpc.trainer.hooks.base import CONTINUE

METRIC_KEYS = {"reward": "task/{}/reward", "acc": "task/{}/acc",
               "val_reward": "val/task/{}/reward", "val_acc": "val/task/{}/acc"}


def task_metrics(scores: torch.Tensor, lengths: torch.Tensor, extras: Sequence[Mapping],
                 prefix: str = "task") -> Dict[str, float]:
    """Per task of a scored batch: mean reward, accuracy (score >= 1), mean response length and
    share of the batch. Rows without a task (no data.tasks) give nothing."""
    rows = defaultdict(list)
    for i, extra in enumerate(extras):
        name = task_of(extra)
        if name:
            rows[name].append(i)
    out: Dict[str, float] = {}
    n = len(extras)
    for name, idx in sorted(rows.items()):
        s, ln = scores[idx].float(), lengths[idx].float()
        out[f"{prefix}/{name}/reward"] = float(s.mean())
        out[f"{prefix}/{name}/acc"] = float((s >= 1.0).float().mean())
        out[f"{prefix}/{name}/response_length"] = float(ln.mean())
        out[f"{prefix}/{name}/share"] = len(idx) / n
    return out


class TaskWeightScheduler:
    # every argument is required: from_config passes the data.task_weights section, which owns the
    # defaults and checks the names (schedule's and metric's choices)
    def __init__(self, weights: Mapping[str, float], schedule: str, metric: str, patience: int,
                 min_delta: float, saturation: float, decay: float, min_weight: float):
        self.tasks = sorted(weights)
        self.weights = {t: float(weights[t]) for t in self.tasks}
        self.schedule, self.metric = schedule, metric
        self.patience, self.min_delta, self.saturation = int(patience), float(min_delta), float(saturation)
        self.decay, self.min_weight = float(decay), float(min_weight)
        self.best: Dict[str, Optional[float]] = {t: None for t in self.tasks}
        self.waited = {t: 0 for t in self.tasks}  # observations since the last improvement
        self.saturated_for = {t: 0 for t in self.tasks}  # observations in a row at/above saturation
        self.since_lowered: Dict[str, Optional[int]] = {t: None for t in self.tasks}  # None: never lowered
        self.last: Dict[str, Optional[float]] = {t: None for t in self.tasks}
        self.changes = 0

    @classmethod
    def from_config(cls, data_cfg) -> Optional["TaskWeightScheduler"]:
        if not data_cfg.tasks:
            return None
        from verl_hpc.config.sections.tasks import task_specs

        tw = data_cfg.task_weights
        return cls({n: t.weight for n, t in task_specs(data_cfg).items()}, tw.schedule, tw.metric, tw.patience,
                   tw.min_delta, tw.saturation, tw.decay, tw.min_weight)

    def observe(self, step: int, metrics: Mapping[str, float]) -> Dict[str, float]:
        """Update from a step's metrics (those without the watched metric change nothing); returns the
        weights to log (task/<name>/weight) and task/weight_changes (the run's total)."""
        if self.schedule == "plateau":
            values = {t: metrics.get(METRIC_KEYS[self.metric].format(t)) for t in self.tasks}
            self.update({t: v for t, v in values.items() if v is not None})
        out = {f"task/{t}/weight": w for t, w in self.weights.items()}
        out["task/weight_changes"] = float(self.changes)
        return out

    def update(self, values: Mapping[str, float]) -> list:
        """One observation per task in `values`; returns the tasks whose weight was lowered."""
        seen = []
        for t in self.tasks:
            v = values.get(t)
            if v is None or not math.isfinite(v):
                continue
            seen.append(t)
            best = self.best[t]
            if best is None or v > best + self.min_delta:
                self.best[t], self.waited[t] = float(v), 0
            else:
                self.waited[t] += 1
            self.last[t] = float(v)
            self.saturated_for[t] = self.saturated_for[t] + 1 if v >= self.saturation else 0
            if self.since_lowered[t] is not None:
                self.since_lowered[t] += 1
        lowered = []
        for t in seen:  # in name order; a task lowered now takes no share in the same update
            saturated = self.saturated_for[t] >= self.patience
            if not (saturated or self.waited[t] >= self.patience) or self.weights[t] <= self.min_weight:
                continue
            if self.since_lowered[t] is not None and self.since_lowered[t] < self.patience:
                continue  # lowered recently: give the new share time to show
            receivers = [r for r in self.tasks if r != t and r not in lowered and self.last_below(r)
                         and (saturated or self.waited[r] < self.patience)]
            if not receivers:
                continue
            new = max(self.min_weight, self.weights[t] * self.decay)
            freed, self.weights[t] = self.weights[t] - new, new
            self.since_lowered[t] = 0
            for r in receivers:
                self.weights[r] += freed / len(receivers)
            lowered.append(t)
        self.changes += bool(lowered)
        return lowered

    def last_below(self, t: str) -> bool:
        """The task's last observation is below saturation (or there was none yet)."""
        return self.last[t] is None or self.last[t] < self.saturation

    @property
    def required_state(self) -> str:
        """The checkpointer's hint when a checkpoint has no task weights (saved without data.tasks)."""
        return f"this run has data.tasks {self.tasks}: resume with the data settings it was saved with"

    def state_dict(self) -> Dict:
        return {"weights": dict(self.weights), "best": dict(self.best), "waited": dict(self.waited),
                "saturated_for": dict(self.saturated_for), "last": dict(self.last), "since_lowered": dict(self.since_lowered),
                "changes": self.changes}

    def load_state_dict(self, state: Mapping) -> None:
        if sorted(state["weights"]) != self.tasks:
            raise DataError(f"task weights in the checkpoint are for tasks {sorted(state['weights'])}, this run "
                            f"has {self.tasks}; resume with the same data.tasks")
        self.weights = {t: float(state["weights"][t]) for t in self.tasks}
        self.best = {t: None if state["best"][t] is None else float(state["best"][t]) for t in self.tasks}
        self.waited = {t: int(state["waited"][t]) for t in self.tasks}
        self.saturated_for = {t: int(state["saturated_for"][t]) for t in self.tasks}
        self.last = {t: None if state["last"][t] is None else float(state["last"][t]) for t in self.tasks}
        self.since_lowered = {t: None if state["since_lowered"][t] is None else int(state["since_lowered"][t])
                              for t in self.tasks}
        self.changes = int(state["changes"])


class TaskWeightHook:
    """After each step (and its validation): the weights the next step draws with."""
    stage = None

    def __init__(self, scheduler: TaskWeightScheduler, loader):
        self.scheduler, self.loader = scheduler, loader  # loader: rank 0's, None elsewhere

    def __call__(self, step, metrics, run):
        metrics.update(self.scheduler.observe(step, metrics))
        if self.loader is not None:
            self.loader.set_task_weights(self.scheduler.weights)
        return CONTINUE
