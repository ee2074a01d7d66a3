"""The hook for a learned reward model, and how its score combines with the rules.

The reward model itself runs in the engine's reward role (a TrainingEngine forward over prompt +
response tokens); this module only fixes the contract so the scorer does not depend on the engine:
any object with `score(batch) -> FloatTensor [B]` is a RewardModel. `batch` is whatever the trainer
passes (its rollout batch); the scorer hands it through untouched.

Combination rule, per sample: rule score + reward-model score where a rule exists for the
sample's data_source (or a custom function is set), the reward-model score alone where none does.
Without a reward model, a data_source without a rule is an error (see registry).
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
    out = torch.as_tensor(out, dtype=torch.float32).detach().cpu().reshape(-1)
    if out.numel() != size:
        raise RewardError(f"reward model returned {out.numel()} scores for a batch of {size} responses")
    if not torch.isfinite(out).all():
        raise RewardError(f"reward model returned non-finite scores: {out.tolist()}")
    return out


def combine(rule: torch.Tensor, has_rule: torch.Tensor, rm: torch.Tensor) -> torch.Tensor:
    """rule + rm where has_rule, rm elsewhere (rule entries without a rule are ignored)."""
    return torch.where(has_rule, rule + rm, rm)
