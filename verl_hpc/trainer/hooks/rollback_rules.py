"""The rollback guard's rules (`trainer.rollback`): pure bookkeeping over a step's metrics.

    rules = RollbackRules.from_config(cfg.trainer.rollback)
    trip = rules.check(step, metrics)     # None, or the Trip naming the metric, the rule, the values

Rules, each off at its zero setting:
  drop        a watched metric (higher is better) fell by more than `drop` x the baseline: the best
              value so far, or the mean of the last `window` steps (baseline=window); a baseline
              nearer 0 than `drop_floor` counts as `drop_floor` so a run near zero does not trip on
              noise; only after `warmup_steps` observations of that metric.
  nonfinite   a watched metric, the KL or the entropy is NaN or infinite.
  kl          the KL metric above `kl_max`.
  entropy     the entropy metric below `entropy_min` (collapse).
A step that trips does not enter the baselines. After a rollback, `forget_after(step)` drops the
window entries of the steps that were undone; the best values stay (they were real).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Mapping, Optional, Tuple



@dataclass(frozen=True)
class Trip:
    step: int
    metric: str
    rule: str  # drop | nonfinite | kl | entropy
    value: float
    reference: Optional[float] = None  # the baseline or bound compared against

    @property
    def message(self) -> str:
        ref = "" if self.reference is None else f" (reference {self.reference:.6g})"
        what = {"drop": "dropped", "nonfinite": "is not finite", "kl": "KL above bound",
                "entropy": "entropy collapsed"}[self.rule]
        return f"{self.metric} {what} at step {self.step}: {self.value:.6g}{ref}"


class RollbackRules:
    # every argument is required: from_config passes the trainer.rollback section, which owns the
    # defaults and checks the names (baseline's choices)
    def __init__(self, metrics: List[str], drop: float, baseline: str, window: int, drop_floor: float,
                 warmup_steps: int, kl_metric: str, kl_max: float, entropy_metric: str, entropy_min: float):
        self.metrics, self.drop, self.baseline = list(metrics), float(drop), baseline
        self.window, self.drop_floor, self.warmup_steps = int(window), float(drop_floor), int(warmup_steps)
        self.kl_metric, self.kl_max = kl_metric, float(kl_max)
        self.entropy_metric, self.entropy_min = entropy_metric, float(entropy_min)
        self.best: Dict[str, float] = {}
        self.seen: Dict[str, int] = {m: 0 for m in self.metrics}
        self.recent: Dict[str, Deque[Tuple[int, float]]] = {m: deque(maxlen=self.window) for m in self.metrics}

    @classmethod
    def from_config(cls, rb) -> "RollbackRules":
        return cls(rb.metrics, rb.drop, rb.baseline, rb.window, rb.drop_floor, rb.warmup_steps, rb.kl_metric,
                   rb.kl_max, rb.entropy_metric, rb.entropy_min)

    def reference(self, metric: str) -> Optional[float]:
        if self.baseline == "best":
            return self.best.get(metric)
        values = [v for _, v in self.recent[metric]]
        return sum(values) / len(values) if values else None

    def check(self, step: int, metrics: Mapping[str, float]) -> Optional[Trip]:
        trip = self._first_trip(step, metrics)
        if trip is None:  # only healthy steps enter the baselines
            for m in self.metrics:
                v = metrics.get(m)
                if v is None:
                    continue
                self.seen[m] += 1
                self.best[m] = max(self.best.get(m, v), float(v))
                self.recent[m].append((step, float(v)))
        return trip

    def _first_trip(self, step: int, metrics: Mapping[str, float]) -> Optional[Trip]:
        for m in self.metrics:
            v = metrics.get(m)
            if v is None:
                continue
            if not math.isfinite(v):
                return Trip(step, m, "nonfinite", float(v))
            ref = self.reference(m)
            if self.drop > 0 and ref is not None and self.seen[m] >= self.warmup_steps:
                if ref - v > self.drop * max(abs(ref), self.drop_floor):
                    return Trip(step, m, "drop", float(v), ref)
        kl = metrics.get(self.kl_metric) if self.kl_max > 0 else None
        if kl is not None and (not math.isfinite(kl) or kl > self.kl_max):
            return Trip(step, self.kl_metric, "nonfinite" if not math.isfinite(kl) else "kl", float(kl), self.kl_max)
        ent = metrics.get(self.entropy_metric) if self.entropy_min > 0 else None
        if ent is not None and (not math.isfinite(ent) or ent < self.entropy_min):
            return Trip(step, self.entropy_metric, "nonfinite" if not math.isfinite(ent) else "entropy",
                        float(ent), self.entropy_min)
        return None

    def forget_after(self, step: int) -> None:
        """Drop the window entries of steps after `step` (they were rolled back)."""
        for m in self.metrics:
            kept = [(s, v) for s, v in self.recent[m] if s <= step]
            self.recent[m] = deque(kept, maxlen=self.window)

    def state_dict(self) -> Dict:
        return {"best": dict(self.best), "seen": dict(self.seen),
                "recent": {m: [list(x) for x in q] for m, q in self.recent.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        self.best = {m: float(v) for m, v in state["best"].items() if m in self.seen}
        self.seen = {m: int(state["seen"].get(m, 0)) for m in self.metrics}
        self.recent = {m: deque([(int(s), float(v)) for s, v in state["recent"].get(m, [])], maxlen=self.window)
                       for m in self.metrics}
