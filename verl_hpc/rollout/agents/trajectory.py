"""A sample's recorded model calls -> training sequences, by token id only.

Every call the endpoint served is kept as the engine saw it: the prompt ids the engine received,
the ids it sampled and their log-probs (`Call`). A sample's calls are laid out as sequences:

- a call whose prompt begins with a sequence's tokens so far (its first prompt, then every later
  prompt and completion, in order) *extends* that sequence: the prompt's new tokens (the agent's
  tool results, the template's turn delimiters) are appended with loss mask 0 and log-prob 0, the
  completion with mask 1 and the engine's log-probs. This is a merge.
- any other call (the agent re-templated, truncated or dropped part of its history, or runs two
  conversations) starts a sequence of its own: a split. Its sequences stay in the sample's group.

Nothing is decoded and encoded again here, so the ids trained on are the ids sampled. Each
trajectory is one row of its prompt's group, with its first prompt as the row's prompt
(RolloutResult.row_prompts) and the rest as its response, the mask saying which ids were sampled.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple


@dataclasses.dataclass
class Call:
    """One completion the endpoint served."""
    prompt_ids: List[int]  # exactly as the engine received them
    completion_ids: List[int]  # exactly as sampled (a stop string's token kept, as the engine keeps it)
    logprobs: List[float]  # one per completion id
    finish_reason: str  # "stop" | "length"
    order: int = 0  # when it reached the endpoint (a sample's calls in arrival order)


@dataclasses.dataclass
class Trajectory:
    """One training sequence: `prompt` (its first call's prompt) then `tokens`, with per-token mask
    (1: sampled by the model) and log-probs (0 where the mask is 0)."""
    prompt: List[int]
    tokens: List[int] = dataclasses.field(default_factory=list)
    mask: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)
    calls: int = 0
    finish_reason: str = "stop"

    def ids(self) -> List[int]:
        return self.prompt + self.tokens

    def add(self, gap: Sequence[int], call: Call) -> None:
        self.tokens += list(gap) + list(call.completion_ids)
        self.mask += [0] * len(gap) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(gap) + [float(x) for x in call.logprobs]
        self.calls += 1
        self.finish_reason = call.finish_reason


def merge_calls(calls: Sequence[Call]) -> Tuple[List[Trajectory], int, int]:
    """(trajectories, merges, splits) of one sample's calls. A call extends the most recent
    trajectory its prompt begins with; a call that extends none starts one (a split, except for
    the sample's first)."""
    out: List[Trajectory] = []
    merges = splits = 0
    for call in sorted(calls, key=lambda c: c.order):
        if len(call.logprobs) != len(call.completion_ids):
            raise ValueError(f"call {call.order}: {len(call.logprobs)} log-probs for "
                             f"{len(call.completion_ids)} sampled tokens")
        target = _extended(out, call.prompt_ids)
        if target is None:
            splits += bool(out)
            target = Trajectory(prompt=list(call.prompt_ids))
            out.append(target)
            target.add((), call)
        else:
            merges += 1
            target.add(call.prompt_ids[len(target.ids()):], call)
    return out, merges, splits


def _extended(trajectories: List[Trajectory], prompt: Sequence[int]) -> Optional[Trajectory]:
    for t in reversed(trajectories):
        ids = t.ids()
        if len(prompt) >= len(ids) and list(prompt[:len(ids)]) == ids:
            return t
    return None
