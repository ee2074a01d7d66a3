"""The tool responder of an episode runner (verl_hpc/rollout/episodes/runner.py): what answers a model turn
when the job offers tools (an environment's is environment.py).

ToolTurns: the turn's tool calls (`<tool_call>{...}</tool_call>`) run in the pool, all turns' calls
of a round at once; each call's output (or its error, as text) becomes one tool turn. A turn without
a call is the model's answer. A malformed call, an unknown tool, a tool that raises or runs past its
time is an observation the model reads and a counted error; it never ends the job.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from verl_hpc.rollout.episodes.runner import Reply, Turn
from verl_hpc.rollout.tools.calls import parse_tool_calls


class ToolTurns:
    role = "tool"
    stop = ("</tool_call>",)  # a turn ends where its call does: the call runs before more is written

    def __init__(self, pool, *, max_calls_per_turn: int, error_penalty: float = 0.0):
        self.pool, self.max_calls, self.penalty = pool, int(max_calls_per_turn), float(error_penalty)

    def start(self, rows: Sequence[Dict[str, Any]]) -> None:
        pass

    def schemas(self) -> Dict[str, dict]:
        """{name: OpenAI-style schema} of every tool the job offers, for the prompts' chat template."""
        registry = self.pool.registry
        return dict(zip(registry.names(), registry.schemas()))

    def respond(self, turns: Sequence[Turn]) -> List[Reply]:
        parsed = [parse_tool_calls(t.text) for t in turns]
        jobs = [(k, call) for k, p in enumerate(parsed) for call in p.calls[:self.max_calls]]
        outcomes = self.pool.run([(turns[k].offered, call) for k, call in jobs]) if jobs else []
        replies = [Reply(observations=[]) for _ in turns]
        for (k, _), out in zip(jobs, outcomes):
            r = replies[k]
            r.observations.append(out.text)
            r.calls += 1
            r.errors += 0 if out.ok else 1
            r.seconds.append(out.seconds)
        for k, p in enumerate(parsed):
            r = replies[k]
            extra = len(p.calls) - self.max_calls
            problems = list(p.errors) + ([f"error: {extra} tool call(s) past the limit of {self.max_calls} "
                                          "per turn were not run"] if extra > 0 else [])
            r.observations += problems
            r.errors += len(problems)
            r.calls += len(p.errors)  # a malformed call is still a call the model tried to make
            r.done = not r.observations
            r.reward = self.penalty * r.errors
        return replies

    def close(self) -> None:
        self.pool.close()

