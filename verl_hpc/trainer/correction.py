"""The RL step's rollout/training mismatch correction: a thin adapter from config and the step's
batch to the pure functions of verl_hpc/algorithms/mismatch.py (kept apart from rl.py so that the
step's wiring is a few calls).

    old_log_probs(cfg, actor, batch, timer, m)   -> fills batch.old_log_probs (forward or bypass)
    apply(cfg, batch)                             -> batch.rollout_is_weights + rollout_corr/* metrics
"""
from __future__ import annotations

from typing import Dict

import torch

from verl_hpc.algorithms import masked_mean
from verl_hpc.algorithms.mismatch import rollout_correction
from verl_hpc.trainer.batching import logprob_diff_metrics


def old_log_probs(cfg, actor, batch, timer, m: Dict[str, float]) -> None:
    """pi_old's log-probs of the sampled tokens: the actor's forward, or in bypass mode the rollout
    engine's own (valid when the two engines agree closely: docs/algorithms.md)."""
    if cfg.algorithm.rollout_correction.bypass_mode:
        batch.old_log_probs = batch.rollout_log_probs.to(batch.mask.dtype).clone()
        return
    with timer("old_logprob"):
        batch.fill(actor.log_probs(batch))  # old_log_probs, entropy
    m["actor/entropy"] = float(masked_mean(batch.entropy, batch.mask))


def apply(cfg, batch) -> Dict[str, float]:
    """Weights for the policy loss (batch.rollout_is_weights, None when correction is off) and
    the mismatch metrics; the test hook trainer.inject_rollout_logprob_shift first replaces the
    rollout log-probs by old - shift (an engine that agrees with the trainer up to `shift`)."""
    rc = cfg.algorithm.rollout_correction
    mask, old = batch.mask, batch.old_log_probs
    shift = cfg.trainer.inject_rollout_logprob_shift
    if shift is not None:
        batch.rollout_log_probs = torch.where(mask > 0, old - float(shift), torch.zeros_like(old))
    m = {} if rc.bypass_mode else logprob_diff_metrics(batch.rollout_log_probs, old, mask)
    weights, metrics = rollout_correction(old, batch.rollout_log_probs, mask, rc.rollout_is,
                                          rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold,
                                          rc.rollout_rs_threshold_lower)
    if weights is not None:
        batch.rollout_is_weights = weights.to(old.dtype)
    m.update({k: float(v) for k, v in metrics.items()})
    return m
