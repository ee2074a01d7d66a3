"""Input checks and masked reductions over right-padded `[batch, response_len]` tensors.

Every public function of this package validates its inputs here, so that a bad batch fails with
one clear message (which tensor, which rows, which shapes) rather than a NaN three steps later.
"""
from __future__ import annotations

from typing import Optional

import torch

# verl whitens with rsqrt(var + 1e-8); keeping the same constant keeps advantages comparable.
WHITEN_EPS = 1e-8
_MAX_ROWS_LISTED = 20


def check_same_shape(a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(
            f"shape mismatch: {a_name} has shape {tuple(a.shape)} but {b_name} has shape "
            f"{tuple(b.shape)}; they must be equal"
        )


def check_response_mask(mask: torch.Tensor, name: str = "response_mask") -> None:
    """A response mask is `[batch, response_len]` and every row has at least one valid token.

    A zero-length response has no token to carry its reward or its loss: per-sequence means would
    divide by zero and outcome rewards would vanish, so it is rejected here with its row indexes.
    """
    if mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D [batch, response_len]; got shape {tuple(mask.shape)}")
    empty = (mask.sum(dim=-1) == 0).nonzero().flatten().tolist()
    if empty:
        shown = empty[:_MAX_ROWS_LISTED]
        more = f" (and {len(empty) - len(shown)} more)" if len(empty) > len(shown) else ""
        raise ValueError(
            f"{name} has zero-length responses (no valid token) at row index(es) {shown}{more}; "
            "drop these samples or give each response at least one token"
        )


def as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Masks may arrive as bool, int or float; arithmetic needs them in the values' dtype."""
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    m = as_float_mask(mask, x)
    # where() rather than x * m so that inf/nan in padding cannot leak into the sum.
    vals = torch.where(m > 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device))
    return vals.sum() if dim is None else vals.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    m = as_float_mask(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid entries; unbiased (n-1) as verl does. Fewer than two entries -> 0."""
    m = as_float_mask(mask, x)
    n = m.sum()
    mean = masked_sum(x, m) / n.clamp(min=1)
    sq = masked_sum((x - mean) ** 2, m)
    denom = (n - 1) if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over valid tokens of the whole batch; padding set to 0."""
    m = as_float_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(m > 0, out, torch.zeros_like(out))


def check_token_inputs(response_mask: torch.Tensor, **tensors: Optional[torch.Tensor]) -> None:
    """Validate the mask and that every given token tensor has its shape (None entries skipped)."""
    check_response_mask(response_mask)
    for name, t in tensors.items():
        if t is not None:
            check_same_shape(t, response_mask, name, "response_mask")


def check_per_sample(x: torch.Tensor, response_mask: torch.Tensor, name: str) -> None:
    batch = response_mask.shape[0]
    if tuple(x.shape) != (batch,):
        raise ValueError(
            f"shape mismatch: {name} has shape {tuple(x.shape)} but must be ({batch},), one value "
            f"per row of response_mask {tuple(response_mask.shape)}"
        )


def zero_advantage_rows(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows with at least one valid token whose advantages are exactly 0 on every valid
    token. A row without a valid token is not one (the losses reject it: skipping would hide
    that), nor is a row with a NaN advantage (NaN != 0: the update must see it)."""
    check_same_shape(advantages, response_mask, "advantages", "response_mask")
    valid = as_float_mask(response_mask, advantages) > 0
    nonzero = (advantages != 0) & valid
    return valid.any(dim=-1) & ~nonzero.any(dim=-1)


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score per sequence: rewards sit on the last valid token, so the masked row sum."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last valid token (right-padded rows), where an outcome score sits."""
    valid = response_mask > 0
    return valid.shape[-1] - 1 - valid.flip(-1).to(torch.int8).argmax(dim=-1)


def reward_to_go(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over each row's valid tokens (padding is stepped over,
    not through, and gets 0)."""
    valid = as_float_mask(response_mask, rewards) > 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns
