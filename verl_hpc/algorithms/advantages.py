"""Token-level advantage estimators (GAE, REINFORCE++, ReMax) and the by-name entry point.

Every estimator takes `token_level_rewards [B, T]` and `response_mask [B, T]` (right-padded) and
returns `(advantages, returns)`, both `[B, T]` and exactly zero on padding. Group-relative
estimators live in group_advantages.py; both register into one registry so the trainer calls
`compute_advantages(cfg.algorithm.adv_estimator, ...)` with whatever inputs it has.
Options that are `algorithm` fields (gamma, lam, norm_adv_by_std) have no default: the section owns
them and the trainer passes them (trainer/stages/advantage.py), so a default is never written twice.

Advantages are targets, not part of the graph: everything runs under no_grad so a critic's value
tensor that still carries grad cannot leak gradients into the policy loss.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from . import group_advantages, prime  # noqa: F401  (register grpo, rloo, opo, gpg, reinforce++-baseline, prime)
from . import gdpo, token_baseline  # noqa: F401  (register gdpo, optimal_token_baseline, tir_optimal_token_baseline)
from .masked import as_float_mask, check_per_sample, check_token_inputs, masked_whiten, reward_to_go
from .registry import ADV_ESTIMATOR_REGISTRY, register_adv_estimator

Pair = Tuple[torch.Tensor, torch.Tensor]


@register_adv_estimator("gae")
@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lam: float,
) -> Pair:
    """Generalised advantage estimation (Schulman et al. 2016), per token.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},
    with V and A beyond the last valid token taken as 0 (the response ends there).
    returns = A + V (before whitening); advantages are then whitened over all valid tokens.
    The recursion steps over masked positions rather than through them, so padding values
    (often garbage from the critic) never enter it.
    """
    check_token_inputs(response_mask, token_level_rewards=token_level_rewards, values=values)
    rewards, values = token_level_rewards, values.to(token_level_rewards.dtype)
    valid = as_float_mask(response_mask, rewards) > 0
    batch, length = rewards.shape
    zeros = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    next_value, last_adv = zeros, zeros
    adv = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last_adv
        last_adv = torch.where(valid[:, t], candidate, last_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        adv[:, t] = torch.where(valid[:, t], candidate, zeros)
    returns = torch.where(valid, adv + values, torch.zeros_like(adv))
    return masked_whiten(adv, valid), returns


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
    gamma: float,
) -> Pair:
    """REINFORCE++ (Hu 2025): discounted return-to-go G_t = sum_{s>=t} gamma^(s-t) r_s per token,
    advantages = G whitened over all valid tokens of the batch (the "global" normalisation that
    replaces a critic); returns = G unwhitened."""
    check_token_inputs(response_mask, token_level_rewards=token_level_rewards)
    valid = as_float_mask(response_mask, token_level_rewards) > 0
    returns = reward_to_go(token_level_rewards, valid, gamma)
    return masked_whiten(returns, valid), returns


@register_adv_estimator("remax")
@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> Pair:
    """ReMax (Li et al. 2023): A_t = G_t - b with G_t = sum_{s>=t} r_s the reward-to-go and b the
    reward of the greedy response to the same prompt (`reward_baselines [B]`). No whitening.
    returns = G (the reward-to-go without the baseline), as verl defines them."""
    check_token_inputs(response_mask, token_level_rewards=token_level_rewards)
    check_per_sample(reward_baselines, response_mask, "reward_baselines")
    valid = as_float_mask(response_mask, token_level_rewards) > 0
    rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    adv = to_go - reward_baselines.to(rewards.dtype).unsqueeze(-1)
    zero = torch.zeros_like(adv)
    return torch.where(valid, adv, zero), torch.where(valid, to_go, zero)


def compute_advantages(
    name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **inputs: Any
) -> Pair:
    """Run the estimator registered as `name` (algorithm.adv_estimator).

    `inputs` may hold everything the trainer has (values, group_ids, reward_baselines, gamma, lam,
    norm_adv_by_std, eps); each estimator takes only what it declares, missing required inputs and
    unknown keywords raise a ValueError.
    """
    return ADV_ESTIMATOR_REGISTRY.call(name, token_level_rewards, response_mask, **inputs)
