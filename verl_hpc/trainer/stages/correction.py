"""The RL step's rollout/training mismatch correction: a thin adapter from config and the step's
batch to the pure functions of verl_hpc/algorithms/mismatch.py (kept apart from rl.py so that the
step's wiring is a few calls).

    path, why = old_log_prob_path(cfg, batch, has_ref)  -> "bypass" | "forward" | "update"
    old_log_probs(cfg, actor, batch, timer, m)   -> fills batch.old_log_probs (forward or bypass)
    apply(cfg, batch)                             -> batch.rollout_is_weights (+ m2po_keep) + rollout_corr/* metrics

The "update" path (the on-policy shortcut) runs no forward here: with one mini-batch and one
epoch the policy that sampled (after the last weight sync) is the one being updated, so pi_old's
log-probs are the update's own forward, detached (PolicyObjective.old_from_update). The ratio is
then exactly 1 and its gradient is grad log pi: the same step as with a separate forward, which
costs a whole forward over the batch. Anything that reads pi_old before the update forces the
separate forward (see old_log_prob_path).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from verl_hpc.algorithms import masked_mean
from verl_hpc.algorithms.m2po import m2po_keep
from verl_hpc.algorithms.mismatch import rollout_correction
from verl_hpc.config.recipes import BEHAVIOUR_WEIGHTED_POLICY_LOSSES, SUM_PI_SQUARED_ESTIMATORS
from verl_hpc.trainer.stages.batching import logprob_diff_metrics


def old_log_prob_path(cfg, batch, has_ref: bool) -> Tuple[str, str]:
    """(path, why): where this step's pi_old log-probs come from. bypass: the rollout engine's
    (rollout_correction.bypass_mode); update: the actor update's own forward (on-policy shortcut);
    forward: a separate actor forward before the update, when anything needs them earlier or the
    update takes several optimizer steps (the 2nd mini-batch / epoch is no longer on-policy)."""
    rc, a, asy = cfg.algorithm.rollout_correction, cfg.actor, cfg.async_training
    if _bypass(cfg):
        return "bypass", ("algorithm.rollout_correction.bypass_mode" if rc.bypass_mode else
                          "async_training.objective=behaviour: the ratio against the rollout's log-probs")
    mini = a.ppo_mini_batch_size * max(cfg.rollout.n, 1)
    needs = [why for why, on in (
        ("actor.old_log_probs=forward", a.old_log_probs == "forward"),
        (f"actor.ppo_epochs={a.ppo_epochs}", a.ppo_epochs > 1),
        (f"{len(batch)} sequences > one mini-batch of {mini}", len(batch) > mini),
        ("algorithm.rollout_correction.rollout_is/rollout_rs", bool(rc.level(cfg) or rc.rollout_rs)),
        ("algorithm.use_kl_in_reward", cfg.algorithm.use_kl_in_reward and has_ref),
        ("teacher.enable: teacher/kl (and in reward mode the advantages) read pi_old", cfg.teacher.enable),
        ("actor.policy_loss=m2po: its mask is a statistic of the whole batch's pi_old", a.policy_loss == "m2po"),
        (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: the advantages read pi_old and its sum_v pi_v^2",
         cfg.algorithm.adv_estimator in SUM_PI_SQUARED_ESTIMATORS),
        # the policy that sampled is up to k updates older: pi_old is the proximal policy, recomputed
        ("async_training: off-policy samples (decoupled objective)", asy.off_policy),
    ) if on]
    if needs:
        return "forward", ", ".join(needs)
    return "update", "one mini-batch, one epoch: on-policy"


def _bypass(cfg) -> bool:
    """pi_old := the rollout's log-probs: bypass_mode, or the async behaviour objective."""
    asy = cfg.async_training
    return bool(cfg.algorithm.rollout_correction.bypass_mode or (asy.off_policy and asy.objective == "behaviour"))


def on_policy_metrics(m: Dict[str, float]) -> None:
    """Rename what the shortcut's objective reported under actor/ to the separate pass's names."""
    for ours, theirs in (("actor/rollout_logprob_diff_mean", "rollout/logprob_diff_mean"),
                         ("actor/rollout_kl_k1", "rollout_corr/kl_k1"), ("actor/rollout_kl_k3", "rollout_corr/kl_k3")):
        if ours in m:
            m[theirs] = m.pop(ours)


def uncorrected_risk(cfg) -> Optional[str]:
    """What a job with a quantized rollout and the mismatch correction turned off risks (said once,
    at start), or None."""
    rc, r = cfg.algorithm.rollout_correction, cfg.rollout
    if not r.quantized or rc.level(cfg) or rc.rollout_rs or _bypass(cfg) \
            or cfg.actor.policy_loss in BEHAVIOUR_WEIGHTED_POLICY_LOSSES:
        return None
    return (f"rollout.quantization = {r.quantization} with algorithm.rollout_correction off (rollout_is and "
            "rollout_rs null): the update takes samples of the quantized policy as the trainer's own, so the "
            "rollout/training mismatch is neither corrected nor bounded; it is measured (rollout_corr/kl_k3, and "
            "rollout_corr/kl_trend against the first steps) and has been seen to grow 3x within 32 steps under "
            "per-tensor FP8; set rollout_is = auto (TIS) or rollout_rs = token (MIS) to correct it")


def old_log_probs(cfg, actor, batch, timer, m: Dict[str, float]) -> None:
    """pi_old's log-probs of the sampled tokens: the actor's forward, or in bypass mode the rollout
    engine's own (valid when the two engines agree closely: docs/algorithms.md)."""
    if _bypass(cfg):
        batch.old_log_probs = batch.rollout_log_probs.to(batch.mask.dtype).clone()
        return
    with timer("old_logprob"):  # old_log_probs, entropy (and for the optimal token baseline sum_pi_squared)
        otb = cfg.algorithm.adv_estimator in SUM_PI_SQUARED_ESTIMATORS
        batch.fill(actor.log_probs(batch, sum_pi_squared=True) if otb else actor.log_probs(batch))
    m["actor/entropy"] = float(masked_mean(batch.entropy, batch.mask))
    if hasattr(actor, "route_metrics"):  # routing replay: rollout's routes vs the actor's own router
        m.update(actor.route_metrics())


def apply(cfg, batch) -> Dict[str, float]:
    """Weights for the policy loss (batch.rollout_is_weights, None when correction is off), M2PO's
    mask (batch.m2po_keep, policy_loss m2po) and the mismatch metrics."""
    rc = cfg.algorithm.rollout_correction
    mask, old = batch.mask, batch.old_log_probs
    m = {} if _bypass(cfg) else logprob_diff_metrics(batch.rollout_log_probs, old, mask)
    if cfg.actor.policy_loss == "m2po":  # once per step, over the whole batch: every split sees one mask
        keep, m2 = m2po_keep(old, batch.rollout_log_probs, mask, cfg.actor.m2_threshold)
        batch.m2po_keep = keep
        m.update({k: float(v) for k, v in m2.items()})
    # the decoupled objective (AReaL): each token weighted by pi_proximal / pi_behaviour, token-level
    # unless the rollout_correction section says otherwise; not under a loss that weights tokens by that
    # ratio itself (icepop)
    decoupled = (cfg.async_training.off_policy and cfg.async_training.objective == "decoupled"
                 and cfg.actor.policy_loss not in BEHAVIOUR_WEIGHTED_POLICY_LOSSES)
    mode = rc.level(cfg) or ("token" if decoupled else None)
    weights, metrics = rollout_correction(old, batch.rollout_log_probs, mask, mode,
                                          rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold,
                                          rc.rollout_rs_threshold_lower)
    if weights is not None:
        batch.rollout_is_weights = weights.to(old.dtype)
    m.update({k: float(v) for k, v in metrics.items()})
    return m
