"""Rewards -> token-level rewards -> advantages: the algorithm part of the step, as configuration.

    scores, metrics = score_batch(scorer, batch, rm=roles.reward_model)    # [B] outcome scores
    token_scores    = to_token_level(scores, batch, cfg)                   # + DAPO overlong shaping
    keep, metrics   = dynamic_sampling_filter(token_scores, batch, cfg)    # DAPO: informative groups
    rewards, m      = kl_in_reward(token_scores, tensors, kl_ctrl, cfg)    # when use_kl_in_reward
    adv, returns    = advantages(cfg, rewards, tensors, group_ids, baselines)
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_hpc.algorithms import (apply_kl_penalty, apply_overlong_penalty, compute_advantages, filter_groups,
                                 sequence_scores)


def score_batch(scorer, batch, rm=None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Outcome score per sequence. Rule scores are deterministic and every rank holds the same
    rows, so every rank scores them (no broadcast); a reward model's forward is a collective."""
    rm_batch = batch.tensors if rm is not None else None
    return scorer.score(batch.ids, batch.data_sources, batch.response_texts, batch.ground_truths,
                        batch.extras, rm_batch=rm_batch)


def to_token_level(scorer, scores: torch.Tensor, batch, cfg) -> Tuple[torch.Tensor, Dict[str, float]]:
    token_scores = scorer.to_token_level(scores, batch.mask)
    ob = cfg.algorithm.overlong_buffer
    if not ob.enable:
        return token_scores, {}
    max_len = cfg.rollout.max_tokens
    token_scores, m = apply_overlong_penalty(token_scores, batch.mask, max_len, ob.len, ob.penalty_factor)
    return token_scores, {f"reward/{k}": float(v) for k, v in m.items()}


def dynamic_sampling_filter(token_scores: torch.Tensor, batch, cfg) -> Tuple[torch.Tensor, Dict[str, float]]:
    """DAPO's filter: groups whose responses all scored the same carry no signal. Returns the keep
    mask (all true when algorithm.filter_groups is off) and counts. Refilling the batch with more
    generation rounds is the trainer's loop (RLTrainer._sample, algorithm.max_num_gen_batches)."""
    if not cfg.algorithm.filter_groups:
        return torch.ones(len(batch), dtype=torch.bool), {}
    keep, counts = filter_groups(sequence_scores(token_scores, batch.mask), batch.group_ids)
    return keep, {f"filter/{k}": float(v) for k, v in counts.items()}


def kl_in_reward(token_scores: torch.Tensor, tensors, kl_ctrl, cfg) -> Tuple[torch.Tensor, Dict[str, float]]:
    """rewards = scores - beta * KL(actor_old || ref) per token, and the controller's update."""
    a = cfg.algorithm
    if not a.use_kl_in_reward:
        return token_scores, {}
    rewards, m = apply_kl_penalty(token_scores, tensors["old_log_probs"], tensors["ref_log_probs"],
                                  tensors["response_mask"], kl_ctrl.value, a.kl_penalty)
    kl = float(m["kl"])
    kl_ctrl.update(kl, n_steps=token_scores.shape[0])
    return rewards, {"reward/kl": kl, "reward/kl_coef": kl_ctrl.value}


def advantages(cfg, rewards: torch.Tensor, tensors, group_ids: torch.Tensor,
               baselines: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    a = cfg.algorithm
    inputs = dict(group_ids=group_ids, gamma=a.gamma, lam=a.lam, norm_adv_by_std=a.norm_adv_by_std)
    if "values" in tensors:
        inputs["values"] = tensors["values"]
    if baselines is not None:
        inputs["reward_baselines"] = baselines
    return compute_advantages(a.adv_estimator, rewards, tensors["response_mask"], **inputs)
