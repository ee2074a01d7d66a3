"""What `generate` returns: one row per sampled sequence, in prompt order.

Rows are ordered by (prompt_index, sample_index): prompt 0's n samples, then prompt 1's, ...
Every rank of a multi-rank job holds the same global result (see `rollout.engine`).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional, Sequence

FINISH_REASONS = ("stop", "length")  # stop: EOS or a stop string; length: max_tokens reached


@dataclasses.dataclass
class RolloutResult:
    prompts: List[List[int]]  # per prompt: the tokens generated from (after left truncation)
    prompt_index: List[int]  # per sequence: index into `prompts`
    sample_index: List[int]  # per sequence: 0..n-1
    response_ids: List[List[int]]  # per sequence: sampled tokens, EOS included when it ended one
    logprobs: List[List[float]]  # per sequence: logprob of each sampled token (see engine doc)
    finish_reason: List[str]  # per sequence: "stop" | "length"
    num_truncated: int = 0  # prompts cut to data.max_prompt_length (prompt_overflow=truncate)
    # prompt_overflow=reject raises before generating (PromptTooLongError carries the count), so
    # a returned result always has 0 here; the field keeps the metric's place in the interface.
    num_rejected: int = 0
    seconds: float = 0.0  # wall time of the generate call on this rank, gather included
    # split placement: per sequence, per token, the policy version (updates applied) that sampled it
    versions: Optional[List[List[int]]] = None

    def __post_init__(self):
        n = len(self.response_ids)
        if not (len(self.prompt_index) == len(self.sample_index) == len(self.logprobs)
                == len(self.finish_reason) == n) or (self.versions is not None and len(self.versions) != n):
            raise ValueError("RolloutResult: per-sequence lists differ in length")

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> List[int]:
        return [len(r) for r in self.response_ids]

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)

    def finish_counts(self) -> Dict[str, int]:
        counts = collections.Counter(self.finish_reason)
        return {reason: counts.get(reason, 0) for reason in FINISH_REASONS}

    def sequence(self, i: int) -> List[int]:
        """Prompt plus response of row i: the token sequence a trainer scores."""
        return self.prompts[self.prompt_index[i]] + self.response_ids[i]

    def rows_of(self, prompts: Sequence[int]) -> List[int]:
        """The rows (sequences) of the groups of `prompts`, in row order."""
        wanted = set(prompts)
        return [r for r, i in enumerate(self.prompt_index) if i in wanted]

    def select_prompts(self, prompts: Sequence[int]) -> "RolloutResult":
        """The groups of `prompts` only, prompt indices renumbered 0.. in the order given."""
        where = {i: new for new, i in enumerate(prompts)}
        rows = self.rows_of(prompts)
        pick = lambda xs: [xs[r] for r in rows]  # noqa: E731
        return RolloutResult(prompts=[self.prompts[i] for i in prompts],
                             prompt_index=[where[self.prompt_index[r]] for r in rows],
                             sample_index=pick(self.sample_index), response_ids=pick(self.response_ids),
                             logprobs=pick(self.logprobs), finish_reason=pick(self.finish_reason),
                             num_truncated=self.num_truncated,
                             versions=None if self.versions is None else pick(self.versions))

    @classmethod
    def concat(cls, results: Sequence["RolloutResult"]) -> "RolloutResult":
        """One result of the groups of `results` in turn, prompt indices offset accordingly."""
        tagged = all(r.versions is not None for r in results)
        out = cls([], [], [], [], [], [], num_truncated=sum(r.num_truncated for r in results),
                  versions=[] if tagged else None)
        for r in results:
            base = len(out.prompts)
            out.prompts += r.prompts
            out.prompt_index += [base + i for i in r.prompt_index]
            for f in ("sample_index", "response_ids", "logprobs", "finish_reason") + (("versions",) if tagged else ()):
                getattr(out, f).extend(getattr(r, f))
        return out


@dataclasses.dataclass
class ShardOutput:
    """One replica's rows for its contiguous shard of prompts (prompt_index is global)."""
    prompt_index: List[int]
    sample_index: List[int]
    response_ids: List[List[int]]
    logprobs: List[List[float]]
    finish_reason: List[str]

    @classmethod
    def empty(cls) -> "ShardOutput":
        return cls([], [], [], [], [])

    def extend(self, other: "ShardOutput") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))
