"""Group-relative outcome advantage estimators: GRPO (and Dr.GRPO, pass@k), RLOO, REINFORCE++-baseline,
OPO and GPG.

All take outcome rewards as token-level rewards `[B, T]` (the score sits on the last valid token;
the masked row sum is the sequence score s_i) and a per-sample group id (the prompt). They return
`(advantages, returns)` `[B, T]`: one value per sequence broadcast over its valid tokens, 0 on
padding, and returns == advantages (there is no critic to regress on them).

Samples of one group must all be in the batch passed here (groups are never split across calls).
"""
from __future__ import annotations

from typing import Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .groups import GROUP_STD_EPS, GroupIds, group_counts, group_index, group_mean_std, group_sum
from .masked import as_float_mask, check_token_inputs, masked_whiten, sequence_scores
from .registry import register_adv_estimator

Pair = Tuple[torch.Tensor, torch.Tensor]


def _prepare(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds):
    check_token_inputs(response_mask, token_level_rewards=token_level_rewards)
    scores = sequence_scores(token_level_rewards, response_mask)
    codes, n_groups = group_index(group_ids, scores.shape[0], scores.device)
    return scores, codes, n_groups


def _broadcast(seq_adv: torch.Tensor, response_mask: torch.Tensor) -> Pair:
    valid = as_float_mask(response_mask, seq_adv) > 0
    zero = torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device)
    adv = torch.where(valid, seq_adv.unsqueeze(-1), zero)
    return adv, adv.clone()


@register_adv_estimator("grpo")
@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_adv_by_std: bool,
    eps: float = GROUP_STD_EPS,
) -> Pair:
    """GRPO (DeepSeekMath): A_i = (s_i - mean_g) / (std_g + eps), std the unbiased sample std.

    norm_adv_by_std=False gives Dr.GRPO's A_i = s_i - mean_g (no division by the group's spread,
    which over-weights prompts that are nearly always solved or nearly always failed).
    A group of one sample uses mean 0 and std 1.
    """
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    mean, std = group_mean_std(scores, codes, n_groups)
    adv = (scores - mean) / (std + eps) if norm_adv_by_std else scores - mean
    return _broadcast(adv, response_mask)


@register_adv_estimator("rloo")
@torch.no_grad()
def rloo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds) -> Pair:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - (1/(n-1)) sum_{j != i} s_j within a group of n.
    A group of one has no other sample, so its baseline is 0 and A_i = s_i (as in verl)."""
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    counts = group_counts(codes, n_groups, scores.dtype)[codes]
    others = group_sum(scores, codes, n_groups)[codes] - scores
    baseline = torch.where(counts > 1, others / (counts - 1).clamp(min=1), torch.zeros_like(scores))
    return _broadcast(scores - baseline, response_mask)


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> Pair:
    """REINFORCE++-baseline: subtract the group mean (singleton: 0), broadcast to tokens, then
    whiten over all valid tokens of the batch (mean/std of the token-level values, unbiased)."""
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    mean, _ = group_mean_std(scores, codes, n_groups)
    adv, _ = _broadcast(scores - mean, response_mask)
    adv = masked_whiten(adv, response_mask)
    return adv, adv.clone()


@register_adv_estimator("opo")
@torch.no_grad()
def opo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds) -> Pair:
    """OPO (Hao et al. 2025, on-policy RL with optimal baseline): the baseline is the
    length-weighted group mean b_g = sum_j |y_j| s_j / sum_j |y_j|; A_i = s_i - b_g.
    A group of one gets baseline 0 (as in verl)."""
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    lengths = as_float_mask(response_mask, scores).sum(dim=-1)
    counts = group_counts(codes, n_groups, scores.dtype)[codes]
    weighted = group_sum(lengths * scores, codes, n_groups) / group_sum(lengths, codes, n_groups)
    weighted = weighted[codes]
    baseline = torch.where(counts > 1, weighted, torch.zeros_like(scores))
    return _broadcast(scores - baseline, response_mask)


@register_adv_estimator("gpg")
@torch.no_grad()
def gpg(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds) -> Pair:
    """GPG (Chu et al. 2025): A_i = alpha * (s_i - mean_g) / F_norm with F_norm = 1 and the
    gradient-bias correction alpha = B / (B - M), M the number of samples in groups (of size > 1)
    whose rewards are all equal: those samples carry zero advantage, so without alpha the batch's
    gradient would be shrunk by the fraction of such "invalid" samples. Singleton: mean 0."""
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    mean, _ = group_mean_std(scores, codes, n_groups)
    counts = group_counts(codes, n_groups, scores.dtype)
    g_max = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    g_min = torch.full((n_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    g_max = g_max.scatter_reduce(0, codes, scores, reduce="amax")
    g_min = g_min.scatter_reduce(0, codes, scores, reduce="amin")
    invalid_group = (g_max == g_min) & (counts > 1)
    batch = scores.shape[0]
    n_invalid = int(invalid_group[codes].sum().item())
    alpha = batch / max(batch - n_invalid, 1)
    return _broadcast(alpha * (scores - mean), response_mask)


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_adv_by_std: bool,
    eps: float = GROUP_STD_EPS,
) -> Pair:
    """Pass@k advantage (arXiv 2503.19595, as verl's `grpo_passk`): a group of k answers is worth
    its best answer, so only the best sample of each group gets a nonzero advantage, the margin by
    which it improves the group's pass@k: A = s_max - s_second_max (divided by std_g + eps when
    norm_adv_by_std); every other sample gets 0. Ties: the first sample (batch order) with the
    maximum is "the best", and its margin is then 0, so the choice does not change the result.
    Every group needs at least two samples (rollout.n >= 2)."""
    scores, codes, n_groups = _prepare(token_level_rewards, response_mask, group_ids)
    counts = group_counts(codes, n_groups, scores.dtype)
    small = (counts < 2).nonzero().flatten()
    if small.numel():
        first_rows = [int((codes == g).nonzero()[0]) for g in small[:10].tolist()]
        raise ConfigError(f"grpo_passk needs >= 2 samples per group (rollout.n >= 2); the groups of "
                          f"rows {first_rows} have one")
    batch = scores.shape[0]
    neg_inf = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    g_max = neg_inf.scatter_reduce(0, codes, scores, reduce="amax")
    rows = torch.arange(batch, device=scores.device)
    at_max = torch.where(scores == g_max[codes], rows, torch.full_like(rows, batch))
    best = torch.full((n_groups,), batch, dtype=rows.dtype, device=rows.device)
    best = best.scatter_reduce(0, codes, at_max, reduce="amin")  # first row holding the maximum
    is_best = rows == best[codes]
    others = torch.where(is_best, torch.full_like(scores, float("-inf")), scores)
    second = neg_inf.scatter_reduce(0, codes, others, reduce="amax")
    margin = g_max - second
    if norm_adv_by_std:
        _, std = group_mean_std(scores, codes, n_groups)
        margin = margin[codes] / (std + eps)
    else:
        margin = margin[codes]
    return _broadcast(torch.where(is_best, margin, torch.zeros_like(scores)), response_mask)
