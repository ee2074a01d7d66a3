"""The routes of routing replay as they travel in a batch: each token's top-k expert indices per
MoE layer (docs/moe.md, "Routing replay").

    routes [B, S, L, k]   aligned with input_ids (prompt then response, right-padded); dtype uint8
                          when the model has fewer than 255 experts, else int16
    MISSING               where no route was recorded (padding, a sequence's last token, which the
                          rollout never feeds back): 255 in uint8, -1 in int16. The training forward
                          routes such positions itself.

A sequence's last token and the padding after it influence no log-prob of the sequence (the
attention is causal and they come last), so leaving them to the trainer's own router changes
nothing a loss reads. A row of the rollout is `[P + R, L, k]` (its prompt and response tokens).
"""
from __future__ import annotations

from typing import Sequence

import torch

MISSING = {torch.uint8: 255, torch.int16: -1}


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype that holds every expert index and the MISSING marker."""
    return torch.uint8 if num_experts < 255 else torch.int16


def missing_value(dtype: torch.dtype) -> int:
    if dtype not in MISSING:
        raise ValueError(f"routes: dtype {dtype}; expected uint8 or int16 (models/moe_routes.py)")
    return MISSING[dtype]


def is_missing(routes: torch.Tensor) -> torch.Tensor:
    """True where no route was recorded (any layer / slot)."""
    return routes == missing_value(routes.dtype)


def pad_routes(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row `[n_i, L, k]` routes -> `[B, width, L, k]`, MISSING beyond each row."""
    first = rows[0]
    out = torch.full((len(rows), width, *first.shape[1:]), missing_value(first.dtype), dtype=first.dtype)
    for i, r in enumerate(rows):
        n = min(int(r.shape[0]), width)
        out[i, :n] = r[:n]
    return out


def fit_width(routes: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, S, L, k]` cut or MISSING-padded to `[B, width, L, k]` (a micro-batch's sequence length)."""
    s = routes.shape[1]
    if s >= width:
        return routes[:, :width]
    pad = torch.full((routes.shape[0], width - s, *routes.shape[2:]), missing_value(routes.dtype),
                     dtype=routes.dtype, device=routes.device)
    return torch.cat([routes, pad], dim=1)


def fit_rows(routes: torch.Tensor, rows: int) -> torch.Tensor:
    """`[b, S, L, k]` MISSING-padded to `rows` rows (a micro-batch's dummy rows)."""
    b = routes.shape[0]
    if b >= rows:
        return routes[:rows]
    pad = torch.full((rows - b, *routes.shape[1:]), missing_value(routes.dtype), dtype=routes.dtype,
                     device=routes.device)
    return torch.cat([routes, pad])


def pack_routes(routes: torch.Tensor, prompt_lengths, response_lengths, sample_rows, positions,
                shape) -> torch.Tensor:
    """Per-sample routes `[n, S, L, k]` laid out as engines/prefix.py packs the samples: one model
    row per prompt, the prompt's tokens first (its first sample's routes: the rollout prefilled the
    prompt once for all its samples), then each sample's fed response tokens (all but the last) at
    its offset, read from `positions` (response token 1 is scored at the offset). -> `[g, seq, L, k]`."""
    rows, seq = shape
    out = torch.full((rows, seq, *routes.shape[2:]), missing_value(routes.dtype), dtype=routes.dtype,
                     device=routes.device)
    for i in range(routes.shape[0]):
        row, p, r = int(sample_rows[i]), int(prompt_lengths[i]), int(response_lengths[i])
        out[row, :p] = routes[i, :p]
        if r > 1:
            offset = int(positions[i, 1])
            out[row, offset:offset + r - 1] = routes[i, p:p + r - 1]
    return out
