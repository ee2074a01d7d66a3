"""Rollout metrics for the tracker: throughput, response lengths, prompt overflow, finish reasons;
and for episodes (multi_turn) turns, tool calls, errors and latency."""
from __future__ import annotations

from typing import Dict

import numpy as np

from verl_hpc.rollout.result import EPISODE_ENDS, RolloutResult


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
        # the prompts of the rows (a prompt of n samples counted n times): with the responses, the
        # tokens a forward pass over the batch runs (the engines run no padding)
        f"{prefix}/prompt_tokens": float(sum(len(result.prompt_of(r)) for r in range(len(result)))),
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
    if result.speculation is not None:  # rollout.speculative: acceptance (rollout/speculative/stats.py)
        out.update(result.speculation.metrics(prefix))
    return out


def episode_metrics(result: RolloutResult, prefix: str = "episode") -> Dict[str, float]:
    """multi_turn: turns per episode, tool calls, tool errors and tool latency (P50/P95); {} for a
    single-turn rollout. Job-wide like rollout_metrics (rank 0's replies reach every rank)."""
    eps = result.episodes
    if not eps:
        return {}
    n = len(eps)
    calls = sum(e.tool_calls for e in eps)
    errors = sum(e.tool_errors for e in eps)
    latencies = np.array([s for e in eps for s in e.tool_seconds], dtype=np.float64)
    model_tokens = sum(sum(m) for m in result.response_mask or ())
    out = {
        f"{prefix}/turns_mean": sum(e.turns for e in eps) / n,
        f"{prefix}/turns_max": float(max(e.turns for e in eps)),
        f"{prefix}/tool_calls": float(calls),
        f"{prefix}/tool_calls_per_episode": calls / n,
        f"{prefix}/tool_call_rate": sum(e.tool_calls > 0 for e in eps) / n,  # share of episodes calling a tool
        f"{prefix}/tool_errors": float(errors),
        f"{prefix}/tool_error_rate": errors / calls if calls else 0.0,
        f"{prefix}/model_token_share": model_tokens / max(result.num_response_tokens, 1),
    }
    if latencies.size:
        out[f"{prefix}/tool_latency_p50_s"] = float(np.percentile(latencies, 50))
        out[f"{prefix}/tool_latency_p95_s"] = float(np.percentile(latencies, 95))
    for end in EPISODE_ENDS:
        out[f"{prefix}/end_{end}"] = float(sum(e.end == end for e in eps))
    from verl_hpc.rollout.agents.metrics import agent_metrics  # agent runs: merges, splits, failures

    out.update(agent_metrics(result, prefix=prefix.replace("episode", "agent")))  # val/episode -> val/agent
    return out
