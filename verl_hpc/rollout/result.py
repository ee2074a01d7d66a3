"""What `generate` returns: one row per sampled sequence, in prompt order.

Rows are ordered by (prompt_index, sample_index): prompt 0's n samples, then prompt 1's, ...
Every rank of a multi-rank job holds the same global result (see `rollout.engine`).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

FINISH_REASONS = ("stop", "length")  # stop: EOS or a stop string; length: max_tokens reached
# why an episode (multi_turn) ended: the model answered without a tool call (or the environment
# said done), or a limit: model turns, the token budget, the wall-time limit
EPISODE_ENDS = ("answered", "max_turns", "length", "timeout")


@dataclasses.dataclass
class EpisodeStats:
    """One episode's record beside its tokens (verl_hpc/rollout/episodes/runner.py)."""
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools, tools that raised or timed out
    tool_seconds: List[float] = dataclasses.field(default_factory=list)  # per call
    end: str = "answered"  # one of EPISODE_ENDS
    answer: str = ""  # the last model turn's text: what the reward function scores
    # per-turn reward terms: (response position of the turn's last model token, value)
    turn_rewards: List[Tuple[int, float]] = dataclasses.field(default_factory=list)
    # agent.enable: the row's AgentStats (its run's reward replaces the reward function's score;
    # verl_hpc/rollout/agents/runner.py); None for multi_turn episodes
    agent: Any = None


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
    # multi_turn episodes: per sequence, per token, 1 where the model sampled it and 0 on tool output
    # and template tokens (whose logprobs are 0); None = every response token is the model's
    response_mask: Optional[List[List[int]]] = None
    episodes: Optional[List[EpisodeStats]] = None  # multi_turn: per sequence
    # LoRA with adapter sync: the adapter version the engine reports it generated with (None: no adapter)
    adapter_version: Optional[int] = None
    # routing replay (model.moe_routing_replay = rollout): per sequence, a [P + R - 1, L, k] tensor of
    # the top-k experts each fed token took per MoE layer (verl_hpc.models.moe_routes)
    routes: Optional[List[Any]] = None
    # agent runs: per sequence, its own prompt (the first prompt of its calls), in place of
    # prompts[prompt_index]: a group's sequences may begin with different tokens
    row_prompts: Optional[List[List[int]]] = None
    # rollout.speculative: the call's acceptance counts over every replica (a rollout/speculative/stats.py
    # SpecCounts, set by its `measured`); None where the engine does not speculate
    speculation: Optional[Any] = None

    def __post_init__(self):
        n = len(self.response_ids)
        optional = [x for x in (self.versions, self.response_mask, self.episodes, self.routes, self.row_prompts)
                    if x is not None]
        if not (len(self.prompt_index) == len(self.sample_index) == len(self.logprobs)
                == len(self.finish_reason) == n) or any(len(x) != n for x in optional):
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

    def prompt_of(self, i: int) -> List[int]:
        """The prompt of row i."""
        return self.row_prompts[i] if self.row_prompts is not None else self.prompts[self.prompt_index[i]]

    def sequence(self, i: int) -> List[int]:
        """Prompt plus response of row i: the token sequence a trainer scores."""
        return self.prompt_of(i) + self.response_ids[i]

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
                             num_truncated=self.num_truncated, adapter_version=self.adapter_version,
                             **{f: None if getattr(self, f) is None else pick(getattr(self, f))
                                for f in OPTIONAL_ROWS})

    @classmethod
    def concat(cls, results: Sequence["RolloutResult"]) -> "RolloutResult":
        """One result of the groups of `results` in turn, prompt indices offset accordingly."""
        present = tuple(f for f in OPTIONAL_ROWS if all(getattr(r, f) is not None for r in results))
        versions = {r.adapter_version for r in results}
        if len(versions) > 1:  # dynamic sampling's rounds of one step share one policy
            raise RuntimeError(f"rollout: results of adapter versions {sorted(versions, key=str)} joined")
        out = cls([], [], [], [], [], [], num_truncated=sum(r.num_truncated for r in results),
                  adapter_version=versions.pop() if versions else None, **{f: [] for f in present})
        for r in results:
            base = len(out.prompts)
            out.prompts += r.prompts
            out.prompt_index += [base + i for i in r.prompt_index]
            for f in ("sample_index", "response_ids", "logprobs", "finish_reason") + present:
                getattr(out, f).extend(getattr(r, f))
        return out


OPTIONAL_ROWS = ("versions", "response_mask", "episodes", "routes", "row_prompts")  # per-sequence fields that may be None


@dataclasses.dataclass
class ShardOutput:
    """One replica's rows for its contiguous shard of prompts (prompt_index is global)."""
    prompt_index: List[int]
    sample_index: List[int]
    response_ids: List[List[int]]
    logprobs: List[List[float]]
    finish_reason: List[str]
    # per row: the LoRA adapter version the engine generated it with, read from the engine's own
    # output (vLLM's lora_request), -1 without an adapter
    adapter_version: List[int] = dataclasses.field(default_factory=list)
    # per row, its routes when the engine records them (HFRollout with record_routes), else empty
    routes: List[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def empty(cls) -> "ShardOutput":
        return cls([], [], [], [], [], [])

    def one_adapter_version(self) -> Optional[int]:
        """The adapter version every row was generated with (None: no adapter, or no rows). Rows
        that disagree are an error: one batch must come from one policy."""
        seen = set(self.adapter_version)
        if len(seen) > 1:
            raise RuntimeError(f"rollout: one batch generated with adapter versions {sorted(seen)}")
        version = seen.pop() if seen else -1
        return None if version < 0 else version

    def extend(self, other: "ShardOutput") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))
