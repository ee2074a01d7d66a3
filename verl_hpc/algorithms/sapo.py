"""SAPO, Soft Adaptive Policy Optimization (Qwen team, Gao et al. 2025, arXiv 2511.20347), verl's `sapo`.

PPO's hard clip silences a token's gradient the moment its ratio leaves [1 - eps, 1 + eps]. SAPO
replaces the clip with a smooth gate on the ratio whose temperature depends on the advantage's sign:

    f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau,      tau = tau_pos if A > 0 else tau_neg
    l_t       = -f(r_t; tau_t) A_t

The gate's slope at r = 1 is exactly 1 (sigmoid' = 1/4 there), so on-policy the gradient is PPO's
`-A grad logp`; away from r = 1 the weight `4 sigmoid(x)(1 - sigmoid(x))` (x = tau (r - 1)) decays
smoothly instead of dropping to 0. tau_neg > tau_pos decays negative-advantage tokens faster: a
negative update raises many unsampled tokens' logits and destabilises more (the paper's 1.0 / 1.05).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .masked import masked_mean
from .policy_losses import Metrics, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss


@register_policy_loss("sapo")
def sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """l_t = -sigmoid(tau_t (r_t - 1)) 4 / tau_t * A_t, tau_t = tau_pos where A_t > 0, else tau_neg.

    Aggregated with `loss_agg_mode` (the paper's objective is `seq-mean-token-mean`, which verl
    forces whatever actor.loss_agg_mode says; here the configured mode is used). No clipping, so the
    clip fractions are 0; metric `sapo_weight_mean`: the mean gradient weight 4 s (1 - s) of the valid
    tokens (1 on-policy, smaller the further ratios drift).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ConfigError(f"actor.tau_pos and actor.tau_neg must be > 0 (gate temperatures); got {tau_pos}, {tau_neg}")
    valid, _, _, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss_mat = -(gate * (4.0 / tau)) * adv
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, 0.0, 0.0, clipping=False)
    with torch.no_grad():
        metrics["sapo_weight_mean"] = masked_mean(4.0 * gate * (1.0 - gate), valid).detach()
    return loss, metrics
