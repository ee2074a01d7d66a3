"""Policy-gradient losses: PPO clip (with clip-higher and dual-clip), GSPO, CISPO, GPG, REINFORCE.

All share one calling convention so that `actor.policy_loss` is just a name:

    loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask, *, <options>,
                       loss_agg_mode=..., global_tokens=..., global_seqs=..., norm_len=...)

inputs `[B, T]` (per-token log-probs of the sampled tokens under the rollout-time policy and the
current policy, per-token advantages), `loss` a scalar with gradient w.r.t. `log_prob`, and
`metrics` detached 0-d tensors (masked means over this batch's valid tokens) with the same keys for
every loss, so that trackers see one schema:

    pg_clipfrac       fraction of tokens where PPO clipping removed the gradient (high + low)
    pg_clipfrac_high  A > 0 and ratio > 1 + clip_ratio_high
    pg_clipfrac_low   A < 0 and ratio < 1 - clip_ratio_low
    pg_clipfrac_dual  A < 0 and ratio > clip_ratio_c (dual-clip engaged)
    ppo_kl            mean of (old_log_prob - log_prob), the k1 estimate of KL(old || current)

Options that are fields of the `actor` section (clip ranges, loss_agg_mode) have no default here:
the section owns them and PolicyObjective.from_config binds them, so a default is never written
twice; code without a config (tests) passes values. gspo and geo_mean keep their papers' ranges as
defaults, which no config field mirrors.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count, agg_loss
from .masked import as_float_mask, check_same_shape, check_token_inputs, masked_mean
from .registry import POLICY_LOSS_REGISTRY, register_policy_loss

Metrics = Dict[str, torch.Tensor]
# exp() of a log-ratio above ~88 overflows float32; verl clamps at +-20, which is already e^20.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is capped lower (as in verl) because one such value scales every token.
_SEQ_LOG_RATIO_MAX = 10.0


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float] = None) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ConfigError(f"actor.clip_ratio_low must be in [0, 1); got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ConfigError(f"actor.clip_ratio_high must be >= 0; got {clip_ratio_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ConfigError(f"actor.clip_ratio_c (dual-clip bound) must be > 1.0; got {clip_ratio_c}")


def weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len):
    """agg_loss of `loss_mat * w`, w the rollout-correction weights (algorithms/mismatch.py: truncated
    importance weights, 0 on rejected tokens), or of `loss_mat` when there are none. The weights are
    constants (no gradient); multiplying the per-token loss by them is what makes the correction
    apply to every policy loss alike. Token counts (denominators) are unchanged by rejection."""
    if rollout_is_weights is not None:
        check_same_shape(rollout_is_weights, loss_mat, "rollout_is_weights", "response_mask")
        zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
        loss_mat = loss_mat * torch.where(valid, rollout_is_weights.detach().to(loss_mat.dtype), zero)
    return agg_loss(loss_mat, valid, loss_agg_mode, global_tokens, global_seqs, norm_len)


def _prepare(old_log_prob, log_prob, advantages, response_mask):
    """Validate, then zero the padding so garbage there (inf/nan) can't reach values or gradients."""
    check_token_inputs(response_mask, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    valid = as_float_mask(response_mask, log_prob) > 0
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    old = torch.where(valid, old_log_prob.detach().to(log_prob.dtype), zero)
    new = torch.where(valid, log_prob, zero)
    adv = torch.where(valid, advantages.detach().to(log_prob.dtype), zero)
    log_ratio = (new - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return valid, old, new, adv, log_ratio


def _metrics(valid, adv, ratio, log_ratio, low, high, clip_ratio_c=None, clipping=True) -> Metrics:
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    with torch.no_grad():
        if clipping:
            frac_high = masked_mean(((adv > 0) & (ratio > 1 + high)).to(ratio.dtype), valid)
            frac_low = masked_mean(((adv < 0) & (ratio < 1 - low)).to(ratio.dtype), valid)
        else:
            frac_high = frac_low = zero
        if clip_ratio_c is None:
            dual = zero
        else:
            dual = masked_mean(((adv < 0) & (ratio > clip_ratio_c)).to(ratio.dtype), valid)
        return {
            "pg_clipfrac": (frac_high + frac_low).detach(),
            "pg_clipfrac_high": frac_high.detach(),
            "pg_clipfrac_low": frac_low.detach(),
            "pg_clipfrac_dual": dual.detach(),
            "ppo_kl": masked_mean(-log_ratio, valid).detach(),
        }


@register_policy_loss("vanilla")
def vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float],
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """PPO clip: l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old_logp).

    Separate eps_low / eps_high is DAPO's clip-higher. For A < 0 the dual clip (Ye et al. 2020)
    additionally caps the loss at -A * clip_ratio_c, so one token with a huge ratio cannot dominate;
    clip_ratio_c=None disables it.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    valid, _, _, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    loss_mat = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high))
    if clip_ratio_c is not None:
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, -adv * clip_ratio_c), loss_mat)
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _metrics(valid, adv, ratio, log_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c)


@register_policy_loss("gspo")
def gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025), token form: s_i = exp(mean_t (logp_it - old_logp_it)) is the
    length-normalised (geometric-mean) sequence ratio; each token uses
    s_it = sg(s_i) * exp(logp_it - sg(logp_it)), equal to s_i in value and with gradient
    s_i * grad logp_it, clipped like PPO. With advantages constant over a sequence and
    seq-mean-token-mean aggregation (the paper's setting) this is exactly GSPO's gradient.
    The clip ranges are tiny (paper: 3e-4 / 4e-4) because a sequence ratio moves much less than a
    token ratio. The sequence log-ratio (not each token's) is capped at 10 before exp, as in verl;
    the ppo_kl metric is the mean of the unclamped token log-ratios, as verl reports it for GSPO
    (the other losses clamp it at +-20 like their ratio, as verl does for them).
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    valid, old, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    # The per-token log-ratios are averaged unclamped (padding is already zero in both), and only
    # the sequence-level value is capped below: clamping tokens first would change the mean, and
    # the loss, whenever a single token's ratio is extreme.
    seq_log_ratio = masked_mean(new.detach() - old, valid, dim=-1)
    token_log_ratio = (new - new.detach() + seq_log_ratio.unsqueeze(-1)).clamp(max=_SEQ_LOG_RATIO_MAX)
    ratio = torch.exp(token_log_ratio)
    loss_mat = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high))
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _metrics(valid, adv, ratio.detach(), new - old, clip_ratio_low, clip_ratio_high)


@register_policy_loss("cispo")
def cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, 2025): l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp.

    Clipping the (stop-gradient) importance weight instead of the surrogate keeps a gradient on
    every token, including the rare high-ratio "fork" tokens PPO clipping would silence.
    The clip fractions count tokens whose weight was clipped, whatever the advantage's sign.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    valid, _, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    loss_mat = -adv * weight * new
    loss = weighted_agg(loss_mat, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, clip_ratio_low, clip_ratio_high, clipping=False)
    with torch.no_grad():
        metrics["pg_clipfrac_high"] = masked_mean((ratio > 1 + clip_ratio_high).to(ratio.dtype), valid)
        metrics["pg_clipfrac_low"] = masked_mean((ratio < 1 - clip_ratio_low).to(ratio.dtype), valid)
        metrics["pg_clipfrac"] = metrics["pg_clipfrac_high"] + metrics["pg_clipfrac_low"]
    return loss, metrics


@register_policy_loss("gpg")
def gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al. 2025): the original objective, no surrogate: l = -A * logp.
    `old_log_prob` is only used for the ppo_kl metric."""
    valid, _, new, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    loss = weighted_agg(-adv * new, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _metrics(valid, adv, torch.exp(log_ratio), log_ratio, 0.0, 0.0, clipping=False)


@register_policy_loss("reinforce")
def reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """Plain REINFORCE, importance-weighted and unclipped: l = -A * r, r = exp(logp - old_logp).

    Its gradient -A r grad logp is exactly REINFORCE's -A grad logp when the data is on-policy
    (r = 1); when a batch is reused for several updates the ratio keeps it an importance-weighted
    estimate of the current policy's gradient, which -A * logp (see `gpg`) is not.
    """
    valid, _, _, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    loss = weighted_agg(-adv * ratio, valid, rollout_is_weights, loss_agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _metrics(valid, adv, ratio, log_ratio, 0.0, 0.0, clipping=False)


def compute_policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **options: Any,
) -> Tuple[torch.Tensor, Metrics]:
    """Run the loss registered as `name` (actor.policy_loss). Each loss takes only the options it
    declares (e.g. gpg ignores clip ranges); an option no loss knows raises a ValueError."""
    return POLICY_LOSS_REGISTRY.call(name, old_log_prob, log_prob, advantages, response_mask, **options)
