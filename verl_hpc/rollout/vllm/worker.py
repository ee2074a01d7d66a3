"""What the project reads of vLLM's worker (inside `LLM.collective_rpc`) where the verified releases
differ (rollout/vllm/versions.py).

- The draft model of a speculating engine (the drafter's weight loads, rollout/speculative/drafter.py;
  the served-weights check, rollout/vllm/served.py): vLLM 0.32's worker has `get_draft_model()`;
  0.25's has none, and its model runner keeps the proposer as `drafter`, whose `model` is the draft
  model once loaded (what 0.32's `get_draft_model` returns, less the CUDA-graph wrappers, which a CPU
  engine never has and 0.25's own loaders do not put around it either).
"""
from __future__ import annotations

from verl_hpc.rollout.vllm import versions


def draft_model(worker):
    """The worker's draft model, or None where the engine has none."""
    if versions.release().worker_draft_getter:
        return worker.get_draft_model()
    return getattr(getattr(worker.model_runner, "drafter", None), "model", None)
