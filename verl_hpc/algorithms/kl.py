"""KL between the policy and the reference model: estimators, reward penalty, loss term, and the
fixed / adaptive coefficient controllers.

Estimators take per-token log-probs of the *sampled* tokens, logp under the policy and ref_logp
under the reference, and estimate KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3
note, http://joschu.net/blog/kl-approx.html). Both the short and verl names are accepted:

    k1 | kl          logp - ref_logp                                 unbiased, can be negative
    abs              |logp - ref_logp|
    k2 | mse         0.5 * (logp - ref_logp)^2                       biased, low variance
    k3 | low_var_kl  exp(ref_logp - logp) - (ref_logp - logp) - 1    unbiased, >= 0, clamped to [-10, 10]
    k1+ / k3+        the value of k1 / k3 with k2's gradient (straight-through), as verl's "+" names

Two ways to use them (config picks): `algorithm.use_kl_in_reward` subtracts beta * KL from the
token-level rewards before advantages (PPO/InstructGPT, beta from a controller); `actor.use_kl_loss`
adds kl_loss_coef * agg(KL) to the actor loss (GRPO).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count, agg_loss
from .masked import as_float_mask, check_token_inputs, masked_mean
from .registry import KL_ESTIMATOR_REGISTRY, register_kl_estimator

# k3's exp(ref - logp) overflows for large gaps; the inner clamp bounds exp, the outer one bounds
# the estimate itself so that one badly-off token cannot dominate the penalty (as verl does).
_K3_INNER_CLAMP = 20.0
K3_CLAMP = 10.0


@register_kl_estimator("k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("k2", "mse")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    log_r = (ref_log_prob - log_prob).clamp(-_K3_INNER_CLAMP, _K3_INNER_CLAMP)
    return (torch.exp(log_r) - log_r - 1).clamp(-K3_CLAMP, K3_CLAMP)


def _straight_through_k2(value: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """`value` forward, k2's gradient backward: k1 and k3 are unbiased estimates of KL's value but
    their gradients are not unbiased estimates of KL's gradient (k2's is, for the sampled-token
    estimate of grad KL(policy || ref)), so the "+" variants keep the value and swap the gradient."""
    k2 = kl_k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + value.detach()


@register_kl_estimator("k1+")
def kl_k1_plus(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return _straight_through_k2(kl_k1(log_prob, ref_log_prob), log_prob, ref_log_prob)


@register_kl_estimator("k3+")
def kl_k3_plus(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return _straight_through_k2(kl_k3(log_prob, ref_log_prob), log_prob, ref_log_prob)


def kl_estimate(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor, kind: str = "k1"
) -> torch.Tensor:
    """Per-token KL estimate `[B, T]` by estimator name, 0 on padding."""
    fn = KL_ESTIMATOR_REGISTRY.get(kind)
    check_token_inputs(response_mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    valid = as_float_mask(response_mask, log_prob) > 0
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    # Zero both inputs on padding first so garbage there cannot produce inf/nan gradients.
    kl = fn(torch.where(valid, log_prob, zero), torch.where(valid, ref_log_prob.to(log_prob.dtype), zero))
    return torch.where(valid, kl, zero)


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str,  # algorithm.kl_penalty; the caller binds the section
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """KL as a reward penalty: rewards_t = scores_t - kl_coef * KL_t on every valid token.

    log_prob is the rollout policy's (old) log-prob. metrics["kl"] is the batch mean of each
    sequence's mean per-token KL, the quantity an adaptive controller is updated with:
    `ctrl.update(float(metrics["kl"]), n_steps=batch_size)`.
    """
    check_token_inputs(response_mask, token_level_scores=token_level_scores)
    kl = kl_estimate(log_prob, ref_log_prob, response_mask, kl_penalty).to(token_level_scores.dtype)
    valid = as_float_mask(response_mask, token_level_scores) > 0
    rewards = torch.where(valid, token_level_scores - kl_coef * kl, torch.zeros_like(kl))
    current_kl = masked_mean(kl, valid, dim=-1).mean()
    return rewards, {"kl": current_kl, "kl_coef": torch.tensor(float(kl_coef))}


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_coef: float,
    kl_loss_type: str,  # actor.kl_loss_type / loss_agg_mode: PolicyObjective binds the section
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """KL as a loss term: returns (kl_loss_coef * agg(KL), {"kl_loss": agg(KL), "kl_loss_coef"}),
    differentiable w.r.t. log_prob (the current policy); add the first value to the actor loss."""
    kl = kl_estimate(log_prob, ref_log_prob.detach(), response_mask, kl_loss_type)
    value = agg_loss(kl, response_mask, loss_agg_mode, global_tokens, global_seqs, norm_len)
    metrics = {"kl_loss": value.detach(), "kl_loss_coef": torch.tensor(float(kl_loss_coef))}
    return kl_loss_coef * value, metrics


class FixedKLController:
    """A constant coefficient (algorithm.kl_ctrl.type = fixed)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:  # noqa: ARG002 - same interface
        return None

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019 (used by PPO-RLHF): steer the observed KL towards target_kl.

    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    The clip bounds how much one noisy batch can move beta; n_steps / horizon sets the time scale
    (n_steps is the number of samples in the batch the KL was measured on).
    """

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.target_kl must be > 0; got {target_kl}")
        if horizon <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.horizon must be > 0; got {horizon}")
        super().__init__(kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# name -> builder(kl_coef, target_kl, horizon): the controllers this module implements, so that an
# unknown name is answered with what exists here rather than with a copy of the config's list
_CONTROLLERS = {
    "fixed": lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef),
    "adaptive": AdaptiveKLController,
}
KL_CONTROLLER_TYPES = tuple(_CONTROLLERS)


def make_kl_controller(type: str, kl_coef: float, target_kl: float, horizon: int
                       ) -> Union[FixedKLController, AdaptiveKLController]:
    """Build the controller named by algorithm.kl_ctrl.type (argument names = config fields, all
    required: the trainer passes the algorithm.kl_ctrl section, which owns the defaults)."""
    if type not in _CONTROLLERS:
        raise ConfigError(
            f"unknown KL controller {type!r} in algorithm.kl_ctrl.type; valid names: "
            + ", ".join(KL_CONTROLLER_TYPES)
        )
    return _CONTROLLERS[type](kl_coef, target_kl, horizon)
