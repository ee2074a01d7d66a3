"""Scores -> rewards -> advantages: the algorithm stage of the step, as configuration.

    advantage = AdvantageStage(cfg.algorithm, kl_ctrl)
    metrics   = advantage(batch)     # fills batch.rewards, batch.advantages, batch.returns

rewards = token_scores - beta * KL(actor_old || ref) per token when algorithm.use_kl_in_reward
(beta from the KL controller, which this stage also updates), else the token scores; then the
estimator algorithm.adv_estimator (gae, grpo, rloo, remax, reinforce++, ...) on the rewards.

With the implicit PRM (prm.enable) the step also has dense process rewards: the prime estimator
baselines them apart from the outcome (algorithms/prime.py); any other estimator takes
prm.outcome_coef x token_scores + prm.process_coef x process_rewards as its token rewards (the
process reward under GRPO, say: the group then compares outcome plus implicit score).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_hpc.algorithms import apply_kl_penalty, compute_advantages
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.recipes import SUM_PI_SQUARED_ESTIMATORS


def kl_in_reward(token_scores: torch.Tensor, batch, kl_ctrl, algorithm_cfg
                 ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """rewards = scores - beta * KL(actor_old || ref) per token, and the controller's update."""
    a = algorithm_cfg
    if not a.use_kl_in_reward:
        return token_scores, {}
    if batch.ref_log_probs is None:  # coefficient 0: ref.enable (auto) built no reference
        if kl_ctrl.value:
            raise ConfigError("algorithm.use_kl_in_reward with a KL coefficient > 0 needs the reference "
                              "policy (ref.enable)")
        return token_scores, {}
    rewards, m = apply_kl_penalty(token_scores, batch.old_log_probs, batch.ref_log_probs,
                                  batch.response_mask, kl_ctrl.value, a.kl_penalty)
    kl = float(m["kl"])
    kl_ctrl.update(kl, n_steps=token_scores.shape[0])
    return rewards, {"reward/kl": kl, "reward/kl_coef": kl_ctrl.value}


def advantages(algorithm_cfg, rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor,
               values: Optional[torch.Tensor] = None, baselines: Optional[torch.Tensor] = None,
               process_rewards: Optional[torch.Tensor] = None, prm_cfg=None, batch=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) `[B, T]` of algorithm.adv_estimator; values for GAE, baselines for
    ReMax, process rewards and the prm section's coefficients for PRIME; from the step `batch`:
    the reward components for GDPO, pi_old's log-probs and sum_pi_squared (and the rollout-correction
    weights) for the optimal token baselines."""
    a = algorithm_cfg
    inputs = dict(group_ids=group_ids, gamma=a.gamma, lam=a.lam, norm_adv_by_std=a.norm_adv_by_std)
    if values is not None:
        inputs["values"] = values
    if baselines is not None:
        inputs["reward_baselines"] = baselines
    if process_rewards is not None:
        inputs.update(process_rewards=process_rewards, process_coef=prm_cfg.process_coef,
                      outcome_coef=prm_cfg.outcome_coef, process_loo=prm_cfg.process_loo)
    if a.adv_estimator == "gdpo" and batch is not None:
        inputs.update(reward_components=batch.reward_components, reward_weights=a.gdpo_reward_weights)
    if a.adv_estimator in SUM_PI_SQUARED_ESTIMATORS:
        if batch is None or batch.sum_pi_squared is None:
            raise ConfigError(f"algorithm.adv_estimator = {a.adv_estimator} needs sum_pi_squared from the actor's "
                              "old-log-prob forward (it is not run in bypass mode)")
        inputs.update(old_log_probs=batch.old_log_probs, sum_pi_squared=batch.sum_pi_squared,
                      rollout_is_weights=batch.rollout_is_weights)
    return compute_advantages(a.adv_estimator, rewards, response_mask, **inputs)


class AdvantageStage:
    """The step's advantage computation with its settings (the `algorithm` section; the `prm`
    section's coefficients) and the KL controller (owned by the trainer: it is checkpointed with it)."""

    def __init__(self, algorithm_cfg, kl_ctrl, prm_cfg=None):
        self.cfg, self.kl_ctrl, self.prm = algorithm_cfg, kl_ctrl, prm_cfg

    def __call__(self, batch) -> Dict[str, float]:
        scores, process = batch.token_scores, batch.process_rewards
        if process is not None and self.cfg.adv_estimator != "prime":  # dense rewards on top of the outcome
            scores, process = self.prm.outcome_coef * scores + self.prm.process_coef * process, None
        batch.rewards, metrics = kl_in_reward(scores, batch, self.kl_ctrl, self.cfg)
        batch.advantages, batch.returns = advantages(self.cfg, batch.rewards, batch.response_mask,
                                                     batch.group_ids, batch.values, batch.baselines,
                                                     process, self.prm, batch=batch)
        return metrics
