"""One batch of prompts being generated in split placement, token by token version-tagged.

    batch = InFlight.start(index, prompts, fitted, n)   # every sample empty
    batch.unfinished()                                  # [(prompt i, sample j), ...]
    batch.extend(rows, result, version, max_tokens)    # a chunk's tokens, tagged `version`
    batch.abort_unfinished()                            # partial_rollout=abort: regenerate them
    batch.groups()                                      # the finished batch, for the trainer

Every generated token carries the policy version (updates applied) of the weights that produced
it, and its log-prob under them (the behaviour policy of the decoupled objective). A batch is
plain lists, so that a checkpoint can hold it exactly (prefixes, versions, log-probs) and a
resumed job continues the prefixes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Tuple

from verl_hpc.rollout.result import RolloutResult


@dataclasses.dataclass
class Sample:
    tokens: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)
    versions: List[int] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None  # None while generating; "stop" | "length"
    # routing replay: the latest chunk's routes of the whole sequence so far (a continuation feeds
    # the prompt and the earlier tokens again, so its routes cover them; models/moe_routes.py)
    routes: Any = None


def samples_of(result: RolloutResult, version: int) -> Iterator[Tuple[int, int, Sample]]:
    """(prompt, sample, Sample) of each row of a whole-response generation under weights `version`,
    with the row's routes where the engine recorded them (routing replay)."""
    routes = result.routes or [None] * len(result)
    for i, j, toks, lps, why, r in zip(result.prompt_index, result.sample_index, result.response_ids, result.logprobs,
                                       result.finish_reason, routes):
        yield i, j, Sample(list(toks), list(lps), [version] * len(toks), why, r)


@dataclasses.dataclass
class InFlight:
    index: int  # the batch's place in the stream (1, 2, ...): batch s is meant for trainer step s
    prompts: Any  # PromptBatch (ids, data sources, ground truths, ...)
    fitted: List[List[int]]  # the prompt tokens generated from (after the overflow policy)
    num_truncated: int
    n: int
    samples: List[List[Sample]]  # [prompt][sample]
    chunks: int = 0  # generation calls so far (seeds of chunked generation)
    aborted_tokens: int = 0  # tokens thrown away by partial_rollout=abort

    @classmethod
    def start(cls, index: int, prompts, fitted, num_truncated: int, n: int) -> "InFlight":
        return cls(index, prompts, fitted, num_truncated, n, [[Sample() for _ in range(n)] for _ in fitted])

    def unfinished(self) -> List[Tuple[int, int]]:
        return [(i, j) for i, row in enumerate(self.samples) for j, s in enumerate(row) if s.finish is None]

    @property
    def done(self) -> bool:
        return not self.unfinished()

    def fill(self, result: RolloutResult, version: int) -> None:
        """A whole-response generation of every sample (chunk_tokens = 0)."""
        for i, j, sample in samples_of(result, version):
            self.samples[i][j] = sample
        self.chunks += 1

    def extend(self, rows: List[Tuple[int, int]], result: RolloutResult, version: int, max_tokens: int) -> None:
        """A chunk: row r of `result` continues sample rows[r]; a sample that reaches max_tokens ends
        with "length" (the chunk's own "length" only means the chunk ended)."""
        routes = result.routes or [None] * len(result)
        for (i, j), toks, lps, why, r in zip(rows, result.response_ids, result.logprobs, result.finish_reason, routes):
            s = self.samples[i][j]
            s.routes = r
            s.tokens += toks
            s.logprobs += lps
            s.versions += [version] * len(toks)
            if why == "stop":
                s.finish = "stop"
            elif len(s.tokens) >= max_tokens:
                s.finish = "length"
        self.chunks += 1

    def abort_unfinished(self) -> int:
        """partial_rollout=abort: unfinished samples start again (under the new weights)."""
        dropped = 0
        for i, j in self.unfinished():
            dropped += len(self.samples[i][j].tokens)
            self.samples[i][j] = Sample()
        self.aborted_tokens += dropped
        return dropped

    def prefix_length(self) -> int:
        """Tokens every unfinished sample holds (chunks keep them equal; 0 when none)."""
        lengths = {len(self.samples[i][j].tokens) for i, j in self.unfinished()}
        return max(lengths) if lengths else 0

    def result(self) -> RolloutResult:
        """The finished batch in the colocated engine's row order (prompt, then sample)."""
        rows = [(i, j, s) for i, row in enumerate(self.samples) for j, s in enumerate(row)]
        return RolloutResult(prompts=self.fitted, prompt_index=[i for i, _, _ in rows],
                             sample_index=[j for _, j, _ in rows], response_ids=[s.tokens for *_, s in rows],
                             logprobs=[s.logprobs for *_, s in rows], finish_reason=[s.finish or "length" for *_, s in rows],
                             num_truncated=self.num_truncated, versions=[s.versions for *_, s in rows],
                             routes=([s.routes for *_, s in rows] if all(s.routes is not None for *_, s in rows)
                                     else None))

    def groups(self) -> "Groups":
        return Groups(self.prompts, self.result())


@dataclasses.dataclass
class Groups:
    """Whole groups (a prompt and its n samples) ready to train; `result.versions` holds each
    token's policy version."""
    prompts: Any  # PromptBatch
    result: RolloutResult

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def versions(self) -> List[List[int]]:
        return self.result.versions

    def oldest_versions(self) -> Dict[int, Optional[int]]:
        """Per group (prompt index): the oldest version among its tokens; None for a group without
        tokens (nothing of it can be stale)."""
        out: Dict[int, Optional[int]] = {i: None for i in range(len(self))}
        for r, i in enumerate(self.result.prompt_index):
            if self.versions[r]:
                v = min(self.versions[r])
                out[i] = v if out[i] is None else min(out[i], v)
        return out

    def select(self, prompts: List[int]) -> "Groups":
        """The groups of `prompts`, renumbered in that order."""
        return Groups(self.prompts.select(prompts), self.result.select_prompts(prompts))

    def split(self, n: int) -> Tuple["Groups", Optional["Groups"]]:
        """(the first n groups, the rest or None)."""
        if len(self) <= n:
            return self, None
        return self.select(list(range(n))), self.select(list(range(n, len(self))))

    @classmethod
    def concat(cls, parts: List["Groups"]) -> "Groups":
        return cls(type(parts[0].prompts).concat([p.prompts for p in parts]),
                   RolloutResult.concat([p.result for p in parts]))


@dataclasses.dataclass
class BatchRecord:
    """What the rollout group hands the trainer for one batch."""
    index: int
    groups: Groups
    stats: Dict[str, float]  # rollout-side seconds and tokens since the previous record
