"""`safety:` switches that keep risky features off unless a run asks for them.

All three are off by default and production recipes keep them off (tests/unit/ops says so); when
any is on, rank 0 prints a banner at startup so a log reader sees it at once
(verl_hpc/trainer/hooks/safety.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import Section, opt


@dataclass
class SafetyConfig(Section):
    allow_custom_code: bool = opt(False, "run your own code: reward.custom_function, model.trust_remote_code")
    profiling: bool = opt(False, "torch.profiler traces per rank for safety.profile_steps -> <output_dir>/profiles")
    profile_steps: List[int] = opt([1], "RL steps traced when safety.profiling is on")
    debug: bool = opt(False, "autograd anomaly detection and cross-rank consistency checks every step (slow)")

    def check(self, job) -> List[str]:
        p = []
        fn = job.reward.custom_function
        if fn and not self.allow_custom_code:
            p.append(f"reward.custom_function = '{fn}' runs your own code: set "
                     "safety.allow_custom_code=true to allow it")
        if job.model.trust_remote_code and not self.allow_custom_code:
            p.append("model.trust_remote_code = true runs code shipped with the model folder: set "
                     "safety.allow_custom_code=true to allow it")
        bad = [s for s in self.profile_steps if s < 1]
        if self.profiling and bad:
            p.append(f"safety.profile_steps: steps start at 1, got {bad}")
        return p

    @property
    def switched_on(self) -> List[str]:
        return [name for name in ("allow_custom_code", "profiling", "debug") if getattr(self, name)]
