"""Prompts and rollouts -> the step's batch (verl_hpc/trainer/stages/step_batch.py).

Every rank must hand the rollout the SAME global prompt list: rank 0 samples it from the loader and
`broadcast_prompts` sends it to the others. The rollout returns the same global result on every
rank, so `assemble` builds identical tensors everywhere; the engines then split rows over DP ranks.
"""
from __future__ import annotations

from typing import Dict

import torch

from verl_hpc.engines.batch import length_mask, pack_sequences
from verl_hpc.models.moe_routes import pad_routes
from verl_hpc.runtime.objects import broadcast_object
from verl_hpc.trainer.stages.step_batch import StepBatch


def broadcast_prompts(loader, ctx):
    """The next PromptBatch: sampled on rank 0 (the loader lives there), the same on every rank."""
    return broadcast_object(loader.next_batch() if ctx.rank == 0 else None)


def assemble(prompts, result, tokenizer, pad_id: int) -> StepBatch:
    """PromptBatch + RolloutResult -> StepBatch (the rollout's fields); prompt fields are
    repeated per sample (n)."""
    idx = result.prompt_index
    responses = [list(r) if r else [pad_id] for r in result.response_ids]  # an empty reply: 1 pad
    empty = torch.tensor([not r for r in result.response_ids], dtype=torch.bool)
    tensors = pack_sequences([result.prompt_of(r) for r in range(len(idx))], responses, pad_id)
    width = max(int(tensors["response_lengths"].max()), 1)
    mask = length_mask(tensors["response_lengths"], width).float()
    mask[empty] = 0.0
    for row, model in enumerate(result.response_mask or ()):  # episodes: tool and template tokens out
        mask[row, :len(model)] *= torch.tensor(model, dtype=mask.dtype)
    tensors["response_mask"] = mask
    logp = torch.zeros(len(idx), width)
    for row, lp in enumerate(result.logprobs):
        if lp:
            logp[row, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    # what the reward function scores: the response, or an episode's final answer (its last model turn)
    texts = ([e.answer for e in result.episodes] if result.episodes is not None
             else tokenizer.batch_decode(result.response_ids, skip_special_tokens=True))
    routes = (pad_routes(result.routes, tensors["input_ids"].shape[1])
              if getattr(result, "routes", None) else None)  # routing replay: [B, S, L, k]
    return StepBatch(input_ids=tensors["input_ids"], prompt_lengths=tensors["prompt_lengths"],
                     response_lengths=tensors["response_lengths"], response_mask=mask,
                     ids=[prompts.ids[i] for i in idx], data_sources=[prompts.data_sources[i] for i in idx],
                     ground_truths=[prompts.ground_truths[i] for i in idx],
                     extras=[prompts.extras[i] for i in idx], response_texts=texts,
                     group_ids=torch.tensor(idx, dtype=torch.long), rollout_log_probs=logp,
                     media=[prompts.media[i] for i in idx] if prompts.media else None,
                     routed_experts=routes)


def logprob_diff_metrics(rollout_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor,
                         prefix: str = "rollout") -> Dict[str, float]:
    """How far the rollout engine's log-probs are from the actor's on the same tokens (a mismatch
    means off-policy training or a broken weight sync)."""
    valid = mask > 0
    if not bool(valid.any()):
        return {}
    diff = (rollout_lp - actor_lp).abs()[valid]
    return {f"{prefix}/logprob_diff_max": float(diff.max()), f"{prefix}/logprob_diff_mean": float(diff.mean())}


def response_stats(batch: StepBatch, prefix: str = "response_length") -> Dict[str, float]:
    """Lengths of the responses trained on (after any filter; verl's names)."""
    lengths = batch.mask.sum(-1)
    return {f"{prefix}/mean": float(lengths.mean()) if len(lengths) else 0.0,
            f"{prefix}/max": float(lengths.max()) if len(lengths) else 0.0}


