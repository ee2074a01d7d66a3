"""`algorithm:` advantage estimator, KL in the reward, DAPO's filters. Recipes set most of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.fields import Section, opt, section
from verl_hpc.config.recipes import BEHAVIOUR_WEIGHTED_POLICY_LOSSES, SUM_PI_SQUARED_ESTIMATORS

GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg", "prime", "gdpo",
                    "optimal_token_baseline", "tir_optimal_token_baseline")
"""Estimators whose baseline is the other responses to the same prompt: they need rollout.n >= 2."""


@dataclass
class KLControlConfig(Section):
    type: str = opt("fixed", "KL coefficient controller", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "coefficient of the KL penalty in the reward", check=">=0")
    target_kl: float = opt(0.1, "adaptive only; > 0")
    horizon: int = opt(10000, "adaptive only", check=">0")

    def check(self, job) -> List[str]:
        # the RL trainer builds the controller whatever the KL is used for; adaptive divides by it
        if job.trainer.job == "rl" and self.type == "adaptive" and self.target_kl <= 0:
            return [f"algorithm.kl_ctrl.target_kl: must be > 0 with algorithm.kl_ctrl.type = adaptive, "
                    f"got {self.target_kl}"]
        return []


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
class AccuracyFilterConfig(Section):
    """PRIME's filter: keep the groups whose share of correct responses (reward.correct_at) lies in
    [low, high]; all-right and all-wrong prompts teach little. Refills like filter_groups (up to
    max_num_gen_batches generation rounds)."""

    enable: bool = opt(False, "keep only groups whose mean outcome label is in [low, high]")
    low: float = opt(0.2, "lowest share of correct responses kept", check="[0, 1]")
    high: float = opt(0.8, "highest share of correct responses kept", check="[0, 1]")

    def check(self, job) -> List[str]:
        if job.trainer.job != "rl" or not self.enable:
            return []
        p = []
        if self.low > self.high:
            p.append(f"algorithm.accuracy_filter.low = {self.low} is above algorithm.accuracy_filter.high = "
                     f"{self.high}: no group would be kept")
        if job.rollout.n < 2:
            p.append(f"algorithm.accuracy_filter needs rollout.n >= 2 (got {job.rollout.n})")
        return p


@dataclass
class RolloutCorrectionConfig(Section):
    """Rollout/training mismatch correction (verl's names; docs/algorithms.md)."""

    rollout_is: Optional[str] = opt("auto", "truncated importance sampling weights; null = off; auto: token under "
                                            "rollout.quantization (unless bypass_mode, async_training.objective = "
                                            "behaviour or a policy loss that weights by the ratio itself), else off",
                                    choices=("auto", "token", "sequence"))
    rollout_is_threshold: float = opt(2.0, "C of min(pi_old / pi_rollout, C)", check=">0")
    rollout_rs: Optional[str] = opt(None, "rejection of tokens/sequences whose ratio leaves the bounds; null = off",
                                    choices=("token", "sequence", "geometric"))
    rollout_rs_threshold: Optional[float] = opt(None, "upper bound of the kept ratios",
                                                auto="rollout_is_threshold (at use)")
    rollout_rs_threshold_lower: Optional[float] = opt(None, "lower bound of the kept ratios", auto="1 / upper (at use)")
    bypass_mode: bool = opt(False, "rollout log-probs are the old policy: no old-log-prob forward")

    def level(self, job) -> Optional[str]:
        """rollout_is in effect: auto is TIS (token, C = rollout_is_threshold) with a quantized rollout,
        whose log-probs are further from the trainer's than a full-precision one's, except where the
        ratio is corrected already (the bypass and behaviour objectives take the rollout's log-probs as
        pi_old; icepop weights by the ratio itself)."""
        if self.rollout_is != "auto":
            return self.rollout_is
        asy = job.async_training
        elsewhere = (self.bypass_mode or (asy.off_policy and asy.objective == "behaviour")
                     or job.actor.policy_loss in BEHAVIOUR_WEIGHTED_POLICY_LOSSES)
        return "token" if job.rollout.quantized and not elsewhere else None

    def resolve(self, job) -> None:
        self.rollout_is = self.level(job)

    def check(self, job) -> List[str]:
        if job.trainer.job != "rl":
            return []
        key, p = "algorithm.rollout_correction", []
        hi = self.rollout_is_threshold if self.rollout_rs_threshold is None else self.rollout_rs_threshold
        lo = 1.0 / hi if self.rollout_rs_threshold_lower is None and hi > 0 else self.rollout_rs_threshold_lower
        if self.rollout_rs is not None and not (lo is not None and 0 <= lo < hi):
            p.append(f"{key}: rejection bounds need 0 <= rollout_rs_threshold_lower < rollout_rs_threshold, "
                     f"got {lo} and {hi}")
        if self.bypass_mode and (self.level(job) or self.rollout_rs):
            p.append(f"{key}.bypass_mode uses the rollout log-probs as the old policy, so the IS ratio "
                     f"pi_old / pi_rollout is 1: set rollout_is and rollout_rs to null with bypass_mode")
        return p


@dataclass
class PreferenceConfig(Section):
    """trainer.job=dpo: the offline preference loss (verl_hpc/algorithms/preference.py)."""

    loss: str = opt("dpo", "preference loss", choices=("dpo", "ipo", "simpo", "orpo", "kto"))
    beta: float = opt(0.1, "inverse temperature of the implicit reward (SimPO's paper uses 2.0-2.5)", check=">0")
    label_smoothing: float = opt(0.0, "dpo / simpo: > 0 = conservative DPO", check="[0, 0.5)")
    gamma: float = opt(0.5, "simpo: the target reward margin")
    desirable_weight: float = opt(1.0, "kto: lambda_D", check=">=0")
    undesirable_weight: float = opt(1.0, "kto: lambda_U", check=">=0")

    def check(self, job) -> List[str]:
        t = job.rollout.temperature
        if job.trainer.job == "dpo" and t != 1.0:  # the engines divide the logits by it
            return [f"rollout.temperature = {t}: trainer.job = dpo needs 1.0 (the engines' log-probs are "
                    "of logits / rollout.temperature)"]
        return []


@dataclass
class AlgorithmConfig(Section):
    recipe: Optional[str] = opt(None, "a named set of defaults (verl_hpc/config/recipes.py) under your values",
                                choices_from="RECIPE_NAMES")
    adv_estimator: str = opt("grpo", "advantage estimator (the names: docs/algorithms.md)", choices_from="ADV_ESTIMATORS")
    gamma: float = opt(1.0, "discount (gae, reinforce_plus_plus)", check="[0, 1]")
    lam: float = opt(1.0, "GAE lambda", check="[0, 1]")
    norm_adv_by_std: bool = opt(True, "GRPO: divide group-centred rewards by the group's std")
    # GDPO (arXiv 2601.05242; verl's names): each component normalised within its group apart
    gdpo_reward_keys: List[str] = opt([], "gdpo: keys of the reward function's returned dict, each normalised "
                                          "within the group apart ('score': the score itself); empty = the score alone")
    gdpo_reward_weights: List[float] = opt([], "gdpo: weight of each key's normalised advantage, in order; "
                                               "empty = 1 each")
    use_kl_in_reward: bool = opt(False, "KL penalty subtracted from the token rewards (needs ref)")
    kl_penalty: str = opt("k1", "estimator of the reward KL", choices_from="KL_ESTIMATORS")
    kl_ctrl: KLControlConfig = section(KLControlConfig)
    filter_groups: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal")
    max_num_gen_batches: int = opt(4, "with filter_groups or accuracy_filter: generation rounds per step at "
                                      "most (then trains on what was kept, with filter/missing_groups > 0)",
                                   check=">0")
    accuracy_filter: AccuracyFilterConfig = section(AccuracyFilterConfig, "PRIME: groups by their share of "
                                                                          "correct responses")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO soft length penalty")
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig,
                                                          "rollout/training log-prob mismatch correction")
    preference: PreferenceConfig = section(PreferenceConfig, "trainer.job=dpo: the preference loss")

    @property
    def uses_group_baseline(self) -> bool:
        return self.adv_estimator in GROUP_ESTIMATORS

    @property
    def filters(self) -> bool:
        """A group filter is on: a step may generate several rounds to fill its batch."""
        return self.filter_groups or self.accuracy_filter.enable

    def check(self, job) -> List[str]:
        if job.trainer.job != "rl":
            return []
        n, p = job.rollout.n, []
        if self.uses_group_baseline and n < 2:
            p.append(f"rollout.n = {n}: algorithm.adv_estimator = {self.adv_estimator} compares the "
                     "responses to one prompt and needs rollout.n >= 2")
        if self.filter_groups and n < 2:
            p.append(f"algorithm.filter_groups needs rollout.n >= 2 (got {n})")
        p += self.gdpo_problems(job)
        if self.adv_estimator in SUM_PI_SQUARED_ESTIMATORS and (
                self.rollout_correction.bypass_mode
                or (job.async_training.off_policy and job.async_training.objective == "behaviour")):
            p.append(f"algorithm.adv_estimator = {self.adv_estimator} reads sum_v pi_v^2 from the actor's old-log-prob "
                     "forward, which bypass_mode / async_training.objective = behaviour skip: turn them off")
        if self.filters and job.placement.split and self.max_num_gen_batches > 1:
            # a refill takes the next batch of the rollout group's stream within the same step, but
            # the rollout group starts batch b only with weights of version >= b - 1 - staleness
            p.append("algorithm.filter_groups / algorithm.accuracy_filter with placement.mode = split: a step that "
                     "refills takes more than one batch of the rollout group's stream, which waits for weights "
                     "one step newer per batch; set algorithm.max_num_gen_batches=1 (filtered groups are then "
                     "dropped, not refilled)")
        return p

    def gdpo_problems(self, job) -> List[str]:
        keys, weights, p = self.gdpo_reward_keys, self.gdpo_reward_weights, []
        if (keys or weights) and self.adv_estimator != "gdpo":
            return [f"algorithm.gdpo_reward_keys / gdpo_reward_weights are read by adv_estimator = gdpo only "
                    f"(got {self.adv_estimator}): remove them"]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:  # one component counted twice is a weight of 2 in disguise, and its advantage's meaning changes
            p.append(f"algorithm.gdpo_reward_keys names {', '.join(map(repr, twice))} more than once; each reward "
                     "component is normalised once: give each key once (set its weight in gdpo_reward_weights)")
        if weights and len(weights) != len(keys or ["score"]):
            p.append(f"algorithm.gdpo_reward_weights has {len(weights)} weight(s) for {len(keys or ['score'])} "
                     "reward component(s) (algorithm.gdpo_reward_keys; empty = the score): give one per key or none")
        if any(k != "score" for k in keys) and not job.reward.custom_function:
            p.append("algorithm.gdpo_reward_keys names dict keys, which only a reward.custom_function returning "
                     "{'score': ..., key: ...} gives (the built-in rules return a number)")
        dropped = [name for name, on in (
            ("algorithm.use_kl_in_reward", self.use_kl_in_reward), ("algorithm.overlong_buffer", self.overlong_buffer.enable),
            ("multi_turn (its turn rewards)", job.multi_turn.enable), ("prm (its process rewards)", job.prm.wanted(job)),
        ) if on]
        if keys and dropped:
            p.append(f"algorithm.gdpo_reward_keys: GDPO's advantages come from the components alone, so "
                     f"{', '.join(dropped)} would be dropped: leave gdpo_reward_keys empty or turn them off")
        return p
