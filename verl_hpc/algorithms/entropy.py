"""Token entropy from logits, exact when the vocabulary is sharded over tensor-parallel ranks.

H = -sum_j p_j log p_j = log Z - sum_j p_j s_j, with s_j = l_j - m (m the max logit, subtracted so
exp cannot overflow) and Z = sum_j exp(s_j). Every term is a max or a sum over the vocabulary,
so with logits split over the vocab dimension each rank computes its local max, then its local
(sum exp(s), sum exp(s) * s), and three all-reduces (max, then one stacked sum) give the
full-vocabulary entropy without ever gathering the logits. The pieces are public so an engine can
drive them itself; `entropy_from_logits` does it all, given an all-reduce callable.

Gradients: dH/dl_k = p_k (sum_j p_j s_j - s_k) needs only the local p_k and the already reduced
sum, so backward is communication-free and each rank gets exactly the gradient of its own shard.
A custom autograd function provides that (a differentiable all-reduce would instead sum the
replicated upstream gradient over ranks and scale it by the TP size).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

# all_reduce(tensor, op) -> reduced tensor, op in {"max", "sum"}; may reduce in place.
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulate in at least float32: bf16/fp16 sums over a 150k vocabulary lose the entropy."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def local_logit_max(logits: torch.Tensor) -> torch.Tensor:
    """Step 1 (then all-reduce with "max"): max over this rank's vocabulary slice, `[...]`."""
    return _acc(logits.detach()).amax(dim=-1)


def local_exp_stats(logits: torch.Tensor, global_max: torch.Tensor) -> torch.Tensor:
    """Step 2 (then all-reduce with "sum"): stacked (sum_j exp(s_j), sum_j exp(s_j) s_j) over this
    rank's slice, `[..., 2]`, with s = logits - global_max."""
    shifted = _acc(logits) - global_max.unsqueeze(-1)
    e = torch.exp(shifted)
    # where(): a -inf logit (e.g. a padded vocab entry) has e = 0 and must add 0, not 0 * -inf = nan.
    es = torch.where(e > 0, e * shifted, torch.zeros_like(e))
    return torch.stack([e.sum(dim=-1), es.sum(dim=-1)], dim=-1)


def entropy_from_stats(stats: torch.Tensor) -> torch.Tensor:
    """Step 3: entropy from the globally summed stats `[..., 2]`: log Z - (sum e s) / Z."""
    z, es = stats[..., 0], stats[..., 1]
    return torch.log(z) - es / z


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, all_reduce: Optional[AllReduce]) -> torch.Tensor:
        m = local_logit_max(logits)
        if all_reduce is not None:
            m = all_reduce(m, "max")
        stats = local_exp_stats(logits.detach(), m)
        if all_reduce is not None:
            stats = all_reduce(stats, "sum")
        z = stats[..., 0]
        mean_shifted = stats[..., 1] / z  # E_p[s], already global
        ctx.save_for_backward(logits, m, z, mean_shifted)
        return entropy_from_stats(stats).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, m, z, mean_shifted = ctx.saved_tensors
        # Recompute p from the saved input instead of saving a vocab-sized p (memory: logits of a
        # long sequence are the largest activation in the model).
        shifted = _acc(logits) - m.unsqueeze(-1)
        p = torch.exp(shifted) / z.unsqueeze(-1)
        grad = p * (mean_shifted.unsqueeze(-1) - shifted)
        grad = torch.where(p > 0, grad, torch.zeros_like(grad)) * grad_out.to(grad.dtype).unsqueeze(-1)
        return grad.to(logits.dtype), None


def entropy_from_logits(logits: torch.Tensor, all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """Per-position entropy `[...]` of logits `[..., vocab]` (vocab last), differentiable.

    all_reduce=None: the logits hold the whole vocabulary. Otherwise they hold this rank's vocab
    slice and `all_reduce(t, op)` must return t reduced over the tensor-parallel group with op
    "max" or "sum" (see `process_group_all_reduce`). Accumulated in float32 (float64 for float64
    logits), returned in the logits' dtype.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab] with vocab > 0; got shape {tuple(logits.shape)}")
    return _VocabParallelEntropy.apply(logits, all_reduce)


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """sum_v p_v^2 per position `[...]` of softmax(logits) (the optimal token baseline's
    ||grad_logits log p||^2 = 1 - 2 p_y + sum_v p_v^2 needs it), as float32 (float64 for float64
    logits), no gradient: with s = l - max l, sum_v p_v^2 = sum_v exp(2 s_v) / (sum_v exp(s_v))^2, so
    vocab-sharded logits need the max and one stacked sum, like the entropy (`all_reduce` as there)."""
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab] with vocab > 0; got shape {tuple(logits.shape)}")
    m = local_logit_max(logits)
    if all_reduce is not None:
        m = all_reduce(m, "max")
    e = torch.exp(_acc(logits) - m.unsqueeze(-1))
    sums = torch.stack([e.sum(dim=-1), (e * e).sum(dim=-1)], dim=-1)
    if all_reduce is not None:
        sums = all_reduce(sums, "sum")
    return sums[..., 1] / (sums[..., 0] * sums[..., 0])


def process_group_all_reduce(group=None) -> AllReduce:
    """An `all_reduce(t, op)` over a torch.distributed process group (the TP group)."""
    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        if op not in ops:
            raise ValueError(f"all_reduce op must be one of {sorted(ops)}; got {op!r}")
        t = t.contiguous()
        dist.all_reduce(t, op=ops[op], group=group)
        return t

    return all_reduce
