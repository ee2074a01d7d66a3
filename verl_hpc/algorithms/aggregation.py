"""Reduce a token-level loss matrix `[batch, response_len]` to a scalar.

The four modes differ in how tokens and sequences are weighted:

- ``token-mean``:              sum_{i,t} m_it l_it / N_tokens
                               (every token weighs the same; DAPO)
- ``token-sum``:              sum_{i,t} m_it l_it
                               (no normalisation: the loss scales with the batch's token count;
                               verl's name, for losses whose scale is set elsewhere)
- ``seq-mean-token-sum``:      (1/N_seqs) sum_i sum_t m_it l_it
                               (the response is one action; long answers weigh more)
- ``seq-mean-token-mean``:     (1/N_seqs) sum_i (sum_t m_it l_it / |y_i|)
                               (GRPO paper: every answer weighs the same)
- ``seq-mean-token-sum-norm``: (1/N_seqs) sum_i sum_t m_it l_it / L
                               (Dr.GRPO: L a constant such as the max length, no length bias)

Why the global counts: with data parallelism and gradient accumulation a rank only sees a
micro-batch. Dividing by the *local* token count and then averaging micro-batches weights a token
by the size of the micro-batch it happened to land in, so the loss (and gradient) would depend on
the parallel layout. Passing the global counts makes every micro-batch return its *contribution*:
summing the contributions over micro-batches and data-parallel ranks gives exactly the full-batch
value, whatever the split. The caller therefore sums (not averages) the contributions.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from verl_hpc.config.errors import ConfigError

from .masked import as_float_mask, check_response_mask, check_same_shape, masked_sum

LOSS_AGG_MODES = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
)

Count = Union[int, float, torch.Tensor, None]


def _count(value: Count, local: torch.Tensor, name: str) -> torch.Tensor:
    if value is None:
        return local
    count = torch.as_tensor(value, dtype=local.dtype, device=local.device)
    if bool((count <= 0).any()):
        raise ValueError(f"{name} must be positive; got {value}")
    return count


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` over valid tokens of `mask` with one of `LOSS_AGG_MODES`.

    global_tokens: total valid tokens of the global batch (token-mean); None -> this batch's count.
    global_seqs:   total sequences of the global batch (seq-* modes); None -> this batch's rows.
    norm_len:      the constant of seq-mean-token-sum-norm; None -> this batch's padded length
                   (only layout-independent if every micro-batch is padded to the same length).
    """
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"unknown loss aggregation mode {mode!r} in actor.loss_agg_mode; valid names: "
            + ", ".join(LOSS_AGG_MODES)
        )
    check_same_shape(loss_mat, mask, "loss_mat", "response_mask")
    check_response_mask(mask)
    m = as_float_mask(mask, loss_mat)
    if mode == "token-mean":
        return masked_sum(loss_mat, m) / _count(global_tokens, m.sum(), "global_tokens")
    if mode == "token-sum":  # a plain sum: micro-batch contributions add up without any count
        return masked_sum(loss_mat, m)

    local_seqs = torch.tensor(float(m.shape[0]), dtype=m.dtype, device=m.device)
    n_seqs = _count(global_seqs, local_seqs, "global_seqs")
    seq_sums = masked_sum(loss_mat, m, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / n_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / m.sum(dim=-1)).sum() / n_seqs
    # seq-mean-token-sum-norm
    length = float(m.shape[-1]) if norm_len is None else float(norm_len)
    if length <= 0:
        raise ValueError(f"norm_len must be positive; got {norm_len}")
    return seq_sums.sum() / length / n_seqs
