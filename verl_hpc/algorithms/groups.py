"""Per-prompt groups: normalising group ids and vectorised group statistics.

Group-relative estimators (GRPO, RLOO, OPO, ...) compare samples that answer the same prompt.
Callers identify the prompt either with an int64 tensor or, as verl's uid column does, with a
numpy array / list of any hashables (strings, tuples). Everything below works on dense codes
0..G-1 so that statistics are a few scatter-adds instead of a Python loop over samples.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import numpy as np
import torch

GroupIds = Union[torch.Tensor, np.ndarray, Sequence[Any]]

# Group std is divided by (std + eps) as in the GRPO paper / verl.
GROUP_STD_EPS = 1e-6


def group_index(
    group_ids: GroupIds, batch: int, device: torch.device | str = "cpu"
) -> Tuple[torch.Tensor, int]:
    """Map group ids to dense codes `[batch]` (int64, first-seen order) and return (codes, n_groups)."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D [batch]; got shape {tuple(group_ids.shape)}")
        if group_ids.is_floating_point():
            raise ValueError("group_ids as a tensor must be an integer tensor (the prompt index)")
        if group_ids.shape[0] != batch:
            raise ValueError(
                f"shape mismatch: group_ids has shape {tuple(group_ids.shape)} but the batch has "
                f"{batch} rows (token tensors are [{batch}, response_len])"
            )
        uniques, codes = torch.unique(group_ids, return_inverse=True)
        return codes.to(device=device, dtype=torch.long), int(uniques.numel())
    ids = list(group_ids.tolist() if isinstance(group_ids, np.ndarray) else group_ids)
    if len(ids) != batch:
        raise ValueError(
            f"shape mismatch: group_ids has length {len(ids)} but the batch has {batch} rows"
        )
    table: dict = {}
    try:
        codes_list = [table.setdefault(g, len(table)) for g in ids]
    except TypeError as err:  # unhashable id, e.g. a list
        raise ValueError(f"group_ids must be hashable (int, str, tuple); {err}") from None
    return torch.tensor(codes_list, dtype=torch.long, device=device), len(table)


def group_counts(codes: torch.Tensor, n_groups: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=dtype, device=codes.device).index_add_(
        0, codes, torch.ones_like(codes, dtype=dtype)
    )


def group_sum(x: torch.Tensor, codes: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, codes, x)


def group_mean_std(
    scores: torch.Tensor, codes: torch.Tensor, n_groups: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group std) with the unbiased sample std (torch.std's default).

    A group of one sample has no spread to estimate, so it gets mean 0 and std 1: its advantage is
    then its raw score, which is what verl does and keeps singleton prompts from being dropped.
    """
    counts = group_counts(codes, n_groups, scores.dtype)
    mean = group_sum(scores, codes, n_groups) / counts
    sq = group_sum((scores - mean[codes]) ** 2, codes, n_groups)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[codes], std[codes]
