"""agent/* metrics of a result whose rows came from agent runs (their EpisodeStats.agent)."""
from __future__ import annotations

from typing import Dict

from verl_hpc.rollout.agents.runs import FAILURES


def agent_metrics(result, prefix: str = "agent") -> Dict[str, float]:
    """Runs, calls, merges and splits (how often a call extended its run's trajectory token for
    token, and how often the agent's history forced a new one), failures by kind; {} otherwise."""
    rows = [e.agent for e in (result.episodes or ()) if getattr(e, "agent", None) is not None]
    if not rows:
        return {}
    runs = [s for s in rows if s.sample_first]
    calls, merges, splits = (sum(getattr(s, k) for s in runs) for k in ("calls", "merges", "splits"))
    out = {f"{prefix}/runs": float(len(runs)), f"{prefix}/sequences": float(len(rows)),
           f"{prefix}/calls": float(calls), f"{prefix}/calls_per_run": calls / max(len(runs), 1),
           f"{prefix}/merges": float(merges), f"{prefix}/splits": float(splits),
           f"{prefix}/merge_rate": merges / max(merges + splits, 1),
           f"{prefix}/history_reused": float(sum(s.reused for s in runs)),
           f"{prefix}/failures": float(sum(bool(s.failure) for s in runs)),
           f"{prefix}/reward_mean": sum(s.reward for s in runs) / max(len(runs), 1)}
    for kind in FAILURES:
        out[f"{prefix}/failures_{kind}"] = float(sum(s.failure == kind for s in runs))
    return out
