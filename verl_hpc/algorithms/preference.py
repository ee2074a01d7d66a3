"""Offline preference losses: DPO (sigmoid, with label smoothing = conservative DPO), IPO, SimPO,
ORPO (paired) and KTO (unpaired), as pure functions of per-sequence log-probabilities.

Inputs are `[P]` tensors, one value per example: the SUM of the response tokens' log-probs under
the policy (`*_logps`, with gradient) and under the frozen reference (`ref_*_logps`), plus the
number of response tokens where a loss is length-normalised. `sequence_logps(token_logps, mask)`
builds them from `[B, T]` engine outputs. Every loss returns `(loss, metrics)`; the loss is
`sum_p l_p / N` with N = `global_pairs` when given (a micro-batch then returns its contribution and
contributions sum to the full-batch mean, as for the RL losses) else the local count. Metrics are
the names users of these methods expect (TRL's), detached means over this batch:

    rewards/chosen, rewards/rejected   implicit rewards (DPO: beta (logp - ref_logp))
    rewards/margins                    mean of chosen - rejected reward
    rewards/accuracies                 share of pairs with chosen reward > rejected reward
    logps/chosen, logps/rejected       policy sequence log-probs

Conventions: beta > 0; label_smoothing in [0, 0.5); lengths >= 1. The options (beta, gamma, ...) are
fields of `algorithm.preference` and have no default here: the section owns them and the trainer
passes it (trainer/programs/preference.py), so a default is never written twice.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from verl_hpc.config.errors import ConfigError

from .masked import as_float_mask, check_same_shape, masked_sum

Metrics = Dict[str, torch.Tensor]
Count = Union[int, float, None]


def sequence_logps(token_logps: torch.Tensor, response_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum of valid token log-probs `[B]`, number of valid tokens `[B]`)."""
    check_same_shape(token_logps, response_mask, "token_logps", "response_mask")
    m = as_float_mask(response_mask, token_logps)
    return masked_sum(token_logps, m, dim=-1), m.sum(dim=-1)


def _check(beta: float, label_smoothing: float = 0.0, **tensors: Optional[torch.Tensor]) -> None:
    if not beta > 0:
        raise ConfigError(f"preference.beta must be > 0; got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"preference.label_smoothing must be in [0, 0.5); got {label_smoothing}")
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 1 for s in shapes.values()):
        raise ValueError(f"preference inputs must all be 1-D of one length (one value per example); got {shapes}")


def _mean(x: torch.Tensor, global_pairs: Count) -> torch.Tensor:
    n = float(x.shape[0]) if global_pairs is None else float(global_pairs)
    if n <= 0:
        raise ValueError(f"global_pairs must be positive; got {global_pairs}")
    return x.sum() / n


def _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> Metrics:
    with torch.no_grad():
        return {
            "rewards/chosen": chosen_rewards.detach().mean(),
            "rewards/rejected": rejected_rewards.detach().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).detach().mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logps/rejected": rejected_logps.detach().mean(),
        }


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the preference label is flipped with prob. eps."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             label_smoothing: float, global_pairs: Count = None) -> Tuple[torch.Tensor, Metrics]:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290): z = beta ((pi_c - ref_c) - (pi_r - ref_r)),
    l = -log sigma(z); label_smoothing eps > 0 gives conservative DPO (cDPO, Mitchell 2023):
    l = -(1 - eps) log sigma(z) - eps log sigma(-z)."""
    _check(beta, label_smoothing, c=chosen_logps, r=rejected_logps, rc=ref_chosen_logps, rr=ref_rejected_logps)
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps.detach())
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps.detach())
    losses = _smoothed_sigmoid_loss(chosen_rewards - rejected_rewards, label_smoothing)
    return _mean(losses, global_pairs), _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)


def ipo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             global_pairs: Count = None) -> Tuple[torch.Tensor, Metrics]:
    """IPO (Azar et al. 2023, arXiv 2310.12036): h = (pi_c - ref_c) - (pi_r - ref_r),
    l = (h - 1 / (2 beta))^2: regresses the log-likelihood-ratio gap to a finite target instead of
    pushing it to infinity, so deterministic preferences do not overfit. (Sequence sums, as in the
    paper; TRL divides by lengths first.) Rewards in the metrics: beta (logp - ref_logp)."""
    _check(beta, c=chosen_logps, r=rejected_logps, rc=ref_chosen_logps, rr=ref_rejected_logps)
    chosen_ratio = chosen_logps - ref_chosen_logps.detach()
    rejected_ratio = rejected_logps - ref_rejected_logps.detach()
    losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
    return _mean(losses, global_pairs), _pair_metrics(beta * chosen_ratio, beta * rejected_ratio,
                                                      chosen_logps, rejected_logps)


def simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta: float,
               gamma: float, label_smoothing: float, global_pairs: Count = None
               ) -> Tuple[torch.Tensor, Metrics]:
    """SimPO (Meng et al. 2024, arXiv 2405.14734), reference-free and length-normalised:
    z = beta pi_c / |y_c| - beta pi_r / |y_r| - gamma, l = -log sigma(z) (label smoothing as DPO).
    The paper's defaults are beta 2.0-2.5 and gamma 0.5-1.5 (its gamma is the absolute margin).
    Rewards in the metrics: beta * average log-prob."""
    _check(beta, label_smoothing, c=chosen_logps, r=rejected_logps, lc=chosen_lengths, lr=rejected_lengths)
    _check_lengths(chosen_lengths, rejected_lengths)
    chosen_rewards = beta * chosen_logps / chosen_lengths.to(chosen_logps.dtype)
    rejected_rewards = beta * rejected_logps / rejected_lengths.to(rejected_logps.dtype)
    losses = _smoothed_sigmoid_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    return _mean(losses, global_pairs), _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)


def orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta: float,
              global_pairs: Count = None) -> Tuple[torch.Tensor, Metrics]:
    """ORPO (Hong et al. 2024, arXiv 2403.07691), reference-free: with the average log-probs
    a = logp / |y| and log odds(y) = a - log(1 - exp(a)),
    l = -a_c + beta * -log sigma(log odds(y_c) - log odds(y_r))   (SFT on chosen + odds-ratio term;
    the paper's lambda is beta here, as in TRL). Rewards in the metrics: beta * a."""
    _check(beta, c=chosen_logps, r=rejected_logps, lc=chosen_lengths, lr=rejected_lengths)
    _check_lengths(chosen_lengths, rejected_lengths)
    a_c = chosen_logps / chosen_lengths.to(chosen_logps.dtype)
    a_r = rejected_logps / rejected_lengths.to(rejected_logps.dtype)
    # log(1 - exp(a)) for a < 0, computed stably; a is clamped just below 0 (p = 1 has no odds)
    tiny = torch.finfo(a_c.dtype).eps
    log_odds = lambda a: a - torch.log(-torch.expm1(a.clamp(max=-tiny)))  # noqa: E731
    ratio_term = -F.logsigmoid(log_odds(a_c) - log_odds(a_r))
    losses = -a_c + beta * ratio_term
    metrics = _pair_metrics(beta * a_c, beta * a_r, chosen_logps, rejected_logps)
    metrics["nll_loss"] = (-a_c).detach().mean()
    metrics["log_odds_ratio"] = (log_odds(a_c) - log_odds(a_r)).detach().mean()
    return _mean(losses, global_pairs), metrics


def _check_lengths(*lengths: torch.Tensor) -> None:
    for n in lengths:
        if bool((n < 1).any()):
            rows = (n < 1).nonzero().flatten()[:10].tolist()
            raise ValueError(f"preference: responses at rows {rows} have no token (length < 1)")


def kto_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's z0 = max(0, mean_j (logp(y'_j | x_j) - ref_logp(y'_j | x_j))), the KL(policy || ref)
    estimated on MISMATCHED pairs (prompt j with another example's completion y'_j), detached: the
    paper's reference point, biased but cheap; no gradient flows through it."""
    with torch.no_grad():
        return (kl_logps - ref_kl_logps).mean().clamp(min=0)


def kto_loss(logps, ref_logps, desirable, kl_logps, ref_kl_logps, beta: float,
             desirable_weight: float, undesirable_weight: float, global_pairs: Count = None
             ) -> Tuple[torch.Tensor, Metrics]:
    """KTO (Ethayarajh et al. 2024, arXiv 2402.01306), unpaired: r = logp - ref_logp, z0 the
    reference point above,
        desirable:    l = lambda_D (1 - sigma(beta (r - z0)))
        undesirable:  l = lambda_U (1 - sigma(beta (z0 - r)))
    `desirable` is a `[P]` bool tensor. Metrics: rewards/chosen|rejected = mean beta r over the
    desirable | undesirable examples (0 when there are none), kl = z0, logps/chosen|rejected."""
    _check(beta, l=logps, r=ref_logps, d=desirable)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ConfigError("preference.desirable_weight / undesirable_weight must be >= 0")
    z0 = kto_reference_point(kl_logps, ref_kl_logps)
    r = logps - ref_logps.detach()
    good = desirable.to(torch.bool)
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    with torch.no_grad():
        rewards = beta * r.detach()
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        pick = lambda x, sel: x[sel].mean() if bool(sel.any()) else zero  # noqa: E731
        metrics = {"rewards/chosen": pick(rewards, good), "rewards/rejected": pick(rewards, ~good),
                   "logps/chosen": pick(logps.detach(), good), "logps/rejected": pick(logps.detach(), ~good),
                   "kl": z0}
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return _mean(losses, global_pairs), metrics
