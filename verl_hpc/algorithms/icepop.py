"""IcePop (Ant Group's Ring-1T report, "Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", arXiv 2510.18855; AReaL and verl offer it too), `icepop`.

The rollout engine and the trainer give the same token different probabilities (other kernels,
precision, MoE routing) and, with split placement, the rollout's policy is up to k updates older. A
token whose two probabilities disagree by a large factor carries a gradient that is mostly noise.
IcePop weights each token by the calibration ratio k_t = pi_old(y_t) / pi_rollout(y_t) and drops
(weight 0, not clipped) every token whose k_t leaves the band [alpha, beta]:

    M(k) = k if alpha <= k <= beta else 0
    l_t  = M(k_t) max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),   r_t = pi_theta / pi_old

(the report's objective; PPO's clip with `actor.clip_ratio_low/high`, no dual clip). alpha, beta =
`actor.icepop_low`, `actor.icepop_high` (the report's 0.5 and 5). k_t is fixed during the update (both
log-probs are), has no gradient, and reads only the token's own log-probs, so the loss is per token
like PPO's. With split placement's decoupled objective, M(k) takes the place of the proximal /
behaviour token weights (trainer/stages/correction.py applies none on top of it). verl reaches the
same weights through `rollout_correction.rollout_is_threshold: "0.5_5.0"`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .masked import check_same_shape, masked_mean
from .policy_losses import _LOG_RATIO_CLAMP, Metrics, _check_clip, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss


def icepop_weights(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, valid: torch.Tensor,
                   icepop_low: float, icepop_high: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(M(k) `[B, T]`, inside `[B, T]` bool) with k = exp(old - rollout) (log-ratio clamped to +-20),
    0 on padding and outside the band."""
    with torch.no_grad():
        log_k = torch.where(valid, old_log_prob.detach() - rollout_log_probs.detach().to(old_log_prob.dtype),
                            torch.zeros_like(old_log_prob))
        k = torch.exp(log_k.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        inside = valid & (k >= icepop_low) & (k <= icepop_high)
        return torch.where(inside, k, torch.zeros_like(k)), inside


@register_policy_loss("icepop")
def icepop(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    icepop_low: float,
    icepop_high: float,
    rollout_log_probs: Optional[torch.Tensor],
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """The PPO-clip loss of each token times M(pi_old / pi_rollout). `rollout_log_probs` [B, T]: the
    rollout engine's log-probs of the sampled tokens. Metrics: the PPO clip fractions, and
    `icepop_masked_frac` (share of valid tokens whose k left the band) and `icepop_weight_mean` (mean
    M(k) over the valid tokens)."""
    _check_clip(clip_ratio_low, clip_ratio_high)
    if not 0 <= icepop_low < icepop_high:
        raise ConfigError(f"actor.icepop_low / icepop_high must satisfy 0 <= low < high; got {icepop_low}, "
                          f"{icepop_high}")
    if rollout_log_probs is None:
        raise ConfigError("actor.policy_loss = icepop needs the rollout's log-probs (rollout_log_probs) in the batch")
    check_same_shape(rollout_log_probs, response_mask, "rollout_log_probs", "response_mask")
    valid, old, _, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    m, inside = icepop_weights(old, rollout_log_probs, valid, icepop_low, icepop_high)
    ratio = torch.exp(log_ratio)
    ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high))
    loss = weighted_agg(ppo * m, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, clip_ratio_low, clip_ratio_high)
    with torch.no_grad():
        metrics["icepop_masked_frac"] = masked_mean((valid & ~inside).to(m.dtype), valid)
        metrics["icepop_weight_mean"] = masked_mean(m, valid)
    return loss, metrics
