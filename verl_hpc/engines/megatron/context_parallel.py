"""Megatron-Core context parallelism (`parallel.cp`): each sequence split over the cp ranks of a
context-parallel group, and the per-token results put back together.

The split is Megatron-Core's load-balanced one (megatron.core.utils.get_batch_on_this_cp_rank in
megatron-core 0.16.1, which `split_for_rank` calls): a sequence of S tokens is cut into 2 * cp
chunks of S / (2 * cp) tokens, and rank r holds chunks r and 2 * cp - 1 - r, in that order. Under a
causal mask the late chunks attend to more keys than the early ones; pairing chunk r with its
mirror gives every rank the same number of (query, key) pairs (`causal_pairs`). S must therefore be
a multiple of 2 * cp: the engine pads every micro-batch to it (MegatronEngine.pad_seq_to, applied
by schedule.MicroBatch; the padding is after the last real token and never read).

Inside the model Megatron's own code does the rest: Transformer Engine's attention exchanges keys
and values around the ring (cp_comm_type p2p), and the rotary embedding cuts its table with the
same rule (get_pos_emb_on_this_cp_rank in megatron.core's rope_utils). Out of the model come this
rank's tokens only: per-position losses `[b, S/cp]`, vocab-parallel logits `[b, S/cp, V/tp]` or values
`[b, S/cp, 1]`. The engine turns logits into per-token log-probs / entropy on its own tokens first
(the logits are never gathered), then `gather_sequence` all-gathers the `[b, S/cp]` results over the
CP group and un-permutes them into sequence order.

Gradients: every CP rank then holds the same full-sequence results and computes the same loss, so
the backward of the gather hands each rank the gradient of its own tokens only (no sum over the
group, which would count each token cp times). Each rank's weight gradients are its tokens' share;
Megatron's DDP sums them over the dp x cp group (its dp_cp gradient buffers), which gives the
gradient of the whole sequence.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_hpc.engines.megatron import outputs as lm
from verl_hpc.engines.outputs import value_outputs


def chunks_of_rank(cp: int, rank: int) -> Tuple[int, int]:
    """The two chunks (of 2 * cp) that CP rank `rank` holds, in its local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} outside [0, {cp})")
    return rank, 2 * cp - 1 - rank


def check_length(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * cp = {2 * cp}: context "
                         "parallelism cuts each sequence into 2 * cp equal chunks (pad it first)")


def token_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Sequence positions of the tokens CP rank `rank` holds, in its local order ([seq_len / cp])."""
    check_length(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in chunks_of_rank(cp, rank)])


def unpermute_index(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """order[p] = where position p sits in the rank-order concatenation of all ranks' tokens."""
    placed = torch.cat([token_index(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(placed)


def split_for_rank(tensors: Dict[str, torch.Tensor], group) -> Dict[str, torch.Tensor]:
    """This CP rank's tokens of each `[b, S, ...]` tensor (None values pass through), through
    Megatron-Core's own helper: the engine's model inputs (token ids, position ids, labels) are the
    `[b, S]` tensors it is written for. The dict passed is not changed (the helper writes in place)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    for v in tensors.values():
        if v is not None:
            check_length(v.shape[1], group.size())
    return get_batch_on_this_cp_rank(dict(tensors), cp_group=group)


def reassemble(parts: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's local tokens (parts[r]: rank r's `[b, S/cp, ...]`)."""
    cp = len(parts)
    whole = torch.cat(list(parts), dim=seq_dim)
    order = unpermute_index(whole.shape[seq_dim], cp, whole.device)
    return whole.index_select(seq_dim, order)


class _GatherSequence(torch.autograd.Function):
    """All-gather over the CP group + un-permute; backward: this rank's tokens' gradient only
    (module docstring: every rank computes the same loss from the gathered result)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        local = local.contiguous()
        parts: List[torch.Tensor] = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local, group=group)
        ctx.cp, ctx.rank = cp, rank
        return reassemble(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = token_index(grad.shape[1], ctx.cp, ctx.rank, grad.device)
        return grad.index_select(1, mine), None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """`[b, S/cp, ...]` of this rank -> `[b, S, ...]` in sequence order, on every rank of `group`."""
    if dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, group)


def outputs(out: torch.Tensor, mb: Dict[str, torch.Tensor], want: Sequence[str], *, kind: str,
            temperature: float = 1.0) -> Dict[str, torch.Tensor]:
    """The engine's per-micro-batch results (outputs.py's, aligned to the responses) from the
    model's output on this CP rank's tokens: `kind` is "labels" (per-position losses `[b, S/cp]`,
    the model called with this rank's next-token labels), "lm" (vocab-parallel logits
    `[b, S/cp, V/tp]`: log-probs / entropy on this rank's tokens first, so that only `[b, S/cp]`
    results cross the group) or "value" (`[b, S/cp, 1]`). mb["_cp_labels"]: this rank's next-token
    labels (schedule.MicroBatch)."""
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    if kind == "labels":
        return lm.lm_outputs_from_token_losses(gather_sequence(out, group), mb, want)
    if kind == "value":
        return value_outputs(gather_sequence(out, group), mb, want)
    if kind != "lm":
        raise ValueError(f"context-parallel output kind {kind!r}; valid: labels, lm, value")
    mine = lm.lm_outputs(out, {"_targets": mb["_cp_labels"]}, want, temperature=temperature, selected=True)
    b = torch.arange(out.shape[0], device=out.device).unsqueeze(1)
    return {k: gather_sequence(v, group)[b, mb["_positions"]] for k, v in mine.items()}


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """(query, key) pairs rank `rank`'s queries attend to under a causal mask: its attention work."""
    return int((token_index(seq_len, cp, rank) + 1).sum())


__all__ = ["causal_pairs", "check_length", "chunks_of_rank", "gather_sequence", "outputs", "reassemble",
           "split_for_rank", "token_index", "unpermute_index"]
