"""Rollout: sample responses with logprobs from the current policy (docs/architecture.md).

    rollout = build_rollout(options, ctx)             # VLLMRollout or HFRollout (rollout.engine);
                                                      # options: engine_config.RolloutOptions
    result  = rollout.generate(prompts, SamplingSpec.from_config(cfg.rollout).for_step(step))
    metrics = rollout_metrics(result)
    rollout.load_weights(iter_of_hf_name_and_full_tensor)   # after each actor update
    rollout.sleep(); ...; rollout.wake()               # GPU memory between phases (else a no-op)
    rollout.wake(tags=("weights",)); <load_weights>; rollout.wake(tags=("kv_cache",))   # staged

Multi-rank contract and logprob semantics: `rollout/engine.py` and `rollout/vllm/engine.py`.
Laid out by engine: the contract, the factory and the parts every engine shares here; the engines in
`vllm/` and `hf/`; speculative decoding in `speculative/`; multi-turn episodes, tools and agent
programs in `episodes/`, `tools/`, `agents/` (docs/architecture.md). The engine modules import
vLLM / transformers only when an engine is built.
"""
from verl_hpc.rollout.engine import RolloutEngine
from verl_hpc.rollout.factory import build_rollout
from verl_hpc.rollout.metrics import rollout_metrics
from verl_hpc.rollout.prompts import PromptTooLongError
from verl_hpc.rollout.result import RolloutResult
from verl_hpc.rollout.sampling import SamplingSpec

__all__ = ["RolloutEngine", "RolloutResult", "SamplingSpec", "PromptTooLongError", "build_rollout",
           "rollout_metrics", "VLLMRollout", "HFRollout"]


def __getattr__(name):  # lazy: importing the package must not import vllm or transformers
    if name == "VLLMRollout":
        from verl_hpc.rollout.vllm.engine import VLLMRollout

        return VLLMRollout
    if name == "HFRollout":
        from verl_hpc.rollout.hf.engine import HFRollout

        return HFRollout
    raise AttributeError(name)
