"""Outputs every engine shares: value-head outputs from per-position values, and the gather that
gives every rank the whole batch's outputs.

Value head: `[b, s, 1]` -> values `[b, T]` from positions p + t - 1 (`_positions`), and the reward
model's sequence score from the last token p + r - 1.

`gather_outputs`: each rank that computed rows (`reporting`) writes them into zero `[B, T]` (or
`[B]`) buffers, and one SUM all-reduce over all ranks gives every rank the whole batch's outputs
(rows are disjoint; x + 0 = x exactly).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.distributed as dist

VALUE_OUTPUTS = ("values", "scores", "token_scores")


def value_outputs(values: torch.Tensor, mb: Dict[str, torch.Tensor],
                  want: Sequence[str]) -> Dict[str, torch.Tensor]:
    unknown = set(want) - set(VALUE_OUTPUTS)
    if unknown:
        raise ValueError(f"a value-head engine gives {VALUE_OUTPUTS}; asked for {sorted(unknown)}")
    v = values.squeeze(-1).float()  # [b, s]
    out: Dict[str, torch.Tensor] = {}
    if "values" in want:
        out["values"] = v.gather(1, mb["_positions"])
    if "scores" in want or "token_scores" in want:
        last = (mb["prompt_lengths"] + mb["response_lengths"] - 1).clamp(min=0).unsqueeze(1)
        scores = v.gather(1, last).squeeze(1)
        out["scores"] = scores
        if "token_scores" in want:  # the score on the last response token, as verl's rewards
            t = mb["_positions"].shape[1]
            col = (mb["response_lengths"] - 1).clamp(min=0).unsqueeze(1)
            out["token_scores"] = torch.zeros(v.shape[0], t, device=v.device).scatter(
                1, col, scores.unsqueeze(1))
    return out


def gather_outputs(collected, batch_size: int, width: int, keys: Sequence[str], device,
                   reporting: bool) -> Dict[str, torch.Tensor]:
    """Every rank gets `{key: [B, T] or [B]}` for the whole batch (see the module docstring)."""
    out = {}
    for key in keys:
        per_seq = key == "scores"
        buf = torch.zeros((batch_size,) if per_seq else (batch_size, width), dtype=torch.float32,
                          device=device)
        if reporting:
            for mb, values in collected:
                rows = torch.as_tensor(mb.rows, device=device)
                v = values[key].float()
                if per_seq:
                    buf[rows] = v
                else:
                    valid = mb.data["response_mask"][: len(mb.rows)] > 0
                    buf[rows, : v.shape[1]] = torch.where(valid, v, torch.zeros_like(v))
        out[key] = buf
    if dist.is_initialized() and dist.get_world_size() > 1 and out:
        flat = torch.cat([t.flatten() for t in out.values()])
        dist.all_reduce(flat)
        offset = 0
        for key, t in out.items():
            out[key] = flat[offset: offset + t.numel()].view_as(t)
            offset += t.numel()
    return {k: v.cpu() for k, v in out.items()}


def sum_over_ranks(vec: torch.Tensor) -> torch.Tensor:
    """This rank's metric sums summed over every rank, left on the device: the engines read them
    to the host together with the gradient norm, in the one read before their optimizer step
    (each engine's guarded_step)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vec)
    return vec


def metrics_from_sums(vals: Sequence[float], keys: Sequence[str]) -> Dict[str, float]:
    """The metrics from the summed `[loss, tokens, sums...]` read to the host: the loss is the sum
    of contributions, each metric its token-weighted mean."""
    tokens = max(vals[1], 1.0)
    out = {"loss": vals[0], "tokens": vals[1]}
    out.update({k: vals[2 + j] / tokens for j, k in enumerate(keys)})
    return out
