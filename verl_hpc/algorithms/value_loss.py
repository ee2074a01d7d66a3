"""Critic loss with PPO-style value clipping."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

from .aggregation import Count, agg_loss
from .masked import as_float_mask, check_token_inputs, masked_mean


def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: Optional[float],
    loss_agg_mode: str,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_len: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    vpreds: current critic values (with grad); values: the critic's values at rollout time (V_old);
    returns: regression targets (e.g. from GAE). Clipping keeps one update from moving a value
    estimate far from where the advantages were computed; taking the max makes it pessimistic, as
    in PPO/verl. cliprange_value=None gives the plain squared error. The 0.5 makes the gradient
    (V - R), matching verl.
    metrics: vf_clipfrac (share of tokens where the clipped term was the larger), vpred_mean.
    """
    check_token_inputs(response_mask, vpreds=vpreds, values=values, returns=returns)
    valid = as_float_mask(response_mask, vpreds) > 0
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    vpreds = torch.where(valid, vpreds, zero)
    values = torch.where(valid, values.detach().to(vpreds.dtype), zero)
    returns = torch.where(valid, returns.detach().to(vpreds.dtype), zero)
    loss_unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        loss_mat, clipped = loss_unclipped, torch.zeros_like(valid)
    else:
        if cliprange_value < 0:
            raise ConfigError(f"critic.cliprange_value must be >= 0; got {cliprange_value}")
        v_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
        loss_clipped = (v_clipped - returns) ** 2
        loss_mat = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    loss = 0.5 * agg_loss(loss_mat, valid, loss_agg_mode, global_tokens, global_seqs, norm_len)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(clipped.to(vpreds.dtype), valid),
            "vpred_mean": masked_mean(vpreds.detach(), valid),
        }
    return loss, metrics
