"""`StepBatch`: the typed record one RL step passes from stage to stage.

Each stage fills the fields it owns and reads only what earlier stages filled; a field that is
None has not been computed this step (or the algorithm does not use it). Engines take the dict
format of verl_hpc/engines/batch.py: `engine_batch()` builds it from the filled tensor fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from verl_hpc.models.moe_routes import fit_width

# the per-token tensors an engine role or objective reads, under the engines' key names
ENGINE_FIELDS = ("old_log_probs", "ref_log_probs", "values", "advantages", "returns", "rollout_is_weights",
                 "m2po_keep", "teacher_log_probs", "routed_experts")


@dataclasses.dataclass
class StepBatch:
    """B sequences (prompt + response) of one step; `[B, T]` tensors are right-padded and aligned
    with `response_mask`, `[B]` ones are per sequence.

    Filled by the rollout (trainer/stages/batching.py `assemble`):
        input_ids [B, S], prompt_lengths [B], response_lengths [B], response_mask [B, T],
        ids, data_sources, ground_truths, extras, response_texts (per sequence, from the prompts),
        group_ids [B] (prompt index: the GRPO/RLOO group), rollout_log_probs [B, T] (the rollout
        engine's log-probs of the sampled tokens), routed_experts [B, S, L, k] (routing replay
        rollout: each token's top-k experts per MoE layer, aligned with input_ids;
        verl_hpc.models.moe_routes).
    Filled by scoring (trainer/stages/scoring.py): token_scores [B, T] (outcome score on the last
        response token, DAPO overlong shaping applied); outcome_labels [B] (1.0 where the outcome
        score is >= reward.correct_at, else 0.0); baselines [B] (ReMax: the greedy response's
        reward); reward_components [B, K] (GDPO: the reward function's values of
        algorithm.gdpo_reward_keys) -- before the group filters (DAPO's, PRIME's accuracy band),
        which select rows of every field.
    Filled by the engine roles: old_log_probs and entropy (actor, before the update; with the
        optimal-token-baseline estimators also sum_pi_squared [B, T], sum_v pi_v^2 per token),
        ref_log_probs (reference policy), values (critic), teacher_log_probs (on-policy distillation's
        teacher: the log-prob of each sampled token under it).
    Filled by the implicit PRM (trainer/stages/prm_stage.py, PRIME): process_rewards [B, T] (its dense
        token rewards, as the step trains on them: prm.granularity, prm.reward_norm).
    Filled by the mismatch correction (trainer/stages/correction.py): rollout_is_weights [B, T] (per-token
        weights of the policy loss; None when algorithm.rollout_correction is off); m2po_keep [B, T]
        (policy_loss m2po: the whole batch's second-moment mask).
    Filled by the advantage stage (trainer/stages/advantage.py): rewards (token_scores, with the PRM's
        process rewards added for estimators other than prime, minus the KL penalty when
        algorithm.use_kl_in_reward), advantages (teacher.mode = reward: + the distillation advantage), returns.
    Read by the updates: the actor's objective reads old_log_probs, advantages, ref_log_probs;
        teacher_log_probs (teacher.mode = loss); the critic's values, returns (see
        verl_hpc.algorithms.objectives).
    """

    input_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    ids: List[str]
    data_sources: List[str]
    ground_truths: List[str]
    extras: List[Dict[str, Any]]
    response_texts: List[str]
    group_ids: torch.Tensor
    rollout_log_probs: torch.Tensor
    token_scores: Optional[torch.Tensor] = None
    outcome_labels: Optional[torch.Tensor] = None
    baselines: Optional[torch.Tensor] = None
    reward_components: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    sum_pi_squared: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    process_rewards: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    rollout_is_weights: Optional[torch.Tensor] = None
    m2po_keep: Optional[torch.Tensor] = None
    # routing replay: [B, S, L, k] top-k experts per token and MoE layer (the rollout's, or under
    # model.moe_routing_replay = old those the old-log-prob forward took)
    routed_experts: Optional[torch.Tensor] = None
    # a vision-language model: per sequence its prompt's images (verl_hpc.data.processor.PromptImages,
    # None for a text prompt); the engines take their tensors as `image_inputs`
    media: Optional[List[Any]] = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def mask(self) -> torch.Tensor:
        return self.response_mask

    def engine_batch(self, extra: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
        """The engines' dict (engines/batch.py): the sequence keys and the filled ENGINE_FIELDS
        (+ the fields named in `extra`, e.g. rollout_log_probs for the on-policy shortcut's metric)."""
        out = {"input_ids": self.input_ids, "prompt_lengths": self.prompt_lengths,
               "response_lengths": self.response_lengths, "response_mask": self.response_mask}
        out.update({k: getattr(self, k) for k in (*ENGINE_FIELDS, *extra) if getattr(self, k) is not None})
        if self.media is not None:
            out["image_inputs"] = [m.inputs if m is not None else None for m in self.media]
        return out

    def fill(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """Set the fields a role returned ({"old_log_probs": ..., "entropy": ...}); a key that is
        not a field is an error (a role and the batch disagree about names)."""
        names = {f.name for f in dataclasses.fields(self)}
        for key, value in outputs.items():
            if key not in names:
                raise KeyError(f"StepBatch has no field {key!r}; fields: {', '.join(sorted(names))}")
            setattr(self, key, value)

    def select(self, keep: torch.Tensor) -> "StepBatch":
        """Rows where `keep` ([B] bool) is true, of every field together."""
        rows = keep.nonzero().flatten().tolist()
        b = len(self)

        def take(value):
            if isinstance(value, list):
                return [value[i] for i in rows]
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == b:
                return value[rows]
            return value

        return StepBatch(**{f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)})


def _pad_cat(tensors: Sequence[torch.Tensor], fill) -> torch.Tensor:
    """Row-concatenate, right-padding dim 1 to the widest (1-D tensors are just concatenated)."""
    if tensors[0].dim() < 2:
        return torch.cat(list(tensors))
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors])


def concat_batches(batches: Sequence[StepBatch], pad_id: int) -> StepBatch:
    """Several generation rounds as one batch (DAPO's refill): rows in order, [B, T] tensors
    right-padded to the widest round (pad_id for token ids, 0 elsewhere: outside every response
    mask), group ids made distinct across rounds. A field must be filled in all rounds or none."""
    if len(batches) == 1:
        return batches[0]
    offsets, total = [], 0
    for b in batches:  # a round's group ids are its prompt indices
        offsets.append(total)
        total += int(b.group_ids.max()) + 1 if len(b) else 0
    fields: Dict[str, Any] = {}
    for f in dataclasses.fields(StepBatch):
        values = [getattr(b, f.name) for b in batches]
        if f.name == "group_ids":
            fields[f.name] = torch.cat([g + o for g, o in zip(values, offsets)])
        elif all(v is None for v in values):
            fields[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"concat_batches: {f.name} is filled in some rounds only")
        elif isinstance(values[0], list):
            fields[f.name] = sum(values, [])
        elif f.name == "routed_experts":  # [B, S, L, k]: widened along the sequence with MISSING
            width = max(v.shape[1] for v in values)
            fields[f.name] = torch.cat([fit_width(v, width) for v in values])
        else:
            fields[f.name] = _pad_cat(values, pad_id if f.name == "input_ids" else 0)
    return StepBatch(**fields)


def first_groups(batch: StepBatch, n_groups: int) -> torch.Tensor:
    """Keep mask of the rows of the first `n_groups` groups, in order of appearance."""
    order = list(dict.fromkeys(batch.group_ids.tolist()))[:n_groups]
    return torch.isin(batch.group_ids, torch.tensor(order, dtype=batch.group_ids.dtype))
