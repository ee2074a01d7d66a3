"""DRO, verl's `dro` policy loss (verl PR #7245, the `dro` loss of Tinker): the policy gradient with a
quadratic penalty on the log-ratio to the sampling policy instead of a clip,

    l_t = -(A_t logp_t - beta / 2 (logp_t - old_logp_t)^2),    beta = actor.dro_beta

whose gradient -(A_t - beta (logp_t - old_logp_t)) grad logp_t is that of Direct Reward Optimization's
regularised regression (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large
Language Models Alignment", arXiv 2405.19107) per token, with the sampling policy as the anchor: the
pull back towards pi_old grows with the distance instead of switching off at a clip bound.

The penalty is not multiplied by the advantage, so a row whose advantages are all 0 still has a loss
and, once the policy moved (a second mini-batch or epoch), a gradient: `dro` is not among the losses
that may leave such rows out (config.recipes.ROW_LOCAL_POLICY_LOSSES).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .policy_losses import Metrics, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss


@register_policy_loss("dro")
def dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    dro_beta: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """l_t = -(A_t logp_t - dro_beta / 2 (logp_t - old_logp_t)^2); no clipping (clip fractions 0).
    The log-ratio in the penalty is unclamped (it is squared, not exponentiated), and so is the
    one of the ppo_kl metric, as verl reports it for DRO."""
    if not dro_beta > 0:
        raise ConfigError(f"actor.dro_beta (DRO's penalty coefficient) must be > 0; got {dro_beta}")
    valid, old, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    diff = new - old
    loss_mat = -(adv * new - 0.5 * dro_beta * diff * diff)
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _metrics(valid, adv, torch.exp(log_ratio), diff, 0.0, 0.0, clipping=False)
