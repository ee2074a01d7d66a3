"""GMPO, Geometric-Mean Policy Optimization (arXiv 2507.20673), verl's `geo_mean`.

GRPO maximises the arithmetic mean of token-level clipped surrogates, which one outlier token ratio
can dominate. GMPO maximises the geometric mean of the token ratios instead, with each token's
log-ratio clipped (in log space, PPO-style pessimistically by the advantage's sign):

    d_t   = logp_t - old_logp_t
    d'_t  = sgn(A) * min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high))
    l_i   = -A_i * exp(mean_{t in y_i} d'_t),   A_i = mean_{t in y_i} A_t
    loss  = mean_i l_i

The paper's range is (e^-0.4, e^0.4), i.e. clip_ratio_low = clip_ratio_high = 0.4 here (log space).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .masked import masked_mean
from .policy_losses import Metrics, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss


@register_policy_loss("geo_mean")
def geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """GMPO's sequence objective. `loss_agg_mode` is accepted for a uniform call but not used: the
    objective is a mean over sequences by definition (verl ignores it too). Each sequence's loss
    l_i is written on its valid tokens and aggregated `seq-mean-token-mean`, which gives
    sum_i l_i / N_seqs (layout-independent with global_seqs) and lets per-token rollout-correction
    weights apply (a sequence's loss is scaled by the mean of its tokens' weights).

    Clip metrics: pg_clipfrac_high = share of valid tokens with A > 0 whose log-ratio was outside
    [-eps_low, eps_high], pg_clipfrac_low the same with A < 0.
    """
    del loss_agg_mode
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ConfigError(f"actor.clip_ratio_low/high must be >= 0 for geo_mean (log-space range); "
                          f"got {clip_ratio_low}, {clip_ratio_high}")
    valid, old, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    sign = torch.sign(adv)
    d = new - old
    d_clip = d.clamp(-clip_ratio_low, clip_ratio_high)
    d_pess = sign * torch.minimum(sign * d, sign * d_clip)
    seq_ratio = torch.exp(masked_mean(d_pess, valid, dim=-1))
    seq_adv = masked_mean(adv, valid, dim=-1)
    seq_loss = -seq_adv * seq_ratio
    zero = torch.zeros((), dtype=new.dtype, device=new.device)
    loss_mat = torch.where(valid, seq_loss.unsqueeze(-1), zero)
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, "seq-mean-token-mean",
                        global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, torch.exp(log_ratio), log_ratio, 0.0, 0.0, clipping=False)
    with torch.no_grad():
        outside = (d != d_clip) & valid
        metrics["pg_clipfrac_high"] = masked_mean((outside & (adv > 0)).to(new.dtype), valid)
        metrics["pg_clipfrac_low"] = masked_mean((outside & (adv < 0)).to(new.dtype), valid)
        metrics["pg_clipfrac"] = metrics["pg_clipfrac_high"] + metrics["pg_clipfrac_low"]
    return loss, metrics
