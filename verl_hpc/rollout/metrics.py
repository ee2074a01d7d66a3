"""Rollout metrics for the tracker: throughput, response lengths, prompt overflow, finish reasons."""
from __future__ import annotations

from typing import Dict

from verl_hpc.rollout.result import RolloutResult


def rollout_metrics(result: RolloutResult, prefix: str = "rollout") -> Dict[str, float]:
    """Job-wide figures (every rank holds the global result, so any rank may log them).

    tokens_per_s is response tokens over the wall time of the generate call (prefill, decode and
    the gather of results included), i.e. what the step actually waited for.
    """
    lengths = result.response_lengths
    tokens = sum(lengths)
    out = {
        f"{prefix}/sequences": float(len(lengths)),
        f"{prefix}/response_tokens": float(tokens),
        f"{prefix}/response_length_mean": tokens / len(lengths) if lengths else 0.0,
        f"{prefix}/response_length_max": float(max(lengths, default=0)),
        f"{prefix}/prompts_truncated": float(result.num_truncated),
        f"{prefix}/prompts_rejected": float(result.num_rejected),
        f"{prefix}/seconds": result.seconds,
    }
    if result.seconds > 0:
        out[f"{prefix}/tokens_per_s"] = tokens / result.seconds
    for reason, count in result.finish_counts().items():
        out[f"{prefix}/finish_{reason}"] = float(count)
    return out
