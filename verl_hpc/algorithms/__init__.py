"""RL algorithm pieces as pure tensor functions, each selectable by name from config.

An algorithm is configuration (estimator + policy loss + KL mode + aggregation), not a new trainer:

    adv, ret   = compute_advantages(cfg.algorithm.adv_estimator, rewards, mask, group_ids=..., ...)
    loss, mets = compute_policy_loss(cfg.actor.policy_loss, old_logp, logp, adv, mask,
                                     clip_ratio_low=..., loss_agg_mode=..., global_tokens=...)
    loss       = PolicyObjective.from_config(cfg.actor)   # what actor.update(batch, loss) minimises

Inputs are right-padded `[batch, response_len]` tensors with a `response_mask`. See
docs/algorithms.md for the formulas and verl_hpc/config/recipes.py for named recipes.
Importing this package fills the registries. Individual estimators and losses are reached by
name (`get_adv_estimator("grpo")`, `get_policy_loss("gpg")`): both registries have a `gpg`.
"""
from .advantages import compute_advantages
from .aggregation import LOSS_AGG_MODES, agg_loss
from .dapo import apply_overlong_penalty, filter_groups, overlong_penalty
from .entropy import (
    entropy_from_logits,
    entropy_from_stats,
    local_exp_stats,
    sum_pi_squared_from_logits,
    local_logit_max,
    process_group_all_reduce,
)
from .kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
    make_kl_controller,
)
from .mismatch import rollout_correction
from .masked import masked_mean, masked_sum, masked_var, masked_whiten, sequence_scores
from .objectives import PolicyObjective, PrmObjective, ValueObjective
from .policy_losses import compute_policy_loss
from . import cov_losses, gmpo  # noqa: F401,E402  (register clip_cov, kl_cov, geo_mean)
from . import dppo, dro, icepop, m2po, sapo  # noqa: F401,E402  (register dppo_tv, dppo_kl, dro, icepop, m2po, sapo)
from .registry import (
    ADV_ESTIMATOR_REGISTRY,
    KL_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    get_adv_estimator,
    get_kl_estimator,
    get_policy_loss,
    register_adv_estimator,
    register_kl_estimator,
    register_policy_loss,
)
from .value_loss import value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "KL_ESTIMATOR_REGISTRY",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "PolicyObjective",
    "PrmObjective",
    "ValueObjective",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "apply_overlong_penalty",
    "compute_advantages",
    "compute_policy_loss",
    "entropy_from_logits",
    "entropy_from_stats",
    "filter_groups",
    "get_adv_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "kl_estimate",
    "kl_loss",
    "local_exp_stats",
    "local_logit_max",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "process_group_all_reduce",
    "register_adv_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "rollout_correction",
    "sequence_scores",
    "sum_pi_squared_from_logits",
    "value_loss",
]
