"""`trainer.rollback:` the rollback guard (verl_hpc/trainer/hooks/rollback.py; docs/operations.md).

Rules over monitored metrics: a drop of more than `drop` relative to the best value so far or to
the mean of the last `window` steps, a non-finite value, KL above `kl_max`, entropy below
`entropy_min`. On a trigger the run goes back to a checkpoint at least `rollback_steps` steps
before the step that tripped, optionally with a lower LR and skipping the data it trained on since.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import Section, opt

BASELINES = ("best", "window")


@dataclass
class RollbackConfig(Section):
    enable: bool = opt(False, "watch the metrics below and roll back when a rule trips")
    metrics: List[str] = opt(["reward/score/mean"], "metrics watched for drops and non-finite values "
                                                    "(higher is better)")
    drop: float = opt(0.5, "a fall of more than this fraction of the baseline trips; 0 = no drop rule",
                      check=">=0")
    baseline: str = opt("best", "what a drop is measured against: best (so far) | window (mean of the last "
                                "`window` steps)", choices=BASELINES)
    window: int = opt(5, "baseline=window: steps in the rolling mean", check=">0")
    drop_floor: float = opt(0.05, "a baseline closer to 0 than this counts as this, so a near-zero best "
                                  "does not make every dip a huge relative drop", check=">0")
    warmup_steps: int = opt(1, "steps observed before the drop rule may trip", check=">=0")
    kl_metric: str = opt("actor/ppo_kl", "the KL metric for kl_max")
    kl_max: float = opt(0.0, "KL above this trips; 0 = no KL rule", check=">=0")
    entropy_metric: str = opt("actor/entropy", "the entropy metric for entropy_min")
    entropy_min: float = opt(0.0, "entropy below this trips (collapse); 0 = no entropy rule", check=">=0")
    rollback_steps: int = opt(2, "go back to a checkpoint at least this many steps before the tripping step",
                              check=">0")
    lr_scale: float = opt(1.0, "multiply the actor's (and critic's) LR by this after each rollback",
                          check="(0, 1]")
    skip_data: bool = opt(False, "after a rollback, skip the prompts trained on since the checkpoint")
    max_rollbacks: int = opt(3, "give up (non-zero exit naming the metric) at the trip after this many "
                                "rollbacks", check=">=0")

    def check(self, job) -> List[str]:
        if not self.enable:
            return []
        p = []
        if not (self.metrics or self.kl_max or self.entropy_min):
            p.append("trainer.rollback: enabled with nothing to watch: list trainer.rollback.metrics or set "
                     "kl_max / entropy_min")
        c = job.checkpoint
        if c.save_every <= 0 or c.save_every > self.rollback_steps:
            p.append(f"trainer.rollback.rollback_steps = {self.rollback_steps} needs checkpoints at least that "
                     f"often: set checkpoint.save_every to 1..{self.rollback_steps} (now {c.save_every})")
        elif c.keep_last and (c.keep_last - 1) * c.save_every + 1 < self.rollback_steps:
            # the oldest kept checkpoint is (keep_last - 1) * save_every steps before the newest,
            # which may be the step just before the one that trips
            need = -(-(self.rollback_steps - 1) // c.save_every) + 1
            p.append(f"checkpoint.keep_last = {c.keep_last} (every {c.save_every} steps) may keep no checkpoint "
                     f"{self.rollback_steps} steps back for trainer.rollback: set keep_last >= {need} "
                     "or 0 (keep all)")
        return p
