"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617), under verl's names `clip_cov` and `kl_cov`.

The paper shows the policy's entropy falls in proportion to the covariance between a token's
log-probability and its advantage, and that a small fraction of tokens with very large covariance
drives the collapse. Both losses act on those tokens only:

    cov_t = (A_t - mean(A)) * (logp_t - mean(logp))      (means over this batch's valid tokens)

- clip_cov: PPO clip; then, among tokens PPO did not clip whose cov is in (lb, ub), a random
  `clip_cov_ratio` share of all valid tokens (at least one) get loss 0 (no gradient).
- kl_cov: the unclipped surrogate -A r; the `kl_cov_ratio` share of valid tokens (at least one)
  with the largest cov get an extra `ppo_kl_coef * |logp - old_logp|`.

The statistics are over the batch the loss sees, i.e. per micro-batch under gradient accumulation
(as in verl): the selected set depends on how rows are split, unlike the other losses' values.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .masked import masked_mean
from .policy_losses import Metrics, _check_clip, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss


def _check_ratio(value: float, name: str) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"actor.{name} must be in (0, 1] (a share of the valid tokens); got {value}")


def token_covariance(adv: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over valid tokens, -inf on padding (never chosen)."""
    lp = log_prob.detach()
    cov = (adv - masked_mean(adv, valid)) * (lp - masked_mean(lp, valid))
    return torch.where(valid, cov, torch.full_like(cov, float("-inf")))


@register_policy_loss("clip_cov")
def clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """l_t = max(-A r, -A clip(r)) * c_t, c_t = 0 on the selected tokens, 1 elsewhere.

    Selection: candidates are valid tokens not clipped by PPO with lb < cov_t < ub; of those,
    max(1, int(clip_cov_ratio * N_valid)) are drawn uniformly at random (torch's global RNG, seeded
    by the run) when there are more candidates than that, else all are taken.
    Metric `clip_cov_frac`: share of valid tokens selected. No dual clip (as in the paper and verl).
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    _check_ratio(clip_cov_ratio, "clip_cov_ratio")
    if not clip_cov_lb < clip_cov_ub:
        raise ConfigError(f"actor.clip_cov_lb ({clip_cov_lb}) must be < actor.clip_cov_ub ({clip_cov_ub})")
    valid, _, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    with torch.no_grad():
        cov = token_covariance(adv, new, valid)
        candidate = valid & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        idx = candidate.flatten().nonzero().flatten()
        n_pick = max(int(clip_cov_ratio * float(valid.sum())), 1)
        if idx.numel() > n_pick:
            idx = idx[torch.randperm(idx.numel(), device="cpu")[:n_pick].to(idx.device)]
        keep = torch.ones(valid.numel(), dtype=new.dtype, device=new.device)
        keep[idx] = 0.0
        keep = keep.view_as(new)
    loss_mat = torch.maximum(unclipped, clipped) * keep
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, clip_ratio_low, clip_ratio_high)
    metrics["clip_cov_frac"] = masked_mean((keep == 0).to(new.dtype), valid).detach()
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float,
    ppo_kl_coef: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """l_t = -A r + [t in top-k cov] * ppo_kl_coef * |logp - old_logp|, no clipping;
    k = max(1, int(kl_cov_ratio * N_valid)), ties broken by position (first in row-major order).
    Metric `kl_cov_frac`: share of valid tokens penalised."""
    _check_ratio(kl_cov_ratio, "kl_cov_ratio")
    if ppo_kl_coef < 0:
        raise ConfigError(f"actor.ppo_kl_coef must be >= 0; got {ppo_kl_coef}")
    valid, _, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        cov = token_covariance(adv, new, valid).flatten()
        k = max(int(kl_cov_ratio * float(valid.sum())), 1)
        # stable sort: equal covariances keep their order, so the choice is reproducible
        top = torch.sort(cov, descending=True, stable=True).indices[:k]
        chosen = torch.zeros(cov.numel(), dtype=new.dtype, device=new.device)
        chosen[top] = 1.0
        chosen = chosen.view_as(new)
    loss_mat = -adv * ratio + chosen * ppo_kl_coef * log_ratio.abs()
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, 0.0, 0.0, clipping=False)
    metrics["kl_cov_frac"] = masked_mean(chosen, valid).detach()
    return loss, metrics
