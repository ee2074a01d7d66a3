"""Optimal token baseline (OTB), verl's `optimal_token_baseline` and its tool-integrated variant
`tir_optimal_token_baseline` (Yingru Li, "Optimal Token Baseline", 2025; verl docs/algo/otb.md).

A group-mean baseline gives every token of a response the same baseline. The variance-optimal
baseline of the token-level policy gradient weights each trajectory by the squared norm of its
score function up to that token, which the logit-gradient proxy estimates from forward
probabilities alone: for a softmax policy ||grad_logits log pi(y_j)||^2 = 1 - 2 pi_j + sum_v pi_v^2.
With rewards-to-go G_t and the path energy W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi_{j,v}^2):

    b_t = sum_{i in g} G_{i,t} W_{i,t} / (sum_{i in g} W_{i,t} + 1e-8)     (over the group's
          trajectories that have a valid token t; a group of one: b = 0)
    A_{i,t} = G_{i,t} - b_t

pi_j is pi_old's probability of the sampled token (`old_log_probs`) and sum_v pi_v^2 the engine's
`sum_pi_squared` (the actor's old-log-prob forward computes it when the estimator asks). With
rollout-correction weights rho_t (truncated IS) each term is scaled by rho_t^2 (the weights' MSE-
optimal form). `optimal_token_baseline` indexes t by position in the response; the tool-integrated
variant by rank among the response's own (loss-mask 1) tokens, so in multi-turn episodes the model's
k-th token is compared with the others' k-th model token whatever tool output came between. Both
zero the baseline of a group's unique longest trajectory beyond the second longest (there the
"group" is that trajectory alone, whose baseline would cancel its return): verl's `handle_zero_tail`,
on by default in both of its estimators (verl 0.9.1; for the plain one since verl PR 5380, Feb 2026).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .groups import GroupIds, group_counts, group_index
from .masked import as_float_mask, check_token_inputs, reward_to_go
from .registry import register_adv_estimator

Pair = Tuple[torch.Tensor, torch.Tensor]
_EPS = 1e-8  # verl's epsilon in the baseline's denominator


def path_energy(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, valid: torch.Tensor,
                rollout_is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token w_t = (1 - 2 pi_t + sum_v pi_v^2) (x rho_t^2), 0 on padding."""
    dtype = old_log_probs.dtype
    w = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dtype) ** 2
    return torch.where(valid, w, torch.zeros_like(w))


def _group_baseline(returns: torch.Tensor, energy: torch.Tensor, present: torch.Tensor, codes: torch.Tensor,
                    n_groups: int, lengths: torch.Tensor, zero_tail: bool) -> torch.Tensor:
    """b [B, L] over columns (positions or token ranks): sum G W / (sum W + eps) over each group's
    rows present at the column; 0 for groups of one; the zero-tail rule when asked."""
    num = torch.zeros(n_groups, returns.shape[1], dtype=returns.dtype, device=returns.device)
    den = torch.zeros_like(num)
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    num.index_add_(0, codes, torch.where(present, returns * energy, zero))
    den.index_add_(0, codes, torch.where(present, energy, zero))
    base = (num / (den + _EPS))[codes]
    single = group_counts(codes, n_groups, returns.dtype)[codes] == 1
    base = torch.where(single.unsqueeze(-1), zero, base)
    if zero_tail:
        for g in range(n_groups):
            rows = (codes == g).nonzero().flatten()
            if rows.numel() < 2:
                continue
            lens = lengths[rows]
            top, second = torch.topk(lens, 2).values.tolist()
            if top > second:  # one trajectory alone beyond the second longest
                base[rows[int(torch.argmax(lens))], int(second):] = 0.0
    return base


def _inputs(token_level_rewards, response_mask, group_ids, old_log_probs, sum_pi_squared, rollout_is_weights):
    check_token_inputs(response_mask, token_level_rewards=token_level_rewards, old_log_probs=old_log_probs,
                       sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights)
    valid = as_float_mask(response_mask, token_level_rewards) > 0
    returns = reward_to_go(token_level_rewards, valid, 1.0)
    energy = path_energy(old_log_probs.to(token_level_rewards.dtype), sum_pi_squared, valid, rollout_is_weights)
    codes, n_groups = group_index(group_ids, valid.shape[0], valid.device)
    return valid, returns, torch.cumsum(energy, dim=-1), codes, n_groups


@register_adv_estimator("optimal_token_baseline")
@torch.no_grad()
def optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Pair:
    """A_t = G_t - b_t with b_t the group's W-weighted mean of G at position t, 0 for a group's unique
    longest response past the second longest (module docstring); returns = G (the undiscounted
    reward-to-go), both 0 on padding."""
    valid, returns, energy, codes, n_groups = _inputs(token_level_rewards, response_mask, group_ids,
                                                      old_log_probs, sum_pi_squared, rollout_is_weights)
    base = _group_baseline(returns, energy, valid, codes, n_groups, valid.sum(-1), zero_tail=True)
    zero = torch.zeros_like(returns)
    return torch.where(valid, returns - base, zero), returns


@register_adv_estimator("tir_optimal_token_baseline")
@torch.no_grad()
def tir_optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Pair:
    """As optimal_token_baseline with t the rank of a token among its response's valid tokens (holes
    of tool output skipped), the zero tail counted in ranks. returns = G at positions, 0 on padding and holes."""
    valid, returns, energy, codes, n_groups = _inputs(token_level_rewards, response_mask, group_ids,
                                                      old_log_probs, sum_pi_squared, rollout_is_weights)
    lengths = valid.sum(-1)
    rank = torch.cumsum(valid.long(), dim=-1) - 1  # the k of each valid token
    rows = torch.arange(valid.shape[0], device=valid.device).unsqueeze(-1).expand_as(rank)
    width = int(lengths.max())
    packed_g = returns.new_zeros(valid.shape[0], width)
    packed_w = torch.zeros_like(packed_g)
    packed_g[rows[valid], rank[valid]] = returns[valid]
    packed_w[rows[valid], rank[valid]] = energy[valid]
    present = torch.arange(width, device=valid.device) < lengths.unsqueeze(-1)
    base = _group_baseline(packed_g, packed_w, present, codes, n_groups, lengths, zero_tail=True)
    adv = torch.zeros_like(returns)
    adv[valid] = (packed_g - base)[rows[valid], rank[valid]]
    return adv, returns
