"""PRIME (Cui et al. 2025, arXiv 2502.01456): implicit process rewards and how they become advantages.

The implicit PRM is a causal LM pi_prm measured against the reference policy pi_ref:

    q_t     = log pi_prm(y_t | y_<t) - log pi_ref(y_t | y_<t)          per response token
    r_t     = beta * q_t                                              the token's process reward
    score   = sum_t r_t                                               the implicit outcome score (a logit)

Trained from 0/1 outcome labels l (reward.correct_at) only:
    ce        loss = -[l log sigmoid(score) + (1 - l) log(1 - sigmoid(score))]
    pairwise  loss = -log sigmoid(sign * (score - partner)), sign = +1 for a correct response and
              -1 for a wrong one; partner = the mean score, taken before the update, of the responses
              to the same prompt with the other label (0 where there is none: then it is the CE of
              sigmoid(sign * score) against 1)
Both are means over the batch's sequences.

Advantages (`prime` estimator): the process rewards and the outcome rewards each get a leave-one-out
baseline within their group, are combined with coefficients and turned into returns:
    b_i^p   = mean_{j != i} mean_t r_{j,t}          (the other responses' average token reward)
    b_i^o   = mean_{j != i} o_j                     (o: the outcome score, the token rewards' row sum)
    R_{i,t} = c_p (r_{i,t} - b_i^p) + c_o (o_i - b_i^o) [t = last token]
    G_{i,t} = sum_{s >= t} gamma^(s - t) R_{i,s}     returns;  advantages = G whitened over the batch
A group of one has baselines 0. prm.process_loo = verl instead takes verl's recipe's per-token form of
the process baseline, n/(n-1) r_{i,t} - sum_j mean_t r_{j,t} / (n-1) = (r_{i,t} - b_i^p) + (r_{i,t} -
mean_t r_{i,t}) / (n-1) (docs/prime.md, "Conventions").
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.prm import PRM_PROCESS_LOO

from .groups import GroupIds, group_counts, group_index, group_sum
from .masked import (as_float_mask, check_token_inputs, last_token_index, masked_mean, masked_sum, masked_var,
                     masked_whiten, reward_to_go)
from .registry import register_adv_estimator

Pair = Tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- rewards


def implicit_token_rewards(prm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                           response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """r_t = beta * (log pi_prm - log pi_ref) on valid tokens, 0 on padding. Keeps the graph of
    prm_log_probs (the PRM's loss differentiates through it)."""
    check_token_inputs(response_mask, prm_log_probs=prm_log_probs, ref_log_probs=ref_log_probs)
    valid = as_float_mask(response_mask, prm_log_probs) > 0
    q = prm_log_probs - ref_log_probs.to(prm_log_probs.dtype)
    return torch.where(valid, beta * q, torch.zeros((), dtype=q.dtype, device=q.device))


def implicit_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The implicit outcome score `[B]`: the sum of a response's process rewards."""
    return masked_sum(token_rewards, response_mask, dim=-1)


def process_rewards(token_rewards: torch.Tensor, response_mask: torch.Tensor, granularity: str,
                    norm: str) -> torch.Tensor:
    """The rewards the step trains on (prm.granularity, prm.reward_norm):
    token: r_t on every token | whole: sum_t r_t on the last token, 0 elsewhere;
    batch_norm: divided by the largest |sum_{s >= t} r_s| over the batch (+1e-6), so the process
    returns lie in [-1, 1] | none."""
    check_token_inputs(response_mask, token_rewards=token_rewards)
    valid = as_float_mask(response_mask, token_rewards) > 0
    r = torch.where(valid, token_rewards.detach(), torch.zeros((), dtype=token_rewards.dtype))
    if granularity == "whole":
        whole = torch.zeros_like(r)
        rows = torch.arange(r.shape[0], device=r.device)
        whole[rows, last_token_index(response_mask)] = implicit_scores(r, response_mask)
        r = whole
    elif granularity != "token":
        raise ConfigError(f"prm.granularity: {granularity!r}; valid: token, whole")
    if norm == "batch_norm":
        to_go = reward_to_go(r, response_mask, 1.0)
        r = r / (to_go.abs().max() + 1e-6)
    elif norm != "none":
        raise ConfigError(f"prm.reward_norm: {norm!r}; valid: batch_norm, none")
    return r


def outcome_labels(scores: torch.Tensor, correct_at: float) -> torch.Tensor:
    """The verifier's 0/1 label per response: 1 where its outcome score is >= reward.correct_at."""
    return (scores >= correct_at).to(torch.float64 if scores.dtype == torch.float64 else torch.float32)


# ----------------------------------------------------------------------------- the PRM's losses


def ce_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence cross-entropy of sigmoid(score) against the 0/1 label (`[B]`, logits form)."""
    return F.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype), reduction="none")


def pairwise_partners(scores: torch.Tensor, labels: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """Per response, the mean score of the responses to its prompt with the other label (0 where
    there is none). `scores` are taken as constants (the PRM before this update)."""
    codes, n = group_index(group_ids, scores.shape[0], scores.device)
    s, pos = scores.detach().to(torch.float64), (labels > 0.5).to(torch.float64)
    n_pos, n_neg = group_sum(pos, codes, n)[codes], group_sum(1 - pos, codes, n)[codes]
    sum_pos, sum_neg = group_sum(s * pos, codes, n)[codes], group_sum(s * (1 - pos), codes, n)[codes]
    other_sum = torch.where(pos > 0, sum_neg, sum_pos)
    other_n = torch.where(pos > 0, n_neg, n_pos)
    return torch.where(other_n > 0, other_sum / other_n.clamp(min=1), torch.zeros_like(s)).to(scores.dtype)


def pairwise_loss(scores: torch.Tensor, labels: torch.Tensor, partners: torch.Tensor) -> torch.Tensor:
    """Per-sequence -log sigmoid(sign * (score - partner)), sign = 2 * label - 1."""
    sign = 2.0 * (labels.to(scores.dtype) > 0.5).to(scores.dtype) - 1.0
    return -F.logsigmoid(sign * (scores - partners.to(scores.dtype)))


# ----------------------------------------------------------------------------- metrics


def _pair_wins(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Over all pairs (x in a, y in b): 1 where x > y, 0.5 where tied, 0 else."""
    diff = a.unsqueeze(1) - b.unsqueeze(0)
    return (diff > 0).to(torch.float64) + 0.5 * (diff == 0).to(torch.float64)


def prm_metrics(scores: torch.Tensor, labels: torch.Tensor, group_ids: GroupIds) -> Dict[str, float]:
    """How well the implicit scores predict the outcome labels: acc (sigmoid(score) > 0.5 means
    "correct"); auc, the chance that a correct response outscores a wrong one (ties half) over the
    whole batch; group_auc, the same over pairs of responses to one prompt only -- the comparison
    the leave-one-out baseline makes (each only where such pairs exist); label_mean, the share of
    correct responses."""
    s, pos = scores.detach().to(torch.float64), labels > 0.5
    out = {"acc": float(((s > 0) == pos).to(torch.float64).mean()), "label_mean": float(pos.to(torch.float64).mean())}
    if pos.any() and (~pos).any():
        out["auc"] = float(_pair_wins(s[pos], s[~pos]).mean())
    codes, n = group_index(group_ids, s.shape[0], s.device)
    wins = [_pair_wins(s[(codes == g) & pos], s[(codes == g) & ~pos]).flatten() for g in range(n)]
    wins = torch.cat(wins) if wins else torch.zeros(0, dtype=torch.float64)
    if wins.numel():
        out["group_auc"] = float(wins.mean())
    return out


def token_reward_stats(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> Dict[str, float]:
    """Mean and (unbiased) standard deviation of the process rewards over the valid tokens."""
    r = token_rewards.detach().to(torch.float64)
    return {"token_reward_mean": float(masked_mean(r, response_mask)),
            "token_reward_std": float(masked_var(r, response_mask).sqrt())}


# ----------------------------------------------------------------------------- the accuracy filter


def accuracy_filter(labels: torch.Tensor, group_ids: GroupIds, low: float, high: float
                    ) -> Tuple[torch.Tensor, Dict[str, int]]:
    """Keep the groups whose share of correct responses lies in [low, high]. Returns (keep `[B]`
    bool, {"acc_kept_groups", "acc_dropped_groups"})."""
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D [batch]; got shape {tuple(labels.shape)}")
    codes, n = group_index(group_ids, labels.shape[0], labels.device)
    share = group_sum(labels.to(torch.float64), codes, n) / group_counts(codes, n, torch.float64)
    keep_group = (share >= low - 1e-12) & (share <= high + 1e-12)
    kept = int(keep_group.sum())
    return keep_group[codes], {"acc_kept_groups": kept, "acc_dropped_groups": n - kept}


# ----------------------------------------------------------------------------- advantages


def _leave_one_out(x: torch.Tensor, codes: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per row, the mean of x over the other rows of its group (0 for a group of one)."""
    counts = group_counts(codes, n_groups, x.dtype)[codes]
    others = group_sum(x, codes, n_groups)[codes] - x
    return torch.where(counts > 1, others / (counts - 1).clamp(min=1), torch.zeros_like(x))


def _verl_token_scale(r: torch.Tensor, mean_r: torch.Tensor, codes: torch.Tensor, n_groups: int) -> torch.Tensor:
    """verl's recipe's extra term: (r_t - row mean) / (n - 1), so that r_t - b + this = n/(n-1) r_t -
    sum_j mean_j / (n-1). 0 for a group of one (verl divides by n - 1 = 0 there)."""
    counts = group_counts(codes, n_groups, r.dtype)[codes]
    scale = torch.where(counts > 1, 1.0 / (counts - 1).clamp(min=1), torch.zeros_like(counts))
    return scale.unsqueeze(-1) * (r - mean_r.unsqueeze(-1))


@register_adv_estimator("prime")
@torch.no_grad()
def prime(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds,
          process_rewards: torch.Tensor, gamma: float, process_coef: float, outcome_coef: float,
          process_loo: str) -> Pair:
    """PRIME's advantages (module docstring): RLOO-baselined process rewards and outcome, combined
    with process_coef / outcome_coef (prm.*), discounted returns, whitened over the batch.
    token_level_rewards: the outcome score on each response's last token (its row sum is o_i).
    process_loo (prm.process_loo): others, r_t minus the other responses' mean token reward | verl,
    verl's recipe's per-token form, which also scales r_t's deviation from its row mean by n/(n-1)."""
    if process_loo not in PRM_PROCESS_LOO:
        raise ConfigError(f"prm.process_loo: {process_loo!r}; valid: {', '.join(PRM_PROCESS_LOO)}")
    check_token_inputs(response_mask, token_level_rewards=token_level_rewards, process_rewards=process_rewards)
    valid = as_float_mask(response_mask, token_level_rewards) > 0
    codes, n = group_index(group_ids, valid.shape[0], valid.device)
    dtype = token_level_rewards.dtype
    r = torch.where(valid, process_rewards.to(dtype), torch.zeros((), dtype=dtype))
    mean_r = masked_mean(r, valid, dim=-1)
    proc = r - _leave_one_out(mean_r, codes, n).unsqueeze(-1)
    if process_loo == "verl":
        proc = proc + _verl_token_scale(r, mean_r, codes, n)
    proc = torch.where(valid, proc, torch.zeros_like(r))
    o = masked_sum(token_level_rewards, valid, dim=-1)
    out = torch.zeros_like(r)
    rows = torch.arange(valid.shape[0], device=valid.device)
    out[rows, last_token_index(valid)] = o - _leave_one_out(o, codes, n)
    returns = reward_to_go(process_coef * proc + outcome_coef * out, valid, gamma)
    return masked_whiten(returns, valid), returns
