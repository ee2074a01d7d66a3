"""Rollout/training mismatch correction: importance weights pi_old / pi_rollout, truncated (TIS) or
used to reject tokens / sequences (MIS), under verl's names (`algorithm.rollout_correction.*`).

The rollout engine samples from pi_rollout (vLLM: other kernels, precision, TP layout) while the
policy loss treats the samples as drawn from pi_old, the trainer's own log-probs of the same
tokens. The two differ; correcting by rho = pi_old / pi_rollout makes the update an estimate
under pi_old again. Raw ratios have unbounded variance, hence (Liu, Li et al. 2025, "When Speed
Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):

    rollout_is = token:     w_t = min(rho_t, C)                        rho_t = exp(old_t - rollout_t)
    rollout_is = sequence:  w_t = min(prod_t rho_t, C) for every token of the sequence
    rollout_rs = token:     keep_t = lo <= rho_t <= hi
    rollout_rs = sequence:  keep_i = lo <= prod_t rho_t <= hi          (for all tokens of i)
    rollout_rs = geometric: keep_i = lo <= exp(mean_t log rho_t) <= hi

The weight handed to the policy loss is `w * keep` (1 where a part is off). Rejected tokens get
weight 0, so they contribute nothing to the policy loss; the token counts of the aggregation are
left unchanged (verl shrinks the response mask instead), which keeps micro-batch contributions
summing to the full-batch value and a fully rejected sequence legal. Everything is computed once
per step on the whole batch, before the update: both log-probs are fixed during the update.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .masked import as_float_mask, check_same_shape, masked_mean, masked_sum

# log rho is clamped before exp (as the policy losses clamp their log-ratios); a sequence's summed
# log-ratio is truncated in log space, so an extreme sum can never overflow.
_LOG_CLAMP = 20.0

Metrics = Dict[str, torch.Tensor]


def check_rollout_correction(rollout_is: Optional[str], rollout_is_threshold: float, rollout_rs: Optional[str],
                             rollout_rs_threshold: Optional[float], rollout_rs_threshold_lower: Optional[float]
                             ) -> Tuple[float, float]:
    """Validate the settings; returns the rejection bounds (lo, hi) in use (defaults:
    hi = rollout_is_threshold, lo = 1 / hi). The level names (rollout_is, rollout_rs) are the
    section's choices, checked when the config is loaded; the trainer passes the section."""
    prefix = "algorithm.rollout_correction"
    if not rollout_is_threshold > 0:
        raise ConfigError(f"{prefix}.rollout_is_threshold must be > 0; got {rollout_is_threshold}")
    hi = rollout_is_threshold if rollout_rs_threshold is None else rollout_rs_threshold
    lo = 1.0 / hi if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
    if not 0 <= lo < hi:
        raise ConfigError(f"{prefix}: rejection bounds need 0 <= rollout_rs_threshold_lower < "
                          f"rollout_rs_threshold; got {lo} and {hi}")
    return float(lo), float(hi)


@torch.no_grad()
def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    # the algorithm.rollout_correction section's fields, all required: the trainer passes the section
    # (trainer/stages/correction.py), which owns the defaults and the level names
    rollout_is: Optional[str],
    rollout_is_threshold: float,
    rollout_rs: Optional[str],
    rollout_rs_threshold: Optional[float],
    rollout_rs_threshold_lower: Optional[float],
) -> Tuple[Optional[torch.Tensor], Metrics]:
    """(weights `[B, T]` for the policy loss's `rollout_is_weights`, or None when both parts are off;
    metrics). Metrics are always computed (they describe the mismatch even with correction off):

        rollout_corr/kl_k1, kl_k3      KL(pi_rollout || pi_old) estimated on the rollout's samples
        rollout_corr/log_ratio_abs_max max |log rho_t|
        rollout_corr/is_weight_mean, is_weight_max   of the IS weights (rollout_is set)
        rollout_corr/is_truncated_frac  share of the IS units (tokens or sequences) above C
        rollout_corr/rs_masked_frac     share of valid tokens rejected (rollout_rs set)
        rollout_corr/rs_masked_seq_frac share of sequences with at least one rejected token
    """
    lo, hi = check_rollout_correction(rollout_is, rollout_is_threshold, rollout_rs,
                                      rollout_rs_threshold, rollout_rs_threshold_lower)
    # (shapes only: a row with no valid token, an empty reply, is legal here and gets weight 0)
    check_same_shape(old_log_prob, response_mask, "old_log_prob", "response_mask")
    check_same_shape(rollout_log_prob, response_mask, "rollout_log_prob", "response_mask")
    dtype = torch.float64 if old_log_prob.dtype == torch.float64 else torch.float32
    valid = as_float_mask(response_mask, old_log_prob) > 0
    zero = torch.zeros((), dtype=dtype, device=old_log_prob.device)
    log_rho = torch.where(valid, old_log_prob.to(dtype) - rollout_log_prob.to(dtype), zero)
    log_rho = log_rho.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    seq_log_rho = masked_sum(log_rho, valid, dim=-1)  # log prod_t rho_t
    n_tok = valid.sum(dim=-1).clamp(min=1)
    k3 = torch.exp(log_rho) - log_rho - 1  # KL(rollout || old) with samples from rollout: r = old/rollout
    metrics: Metrics = {
        "rollout_corr/kl_k1": masked_mean(-log_rho, valid),
        "rollout_corr/kl_k3": masked_mean(k3, valid),
        "rollout_corr/log_ratio_abs_max": torch.where(valid, log_rho.abs(), zero).max(),
    }
    weights = None
    log_c = torch.log(torch.as_tensor(float(rollout_is_threshold), dtype=dtype))
    if rollout_is == "token":
        weights = torch.exp(log_rho.clamp(max=log_c))
        metrics["rollout_corr/is_truncated_frac"] = masked_mean((log_rho > log_c).to(dtype), valid)
    elif rollout_is == "sequence":
        weights = torch.exp(seq_log_rho.clamp(max=log_c)).unsqueeze(-1).expand_as(log_rho)
        metrics["rollout_corr/is_truncated_frac"] = (seq_log_rho > log_c).to(dtype).mean()
    if weights is not None:
        weights = torch.where(valid, weights, zero)
        metrics["rollout_corr/is_weight_mean"] = masked_mean(weights, valid)
        metrics["rollout_corr/is_weight_max"] = torch.where(valid, weights, zero).max()
    if rollout_rs is not None:
        if rollout_rs == "token":
            stat = log_rho
        elif rollout_rs == "sequence":
            stat = seq_log_rho.unsqueeze(-1).expand_as(log_rho)
        else:  # geometric: the per-token geometric mean of the sequence's ratios
            stat = (seq_log_rho / n_tok).unsqueeze(-1).expand_as(log_rho)
        log_lo = torch.log(torch.as_tensor(lo, dtype=dtype)) if lo > 0 else torch.tensor(float("-inf"), dtype=dtype)
        log_hi = torch.log(torch.as_tensor(hi, dtype=dtype))
        keep = (stat >= log_lo) & (stat <= log_hi)
        rejected = valid & ~keep
        metrics["rollout_corr/rs_masked_frac"] = masked_mean(rejected.to(dtype), valid)
        metrics["rollout_corr/rs_masked_seq_frac"] = rejected.any(dim=-1).to(dtype).mean()
        keep_w = torch.where(valid & keep, torch.ones_like(log_rho), zero)
        weights = keep_w if weights is None else weights * keep_w
    return weights, {k: v.detach().float() for k, v in metrics.items()}
