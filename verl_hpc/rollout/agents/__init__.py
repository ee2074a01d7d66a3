"""Agent programs as the rollout (agent.enable), behind an OpenAI-compatible endpoint.

  server.py      HTTP on 127.0.0.1: routes, the per-run token, OpenAI error bodies
  service.py     /v1/chat/completions and /v1/completions over the batcher; each call recorded by id
  chat.py        messages -> prompt ids (the model's own ids where the history is the endpoint's), replies
  batcher.py     concurrent requests -> batched generate calls on this rank's engine, from one thread
  runs.py        one agent run: a thread, a time limit, the verdict on what it returned
  trajectory.py  a run's calls -> training sequences, merged where one extends the other token for token
  runner.py      a batch of prompts -> agent runs -> a RolloutResult
  metrics.py     agent/* metrics of a result
"""
from verl_hpc.rollout.agents.runner import AgentOptions, AgentRunner

__all__ = ["AgentOptions", "AgentRunner"]
