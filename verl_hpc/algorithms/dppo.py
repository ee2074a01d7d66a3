"""DPPO, Divergence Proximal Policy Optimization ("Rethinking the Trust Region in LLM Reinforcement
Learning", Qi et al. 2026, arXiv 2602.04879), in verl's two variants `dppo_tv` and `dppo_kl`.

PPO's clip on the ratio r = p / p_old over-constrains rare tokens (a ratio of 2 at p_old = 1e-4 is a
tiny move) and under-constrains likely ones (p_old = 0.9 -> 1.0 is a large move with r = 1.11). DPPO
bounds a divergence between the old and the current token distribution instead, approximated on the
sampled token's two-outcome (binary) distribution {p, 1 - p}:

    TV: |p - p_old|                    KL: p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))

A token leaves the trust region when the update moves it the way its advantage pushes and the
divergence exceeds the bound: A > 0 and p - p_old > delta_high (TV) / KL > delta_high with p > p_old;
A <= 0 and p_old - p > delta_low (TV) / KL > delta_low with p < p_old. Such tokens get no gradient.
The others keep the importance-weighted policy gradient, its weight detached and truncated:

    l_t = -A_t sg(min(r_t, C)) logp_t * [t inside the trust region]

(d l_t / d logp_t = -A_t min(r_t, C): the surrogate's gradient, with truncated importance sampling
in place of the dual clip, as in verl). As verl does, the bounds are `actor.clip_ratio_low` /
`actor.clip_ratio_high` (the paper uses 0.15 for TV and 0.05 for KL) and C is `actor.clip_ratio_c`.
p_old is pi_old's probability: the rollout's own with `algorithm.rollout_correction.bypass_mode`
(the paper's setting, where the divergence is to the behaviour policy), else the trainer's.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .masked import masked_mean
from .policy_losses import Metrics, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss

# verl's guard in the binary KL's second term (1 - p can be 0 in float32 for a near-certain token)
_BINARY_KL_EPS = 1e-8


def _check(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ConfigError(f"actor.clip_ratio_low/high are DPPO's divergence bounds and must be >= 0; got "
                          f"{clip_ratio_low}, {clip_ratio_high}")
    if not clip_ratio_c > 0:
        raise ConfigError(f"actor.clip_ratio_c (DPPO's importance-weight cap) must be > 0; got {clip_ratio_c}")


def binary_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """KL({p_old, 1 - p_old} || {p, 1 - p}) of the sampled token's two-outcome distributions, from the
    log-probs (the first term's log-ratio exactly; the second with verl's 1e-8 guard)."""
    p_old, p = torch.exp(old_log_prob), torch.exp(log_prob)
    return p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log(
        (1 - p_old + _BINARY_KL_EPS) / (1 - p + _BINARY_KL_EPS))


def _dppo(divergence: str, old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
          clip_ratio_c, loss_agg_mode, global_tokens, global_seqs, norm_len, rollout_is_weights):
    _check(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    valid, old, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        p, p_old = torch.exp(new.detach()), torch.exp(old)
        if divergence == "tv":
            inside_pos = p - p_old <= clip_ratio_high
            inside_neg = p - p_old >= -clip_ratio_low
        else:
            kl = binary_kl(old, new.detach())
            inside_pos = (kl <= clip_ratio_high) | (p <= p_old)
            inside_neg = (kl <= clip_ratio_low) | (p >= p_old)
        inside = torch.where(adv > 0, inside_pos, inside_neg)
        weight = torch.where(inside, ratio.detach().clamp(max=clip_ratio_c), torch.zeros_like(ratio))
    loss_mat = -adv * weight * new
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, 0.0, 0.0, clipping=False)
    with torch.no_grad():
        outside = valid & ~inside
        metrics["pg_clipfrac_high"] = masked_mean((outside & (adv > 0)).to(new.dtype), valid)
        metrics["pg_clipfrac_low"] = masked_mean((outside & (adv < 0)).to(new.dtype), valid)
        metrics["pg_clipfrac"] = metrics["pg_clipfrac_high"] + metrics["pg_clipfrac_low"]
        metrics["pg_truncfrac"] = masked_mean((inside & (ratio > clip_ratio_c)).to(new.dtype), valid)
    return loss, metrics


@register_policy_loss("dppo_tv")
def dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV: outside the trust region when A > 0 and p - p_old > clip_ratio_high, or
    A <= 0 and p_old - p > clip_ratio_low. Metrics: pg_clipfrac_high / _low the share of valid tokens
    outside it with A > 0 / A < 0; pg_truncfrac the share inside it whose weight was cut at C."""
    return _dppo("tv", old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                 clip_ratio_c, loss_agg_mode, global_tokens, global_seqs, norm_len, rollout_is_weights)


@register_policy_loss("dppo_kl")
def dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL: outside the trust region when A > 0, p > p_old and the binary KL exceeds
    clip_ratio_high, or A <= 0, p < p_old and it exceeds clip_ratio_low. Metrics as dppo_tv."""
    return _dppo("kl", old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                 clip_ratio_c, loss_agg_mode, global_tokens, global_seqs, norm_len, rollout_is_weights)
