"""GDPO, Group reward-Decoupled normalization Policy Optimization (NVIDIA, arXiv 2601.05242), verl's `gdpo`.

With several rewards (say format and accuracy), GRPO normalises their sum within each group, so a
component with a large spread drowns the others and distinct reward combinations collapse onto one
advantage. GDPO normalises each component within the group first, then combines and whitens:

    A_k,i = (c_k,i - mean_g c_k) / (std_g c_k + eps)     per component k (GRPO's formula, per group)
    A_i   = sum_k w_k A_k,i
    A     = whiten(A) over the valid tokens of the batch

Components come from the reward function's dict (`algorithm.gdpo_reward_keys`, weights
`algorithm.gdpo_reward_weights`, empty = 1 each; rewards/scorer.py gathers them per sequence); with
none configured the sequence score is the one component (GRPO followed by a batch whitening).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .group_advantages import _broadcast, _prepare
from .groups import GROUP_STD_EPS, GroupIds, group_mean_std
from .masked import masked_whiten
from .registry import register_adv_estimator

Pair = Tuple[torch.Tensor, torch.Tensor]


@register_adv_estimator("gdpo")
@torch.no_grad()
def gdpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_adv_by_std: bool,
    reward_components: Optional[torch.Tensor] = None,
    reward_weights: Optional[Sequence[float]] = None,
    eps: float = GROUP_STD_EPS,
) -> Pair:
    """`reward_components` [B, K]: each sequence's K reward components (None: the sequence score,
    K = 1). `reward_weights`: K weights (None or empty: 1 each). Per component the group statistics
    are GRPO's (unbiased std; a group of one: mean 0, std 1; no std division with norm_adv_by_std=False);
    the weighted sum is broadcast to the valid tokens and whitened over them (mean, unbiased var, +1e-8).
    returns = advantages."""
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    comps = scores.unsqueeze(-1) if reward_components is None else reward_components.to(scores)
    if comps.dim() != 2 or comps.shape[0] != scores.shape[0]:
        raise ValueError(f"reward_components must be [B, K] with B = {scores.shape[0]}; got {tuple(comps.shape)}")
    weights = list(reward_weights) if reward_weights else [1.0] * comps.shape[1]
    if len(weights) != comps.shape[1]:
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(weights)} weights for {comps.shape[1]} reward "
                          "components (algorithm.gdpo_reward_keys); give one per key or none")
    bad = [w for w in weights if not math.isfinite(float(w))]
    if bad:  # the config check refuses them; a caller that built the weights itself gets the same line
        raise ConfigError(f"algorithm.gdpo_reward_weights: must be finite numbers, got {list(weights)}")
    total = torch.zeros_like(scores)
    for k, w in enumerate(weights):
        mean, std = group_mean_std(comps[:, k], codes, n_groups)
        a = (comps[:, k] - mean) / (std + eps) if norm_adv_by_std else comps[:, k] - mean
        total = total + w * a
    adv, _ = _broadcast(total, response_mask)
    adv = masked_whiten(adv, response_mask)
    return adv, adv.clone()
