"""Speculative decoding's acceptance per rollout (rollout.speculative): what the trainer logs per step.

vLLM counts, per sampled sequence, its verify steps that carried a proposal, the tokens proposed
and how many of them the rejection sampler kept (`per_request_spec_decode_metrics="summary"`,
returned with each finished sequence; no stat logger, no Prometheus registry, which is one per
process and taken over by whichever engine was built last). The vLLM engine adds them up as it
returns rows (`VLLMRollout.speculation_counts()`, cumulative); `measured` turns the counts before
and after one rollout call, over every replica, into the call's figures:

    rollout/spec_acceptance       accepted / proposed tokens, in [0, 1]
    rollout/spec_accepted_length  tokens one verify step emitted, the bonus token included:
                                  1 + accepted / verify steps with a proposal (vLLM's "mean
                                  acceptance length"), in [1, 1 + K]
    rollout/spec_draft_tokens     tokens proposed (0 where a schedule turned speculation off)

Steps without a proposal (a schedule's K = 0 range, or n-gram finding no match) are not counted:
the figures describe the steps that speculated.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional


@dataclasses.dataclass(frozen=True)
class SpecCounts:
    steps: int = 0  # verify steps of a sequence that carried at least one proposed token
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # proposed tokens kept by the rejection sampler

    def __add__(self, other: "SpecCounts") -> "SpecCounts":
        return SpecCounts(self.steps + other.steps, self.drafted + other.drafted, self.accepted + other.accepted)

    def __sub__(self, other: "SpecCounts") -> "SpecCounts":
        return SpecCounts(self.steps - other.steps, self.drafted - other.drafted, self.accepted - other.accepted)

    @classmethod
    def of_vllm(cls, metrics) -> "SpecCounts":
        """From vLLM's RequestSpecDecodeMetrics of one sequence (None: it never speculated)."""
        if metrics is None:
            return cls()
        hist = list(metrics.histogram)  # hist[j]: verify steps that kept j proposed tokens
        return cls(sum(hist), int(metrics.num_draft_tokens), sum(j * c for j, c in enumerate(hist)))

    def metrics(self, prefix: str = "rollout") -> Dict[str, float]:
        out = {f"{prefix}/spec_draft_tokens": float(self.drafted)}
        if self.drafted:
            out[f"{prefix}/spec_acceptance"] = self.accepted / self.drafted
        if self.steps:
            out[f"{prefix}/spec_accepted_length"] = 1.0 + self.accepted / self.steps
        return out


def counts(engine) -> Optional[SpecCounts]:
    """The engine's cumulative counts; None where it does not speculate (the HF rollout, vLLM with
    rollout.speculative off or auto resolved to off, a rollout group's remote handle)."""
    read = getattr(engine, "speculation_counts", None)
    return read() if read is not None else None


def job_wide(engine, local: SpecCounts) -> SpecCounts:
    """The sum over replicas: each replica's TP leader contributes (its TP peers run the same
    scheduler and count the same). A collective when the engine spans several ranks: every rank
    calls it, as every rank calls the rollout."""
    layout = getattr(engine, "layout", None)
    if layout is None or layout.world_size == 1:
        return local
    import torch.distributed as dist

    gathered = [None] * layout.world_size
    dist.all_gather_object(gathered, local if layout.is_leader else None)
    return sum((g for g in gathered if g is not None), SpecCounts())


def measured(engine, call: Callable[[], object]):
    """Run `call` (one rollout: a generate, multi-turn episodes or agent runs over `engine`) and set
    the result's `speculation` to the counts it added, job-wide; left None without speculation."""
    before = counts(engine)
    result = call()
    if before is not None:
        result.speculation = job_wide(engine, counts(engine) - before)
    return result
