"""On-policy distillation (the `teacher` section): the student samples, a frozen teacher scores each
sampled token, and the student moves toward the teacher on its own samples.

The signal is the per-token reverse KL on the sampled token y_t (a one-sample estimate of
KL(pi || pi_T) at that position):

    kl_t = log pi(y_t | y_<t) - log pi_T(y_t | y_<t)

    reward mode   A_t = A_task_t + coef * -(log pi_old(y_t) - log pi_T(y_t))
                  the distillation advantage is a dense per-token reward taken as its own advantage
                  (no baseline, no discount, no critic: the teacher's log-prob is already a per-token
                  judgement), added to the task advantages of algorithm.adv_estimator; pi_old is the
                  sampling policy, fixed before the update, so the policy loss's clipping and
                  importance ratio apply to it as to any advantage.
    loss mode     L = L_policy + coef * agg(kl_t) over the update's own log pi (actor.loss_agg_mode)
                  The term's value is the k1 estimate (the reverse KL itself), its gradient k2's,
                  kl_t * grad log pi(y_t): the per-token reverse KL's score-function gradient. The
                  plain k1 gradient, grad log pi(y_t), is 0 in expectation over the student's own
                  samples and would teach nothing (verl_hpc/algorithms/kl.py, "k1+").

Both read the teacher's log-probs at rollout.temperature, like the student's (the engines divide
the logits of every lm head by it), so pi and pi_T are compared on one scale.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .aggregation import Count
from .kl import kl_loss
from .masked import as_float_mask, check_token_inputs, masked_mean


def reverse_kl(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor
               ) -> torch.Tensor:
    """kl_t = log pi - log pi_T per sampled token `[B, T]`, 0 on padding."""
    check_token_inputs(response_mask, log_probs=log_probs, teacher_log_probs=teacher_log_probs)
    valid = as_float_mask(response_mask, log_probs) > 0
    kl = log_probs - teacher_log_probs.to(log_probs.dtype)
    return torch.where(valid, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


@torch.no_grad()
def distill_advantages(old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                       response_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """coef * -(log pi_old - log pi_T) per token `[B, T]`, 0 on padding (reward mode)."""
    return -coef * reverse_kl(old_log_probs, teacher_log_probs, response_mask)


@torch.no_grad()
def mix_advantages(task_advantages: torch.Tensor, old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   response_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """The advantages the actor trains on in reward mode: the task's plus the distillation's."""
    check_token_inputs(response_mask, task_advantages=task_advantages)
    valid = as_float_mask(response_mask, task_advantages) > 0
    mixed = task_advantages + distill_advantages(old_log_probs, teacher_log_probs, response_mask,
                                                 coef).to(task_advantages.dtype)
    return torch.where(valid, mixed, torch.zeros_like(mixed))


def distill_loss(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor,
                 coef: float, loss_agg_mode: str, global_tokens: Count = None, global_seqs: Count = None,
                 norm_len: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(coef * agg(kl_t), {"teacher_kl_loss": agg(kl_t)}) of a micro-batch (loss mode): differentiable
    in log_probs, with the value of k1 and the gradient of k2 (module docstring); aggregated as the
    policy loss is, so micro-batch contributions sum to the batch's term."""
    loss, m = kl_loss(log_probs, teacher_log_probs, response_mask, coef, "k1+", loss_agg_mode,
                      global_tokens, global_seqs, norm_len)
    return loss, {"teacher_kl_loss": m["kl_loss"]}


@torch.no_grad()
def teacher_metrics(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor
                    ) -> Dict[str, float]:
    """teacher/kl: the mean reverse KL per valid token of the batch (log pi_old - log pi_T); and
    teacher/log_prob_mean, the teacher's mean log-prob of the student's tokens."""
    kl = reverse_kl(log_probs.double(), teacher_log_probs.double(), response_mask)
    return {"kl": float(masked_mean(kl, response_mask)),
            "log_prob_mean": float(masked_mean(teacher_log_probs.double(), response_mask))}
