"""Prompts and rollouts -> the engines' batch format (verl_hpc/engines/batch.py).

Every rank must hand the rollout the SAME global prompt list: rank 0 samples it from the loader and
`broadcast_prompts` sends it to the others. The rollout returns the same global result on every
rank, so `assemble` builds identical tensors everywhere; the engines then split rows over DP ranks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_hpc.engines.batch import length_mask, pack_sequences


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (a no-op without torch.distributed or with one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_prompts(loader, ctx):
    """The next PromptBatch: sampled on rank 0 (the loader lives there), the same on every rank."""
    return broadcast_object(loader.next_batch() if ctx.rank == 0 else None)


@dataclasses.dataclass
class RolloutBatch:
    """One step's sequences: tensors for the engines plus per-sequence fields for the rewards."""
    tensors: Dict[str, torch.Tensor]
    ids: List[str]
    data_sources: List[str]
    ground_truths: List[str]
    extras: List[Dict[str, Any]]
    response_texts: List[str]
    group_ids: torch.Tensor  # [B] prompt index: the GRPO/RLOO group of each sequence
    rollout_log_probs: torch.Tensor  # [B, T] the rollout engine's log-probs of the sampled tokens

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    def select(self, keep: torch.Tensor) -> "RolloutBatch":
        """Rows where `keep` ([B] bool) is true, all fields together."""
        rows = keep.nonzero().flatten().tolist()
        take = lambda xs: [xs[i] for i in rows]  # noqa: E731
        b = len(self.ids)
        tensors = {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b else v
                   for k, v in self.tensors.items()}
        return RolloutBatch(tensors, take(self.ids), take(self.data_sources), take(self.ground_truths),
                            take(self.extras), take(self.response_texts), self.group_ids[rows],
                            self.rollout_log_probs[rows])


def _pad_cat(tensors: Sequence[torch.Tensor], fill) -> torch.Tensor:
    """Row-concatenate, right-padding dim 1 to the widest (1-D tensors are just concatenated)."""
    if tensors[0].dim() < 2:
        return torch.cat(list(tensors))
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors])


def concat_batches(parts: Sequence[Tuple[RolloutBatch, torch.Tensor]], pad_id: int
                   ) -> Tuple[RolloutBatch, torch.Tensor]:
    """Several generation rounds' (batch, token_scores) as one (DAPO's refill): rows in order,
    [B, T] tensors right-padded to the widest round (pad_id for token ids, 0 elsewhere: outside
    every response mask), group ids made distinct across rounds."""
    if len(parts) == 1:
        return parts[0]
    batches = [b for b, _ in parts]
    offsets, total = [], 0
    for b in batches:  # a round's group ids are its prompt indices
        offsets.append(total)
        total += int(b.group_ids.max()) + 1 if len(b) else 0
    tensors = {k: _pad_cat([b.tensors[k] for b in batches], pad_id if k == "input_ids" else 0)
               for k in batches[0].tensors}
    joined = RolloutBatch(tensors, *(sum((getattr(b, f) for b in batches), []) for f in
                                     ("ids", "data_sources", "ground_truths", "extras", "response_texts")),
                          torch.cat([b.group_ids + o for b, o in zip(batches, offsets)]),
                          _pad_cat([b.rollout_log_probs for b in batches], 0.0))
    return joined, _pad_cat([s for _, s in parts], 0.0)


def first_groups(batch: RolloutBatch, n_groups: int) -> torch.Tensor:
    """Keep mask of the rows of the first `n_groups` groups, in order of appearance."""
    order = list(dict.fromkeys(batch.group_ids.tolist()))[:n_groups]
    return torch.isin(batch.group_ids, torch.tensor(order, dtype=batch.group_ids.dtype))


def assemble(prompts, result, tokenizer, pad_id: int) -> RolloutBatch:
    """PromptBatch + RolloutResult -> RolloutBatch; prompt fields are repeated per sample (n)."""
    idx = result.prompt_index
    responses = [list(r) if r else [pad_id] for r in result.response_ids]  # an empty reply: 1 pad
    empty = torch.tensor([not r for r in result.response_ids], dtype=torch.bool)
    tensors = pack_sequences([result.prompts[i] for i in idx], responses, pad_id)
    width = max(int(tensors["response_lengths"].max()), 1)
    mask = length_mask(tensors["response_lengths"], width).float()
    mask[empty] = 0.0
    tensors["response_mask"] = mask
    logp = torch.zeros(len(idx), width)
    for row, lp in enumerate(result.logprobs):
        if lp:
            logp[row, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    texts = tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
    return RolloutBatch(tensors, [prompts.ids[i] for i in idx], [prompts.data_sources[i] for i in idx],
                        [prompts.ground_truths[i] for i in idx], [prompts.extras[i] for i in idx],
                        texts, torch.tensor(idx, dtype=torch.long), logp)


def logprob_diff_metrics(rollout_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor,
                         prefix: str = "rollout") -> Dict[str, float]:
    """How far the rollout engine's log-probs are from the actor's on the same tokens (a mismatch
    means off-policy training or a broken weight sync)."""
    valid = mask > 0
    if not bool(valid.any()):
        return {}
    diff = (rollout_lp - actor_lp).abs()[valid]
    return {f"{prefix}/logprob_diff_max": float(diff.max()), f"{prefix}/logprob_diff_mean": float(diff.mean())}


def response_stats(batch: RolloutBatch, prefix: str = "response_length") -> Dict[str, float]:
    """Lengths of the responses trained on (after any filter; verl's names)."""
    lengths = batch.mask.sum(-1)
    return {f"{prefix}/mean": float(lengths.mean()) if len(lengths) else 0.0,
            f"{prefix}/max": float(lengths.max()) if len(lengths) else 0.0}


