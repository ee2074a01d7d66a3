"""DAPO's data-side pieces (Yu et al. 2025): dynamic-sampling group filter, overlong reward shaping.

(Clip-higher is `clip_ratio_high` of the vanilla loss; token-level aggregation is `token-mean`.)
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .groups import GroupIds, group_counts, group_index
from .masked import as_float_mask, check_token_inputs, last_token_index


def filter_groups(
    seq_scores: torch.Tensor, group_ids: GroupIds, keep_singletons: bool = True
) -> Tuple[torch.Tensor, Dict[str, int]]:
    """Dynamic sampling: drop every group whose rewards are all equal (all solved or all failed).

    Under group-relative advantages such a group has zero advantage everywhere: it costs a full
    forward/backward and contributes no gradient, while still diluting token-mean losses. DAPO
    keeps sampling until the batch is full of informative groups; this function is the filter.
    A group of one sample has no "all equal" to speak of and its advantage is its raw score, so it
    is kept by default (as verl does); keep_singletons=False drops it too.

    seq_scores: `[B]` sequence rewards (e.g. `sequence_scores(token_level_rewards, mask)`).
    Returns (keep `[B]` bool, {"kept_groups", "dropped_groups", "kept_samples", "dropped_samples"}).
    """
    if seq_scores.dim() != 1:
        raise ValueError(f"seq_scores must be 1-D [batch]; got shape {tuple(seq_scores.shape)}")
    codes, n_groups = group_index(group_ids, seq_scores.shape[0], seq_scores.device)
    scores = seq_scores.detach().to(torch.float64)
    g_max = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    g_min = torch.full((n_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    g_max = g_max.scatter_reduce(0, codes, scores, reduce="amax")
    g_min = g_min.scatter_reduce(0, codes, scores, reduce="amin")
    single = group_counts(codes, n_groups, scores.dtype) == 1
    keep_group = (g_max != g_min) | (single & keep_singletons)
    keep = keep_group[codes]
    kept_groups = int(keep_group.sum().item())
    kept_samples = int(keep.sum().item())
    metrics = {
        "kept_groups": kept_groups,
        "dropped_groups": n_groups - kept_groups,
        "kept_samples": kept_samples,
        "dropped_samples": int(seq_scores.shape[0]) - kept_samples,
    }
    return keep, metrics


def _check_overlong(max_len: int, buffer_len: int, penalty_factor: float) -> None:
    if max_len <= 0:
        raise ValueError(f"max response length must be > 0; got {max_len}")
    if not 0 < buffer_len <= max_len:
        raise ConfigError(
            f"algorithm.overlong_buffer.len must be in (0, max response length={max_len}]; got {buffer_len}"
        )
    if penalty_factor < 0:
        raise ConfigError(f"algorithm.overlong_buffer.penalty_factor must be >= 0; got {penalty_factor}")


def overlong_penalty(
    response_lengths: torch.Tensor, max_len: int, buffer_len: int,
    penalty_factor: float,  # algorithm.overlong_buffer.penalty_factor, bound by the caller
) -> torch.Tensor:
    """Soft overlong punishment per sample `[B]`:

        0                                              if L <= max_len - buffer_len
        -penalty_factor * (L - (max_len - buffer_len)) / buffer_len   inside the buffer
        -penalty_factor                                if L >= max_len (clamped beyond it)

    A linear ramp rather than a cliff, so a response just past the soft limit is not punished
    like a truncated one (DAPO's reward-noise argument).
    """
    _check_overlong(max_len, buffer_len, penalty_factor)
    lengths = response_lengths if response_lengths.is_floating_point() else response_lengths.float()
    exceed = (lengths - (max_len - buffer_len)).clamp(min=0.0, max=float(buffer_len))
    return -penalty_factor * exceed / buffer_len


def apply_overlong_penalty(
    token_level_scores: torch.Tensor,
    response_mask: torch.Tensor,
    max_len: int,
    buffer_len: int,
    penalty_factor: float,  # algorithm.overlong_buffer.penalty_factor, bound by the caller
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Add `overlong_penalty` (length = valid tokens per row) to each row's last valid token, where
    the outcome score sits. Returns (scores, {"overlong_penalty_mean", "overlong_frac"})."""
    check_token_inputs(response_mask, token_level_scores=token_level_scores)
    valid = as_float_mask(response_mask, token_level_scores) > 0
    lengths = valid.sum(dim=-1)
    penalty = overlong_penalty(lengths, max_len, buffer_len, penalty_factor).to(token_level_scores.dtype)
    last = last_token_index(valid)
    out = token_level_scores.clone()
    rows = torch.arange(valid.shape[0], device=valid.device)
    out[rows, last] = out[rows, last] + penalty
    metrics = {
        "overlong_penalty_mean": penalty.mean().detach(),
        "overlong_frac": (penalty < 0).to(torch.float32).mean(),
    }
    return out, metrics
