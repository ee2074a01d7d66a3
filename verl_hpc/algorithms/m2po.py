"""M2PO, Second-Moment Trust Policy Optimization ("Prosperity before Collapse: How Far Can Off-Policy
RL Reach with Stale Data on LLMs?", Zheng et al. 2025, arXiv 2510.01161; AReaL's `m2_threshold`), `m2po`.

With stale samples (split placement, k > 0) PPO's ratio clip silences most tokens, the informative
high-ratio ones first. M2PO instead bounds the second moment of the log importance weights between
the policy that sampled (the rollout's, pi_rollout) and pi_old (the trainer's recomputed log-probs):

    M2_t = (log pi_old(y_t) - log pi_rollout(y_t))^2
    mask the tokens with the largest M2_t, the fewest such that the mean M2 of the rest is <= tau
    l_t  = -A_t r_t keep_t,    r_t = pi_theta / pi_old   (no clip: the mask is the trust region)

tau = `actor.m2_threshold` (the paper's and AReaL's 0.04). Only extreme outliers go, so far fewer
tokens lose their gradient than under a clip. The mask is a statistic of the whole batch, but of
quantities fixed during the update (both log-probs), so it is computed once per step over the whole
step batch (`m2po_keep`, trainer/stages/correction.py) and handed to the loss: every micro-batch
split, data-parallel layout or left-out zero-advantage row then sees the same mask, and the loss is
per token. With split placement's decoupled objective the proximal / behaviour token weights apply
on top (as in AReaL, where M2PO runs with its decoupled loss).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count
from .masked import as_float_mask, check_same_shape, masked_mean
from .policy_losses import Metrics, _metrics, _prepare, weighted_agg
from .registry import register_policy_loss


@torch.no_grad()
def m2po_keep(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
              m2_threshold: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(keep `[B, T]` in the log-probs' dtype, 1 = trained on, 0 = masked or padding; metrics) over
    the whole batch given. Tokens are masked in decreasing order of M2 (ties: the earlier in row-major
    order first) until the mean M2 of the kept ones is at most m2_threshold; when even the smallest
    alone exceeds it, every token is masked. Metrics (detached floats): `m2po/m2` (mean M2 before),
    `m2po/m2_kept` (after; 0 with nothing kept), `m2po/masked_frac` (share of valid tokens masked)."""
    if not m2_threshold > 0:
        raise ConfigError(f"actor.m2_threshold (M2PO's second-moment bound) must be > 0; got {m2_threshold}")
    check_same_shape(old_log_prob, response_mask, "old_log_prob", "response_mask")
    check_same_shape(rollout_log_probs, response_mask, "rollout_log_probs", "response_mask")
    dtype = torch.float64 if old_log_prob.dtype == torch.float64 else torch.float32
    valid = (as_float_mask(response_mask, old_log_prob) > 0).flatten()
    d = (old_log_prob.to(dtype) - rollout_log_probs.to(dtype)).flatten()
    m2 = torch.where(valid, d * d, torch.zeros_like(d))
    idx = valid.nonzero().flatten()
    keep = valid.to(dtype).clone()
    n = idx.numel()
    if n:
        order = torch.sort(m2[idx], descending=True, stable=True).indices
        ordered = m2[idx][order]
        # suffix means: the mean M2 of the tokens kept when the first i (largest) are masked
        suffix = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=dtype, device=d.device)
        ok = (suffix <= m2_threshold).nonzero()
        n_masked = int(ok[0]) if ok.numel() else n
        keep[idx[order[:n_masked]]] = 0.0
    kept = keep > 0
    total = max(n, 1)
    metrics = {"m2po/m2": m2.sum() / total,
               "m2po/m2_kept": m2[kept].sum() / max(int(kept.sum()), 1),
               "m2po/masked_frac": (valid & ~kept).sum().to(dtype) / total}
    return keep.view_as(old_log_prob).to(old_log_prob.dtype), {k: v.float() for k, v in metrics.items()}


@register_policy_loss("m2po")
def m2po(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    m2po_keep: Optional[torch.Tensor],
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """l_t = -A_t r_t keep_t, `m2po_keep` [B, T] the whole step batch's mask (`m2po_keep()`, rows
    as this batch's). Masked tokens count in the aggregation's denominators (as rejected tokens of the
    mismatch correction do), so micro-batch contributions add up to the whole batch's loss. No clip
    (clip fractions 0); metric `m2po_masked_frac`: share of this batch's valid tokens masked."""
    if m2po_keep is None:
        raise ConfigError("actor.policy_loss = m2po needs the step's M2PO mask (m2po_keep, computed over the whole "
                          "batch by verl_hpc.algorithms.m2po.m2po_keep) in the batch")
    check_same_shape(m2po_keep, response_mask, "m2po_keep", "response_mask")
    valid, _, _, adv, log_ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    keep = torch.where(valid, m2po_keep.detach().to(log_ratio.dtype), torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    loss = weighted_agg(-adv * ratio * keep, valid, rollout_is_weights, loss_agg_mode, global_tokens,
                        global_seqs, norm_len)
    metrics = _metrics(valid, adv, ratio, log_ratio, 0.0, 0.0, clipping=False)
    with torch.no_grad():
        metrics["m2po_masked_frac"] = masked_mean(1.0 - keep, valid)
    return loss, metrics
