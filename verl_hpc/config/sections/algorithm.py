"""`algorithm:` advantage estimator, KL in the reward, DAPO's filters. Recipes set most of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.fields import Section, opt, section

GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg")
"""Estimators whose baseline is the other responses to the same prompt: they need rollout.n >= 2."""


@dataclass
class KLControlConfig(Section):
    type: str = opt("fixed", "KL coefficient controller", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "coefficient of the KL penalty in the reward", check=">=0")
    target_kl: float = opt(0.1, "adaptive only")
    horizon: int = opt(10000, "adaptive only", check=">0")


@dataclass
class OverlongBufferConfig(Section):
    """DAPO's soft length penalty over the last `len` tokens before max_response_length."""

    enable: bool = opt(False, "DAPO soft length penalty")
    len: int = opt(0, "tokens before data.max_response_length where the penalty ramps up", check=">=0")
    penalty_factor: float = opt(1.0, "penalty at the full length", check=">=0")

    def check(self, job) -> List[str]:
        limit = job.data.max_response_length
        if job.trainer.job == "rl" and self.enable and not 0 < self.len < limit:
            return [f"algorithm.overlong_buffer.len = {self.len} must be in (0, data.max_response_length = "
                    f"{limit}) when algorithm.overlong_buffer.enable is true"]
        return []


@dataclass
class AlgorithmConfig(Section):
    recipe: Optional[str] = opt(None, "a named set of defaults (verl_hpc/config/recipes.py) under your values",
                                choices_from="RECIPE_NAMES")
    adv_estimator: str = opt("grpo", "advantage estimator", choices_from="ADV_ESTIMATORS")
    gamma: float = opt(1.0, "discount (gae, reinforce_plus_plus)", check="[0, 1]")
    lam: float = opt(1.0, "GAE lambda", check="[0, 1]")
    norm_adv_by_std: bool = opt(True, "GRPO: divide group-centred rewards by the group's std")
    use_kl_in_reward: bool = opt(False, "KL penalty subtracted from the token rewards (needs ref)")
    kl_penalty: str = opt("k1", "estimator of the reward KL", choices_from="KL_ESTIMATORS")
    kl_ctrl: KLControlConfig = section(KLControlConfig)
    filter_groups: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal")
    max_num_gen_batches: int = opt(4, "with filter_groups: generation rounds per step at most (then trains "
                                      "on what was kept, with filter/missing_groups > 0)", check=">0")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO soft length penalty")

    @property
    def uses_group_baseline(self) -> bool:
        return self.adv_estimator in GROUP_ESTIMATORS

    def check(self, job) -> List[str]:
        if job.trainer.job != "rl":
            return []
        n, p = job.rollout.n, []
        if self.uses_group_baseline and n < 2:
            p.append(f"rollout.n = {n}: algorithm.adv_estimator = {self.adv_estimator} compares the "
                     "responses to one prompt and needs rollout.n >= 2")
        if self.filter_groups and n < 2:
            p.append(f"algorithm.filter_groups needs rollout.n >= 2 (got {n})")
        return p
