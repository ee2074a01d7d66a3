"""The hook for a learned reward model, and how its score combines with the rules.

The reward model itself runs in the engine's reward role (a TrainingEngine forward over prompt +
response tokens); this module only fixes the contract so the scorer does not depend on the engine:
any object with `score(batch) -> FloatTensor [B]` (or the engine role's {"rm_scores": [B], ...}) is
a RewardModel. `batch` is what the trainer passes: the engines' dict of its rollout batch, or what
the model's own `inputs(step_batch)` makes of it (the generative judge reads text:
verl_hpc/rewards/judge.py); the scorer hands it through untouched.

Combination rule, per sample (reward.reward_model.rule_weight, weight):
    rule_weight x rule score + weight x model score   where a rule exists for the sample's data_source
                                                       (or a custom function is set)
    weight x model score                               where none does
with the model's scores first centred and scaled to unit std over the step's batch under
reward.reward_model.normalize = batch. Without a reward model, a data_source without a rule is an
error (see registry).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from verl_hpc.rewards.errors import RewardError


@runtime_checkable
class RewardModel(Protocol):
    def score(self, batch: Any) -> torch.Tensor:  # FloatTensor [B]: one scalar per response
        ...


def rm_scores(model: RewardModel, batch: Any, size: int) -> torch.Tensor:
    """The model's scores as a float32 CPU tensor [size], checked: a wrong shape is an engine bug
    that would otherwise broadcast silently into the rewards."""
    out = model.score(batch)
    if isinstance(out, dict):  # the engine role's outputs (verl_hpc/engines/roles.py RewardModel)
        out = out["rm_scores"]
    out = torch.as_tensor(out, dtype=torch.float32).detach().cpu().reshape(-1)
    if out.numel() != size:
        raise RewardError(f"reward model returned {out.numel()} scores for a batch of {size} responses")
    if not torch.isfinite(out).all():
        raise RewardError(f"reward model returned non-finite scores: {out.tolist()}")
    return out


def normalize(rm: torch.Tensor, how: str) -> torch.Tensor:
    """none: as the model gives them; batch: (rm - mean) / std over the batch (std 0 or one row:
    centred only, there is no spread to scale)."""
    if how == "none" or rm.numel() == 0:
        return rm
    if how != "batch":
        raise RewardError(f"reward.reward_model.normalize: {how!r}; valid: none, batch")
    centred = rm - rm.mean()
    std = rm.std(unbiased=False) if rm.numel() > 1 else torch.tensor(0.0)
    return centred / std if float(std) > 0 else centred


def combine(rule: torch.Tensor, has_rule: torch.Tensor, rm: torch.Tensor, weight: float = 1.0,
            rule_weight: float = 1.0) -> torch.Tensor:
    """rule_weight x rule + weight x rm where has_rule, weight x rm elsewhere (rule entries without
    a rule are ignored)."""
    return torch.where(has_rule, rule_weight * rule + weight * rm, weight * rm)
