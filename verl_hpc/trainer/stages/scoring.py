"""Responses -> scores: the rewards stage of the step (fills StepBatch.token_scores).

    scores, metrics = score_batch(scorer, batch, rm=roles.reward_model)    # [B] outcome scores
    token_scores, m = to_token_level(scorer, scores, batch, cfg)           # + DAPO overlong shaping
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from verl_hpc.algorithms import apply_overlong_penalty


def score_batch(scorer, batch, rm=None, components: Sequence[str] = ()) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Outcome score per sequence. Rule scores are deterministic and every rank holds the same
    rows, so every rank scores them (no broadcast); a reward model's forward is a collective.
    `components` (GDPO's algorithm.gdpo_reward_keys): also batch.reward_components [B, K], each
    key's number in the reward function's returned dict."""
    rm_batch = None
    if rm is not None:  # a judge reads text (its own inputs); a scorer the engines' token batch
        rm_batch = rm.inputs(batch) if hasattr(rm, "inputs") else batch.engine_batch()
    args = (batch.ids, batch.data_sources, batch.response_texts, batch.ground_truths, batch.extras)
    if not components:
        return scorer.score(*args, rm_batch=rm_batch)
    scores, batch.reward_components, metrics = scorer.score_with_components(*args, rm_batch=rm_batch,
                                                                            keys=components)
    return scores, metrics


def agent_rows(result) -> bool:
    """agent.enable: the rows are agent runs', scored by their runs' own rewards; no reward function
    runs on them (a data_source without one is fine)."""
    return any(getattr(e, "agent", None) is not None for e in (result.episodes or ()))


def given_rewards(scores: Optional[torch.Tensor], result, metrics: Dict[str, float]) -> Optional[torch.Tensor]:
    """agent.enable: a row's score is the reward its agent run returned (EpisodeStats.agent.reward),
    not the reward function's (`scores` may be None: none was run). reward/score/mean is the runs'
    mean, each run counted once however many rows its calls made (agent/reward_mean)."""
    given = [(row, e.agent) for row, e in enumerate(result.episodes or ()) if getattr(e, "agent", None)]
    if not given:
        return scores
    scores = torch.zeros(len(result)) if scores is None else scores.clone()
    for row, stats in given:
        scores[row] = stats.reward
    runs = [stats.reward for _, stats in given if stats.sample_first]
    metrics["reward/score/mean"] = sum(runs) / max(len(runs), 1)
    for key in [k for k in metrics if k.startswith("reward/score/") and k != "reward/score/mean"]:
        del metrics[key]  # per data_source means of the function's scores: not what was trained on
    return scores


def add_turn_rewards(token_scores: torch.Tensor, result) -> None:
    """multi_turn: each episode's per-turn reward terms (an environment's step rewards, the tool
    error penalty) added in place on the last model token of their turn."""
    for row, stats in enumerate(result.episodes or ()):
        for pos, value in stats.turn_rewards:
            token_scores[row, pos] += value


def to_token_level(scorer, scores: torch.Tensor, batch, cfg) -> Tuple[torch.Tensor, Dict[str, float]]:
    """[B, T] scores on each response's last token; with algorithm.overlong_buffer DAPO's length
    penalty on the responses that ran into the buffer before the length limit."""
    token_scores = scorer.to_token_level(scores, batch.mask)
    ob = cfg.algorithm.overlong_buffer
    if not ob.enable:
        return token_scores, {}
    max_len = cfg.rollout.max_tokens
    token_scores, m = apply_overlong_penalty(token_scores, batch.mask, max_len, ob.len, ob.penalty_factor)
    return token_scores, {f"reward/{k}": float(v) for k, v in m.items()}
